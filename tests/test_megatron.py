"""examples/vllm_megatron/megatron_trainer.py on real Megatron-Core, on CPU (gloo), in 2-worker gangs.

- HF -> Megatron TP=2 -> HF round-trips bit-equal; TP=2 logits (as log-probs) equal HF's within 1e-4;
- Megatron's TP / PP / DP rank lists equal the DeviceMesh's, and a mesh whose layout differs is refused;
- a few GRPO steps lower the loss with TP=2 and with PP=2; the saved checkpoint loads with from_pretrained;
- bad knobs raise errors naming the knob (no Megatron needed for those).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from twinkle_ray import DeviceGroup, DeviceMesh  # noqa: E402


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


HAVE_MEGATRON = _installed("megatron.core")
needs_megatron = pytest.mark.skipif(
    not HAVE_MEGATRON, reason="megatron-core is not installed: run `bash scripts/setup.sh rlhf`")


def _modules():
    """The example's modules, pickled by value so the gang workers need no PYTHONPATH."""
    import ray.cloudpickle

    from examples.vllm_megatron import common, hf_megatron, megatron_cpu, megatron_trainer

    for mod in (common, hf_megatron, megatron_cpu, megatron_trainer):
        ray.cloudpickle.register_pickle_by_value(mod)
    return megatron_trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny HF Llama checkpoint (tiny_llama.py), its state dict and a vLLM-shaped rollout batch."""
    import torch

    from examples.vllm_megatron.tiny_llama import (
        build_model,
        build_tokenizer,
        make_prompts,
        save_tiny_llama,
    )

    path = save_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "init"), seed=3)
    model = build_model(3).eval()
    tok = build_tokenizer()
    ids = tok(make_prompts(8, 4, seed=5), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=4,
                             min_new_tokens=4, eos_token_id=None, pad_token_id=tok.pad_token_id, top_k=0)
        logp = model(input_ids=seq).logits[:, ids.shape[1] - 1:-1].float().log_softmax(-1)
        logp = logp.gather(-1, seq[:, ids.shape[1]:, None])[..., 0]
    n = ids.shape[1]
    rollouts = [{"prompt_ids": seq[i, :n].tolist(), "completion_ids": seq[i, n:].tolist(),
                 "logprobs": logp[i].tolist()} for i in range(len(seq))]
    reward = np.array([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.0], dtype=np.float32)
    scores = {"reward": reward, "advantage": (reward - reward.mean()) / (reward.std() + 1e-4)}
    return {"path": path, "state": model.state_dict(), "rollouts": rollouts, "scores": scores,
            "logprobs": logp}


# ------------------------------------------------------------------------------ no Megatron needed
def test_bad_knobs_name_the_knob(tmp_path):
    from examples.vllm_megatron.megatron_trainer import MegatronTrainer

    mesh = DeviceMesh.from_sizes(tp_size=2, device_type="cpu")
    for knob, value in (("lr", 0.0), ("clip", 1.5), ("ppo_epochs", 0), ("entropy_coef", -1.0),
                        ("grad_clip", -1.0), ("micro_batch_size", 0), ("weight_decay", -0.1)):
        with pytest.raises(ValueError, match=rf"MegatronTrainer: {knob}="):
            MegatronTrainer(str(tmp_path), device_mesh=mesh, **{knob: value})
    with pytest.raises(ValueError, match=r"mesh dim\(s\) \['cp'\] are not supported"):
        MegatronTrainer(str(tmp_path), device_mesh=DeviceMesh.from_sizes(cp_size=2, device_type="cpu"))


def test_missing_megatron_or_mesh_raise_clearly(tmp_path, monkeypatch):
    from examples.vllm_megatron.common import MissingDependency
    from examples.vllm_megatron.megatron_trainer import MegatronTrainer

    with pytest.raises(TypeError, match="device_mesh must be a twinkle DeviceMesh"):
        MegatronTrainer(str(tmp_path), device_mesh={"tp": 2})
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # as if megatron-core were not installed
    with pytest.raises(MissingDependency, match=r"bash scripts/setup.sh rlhf"):
        MegatronTrainer(str(tmp_path), device_mesh=DeviceMesh.from_sizes(tp_size=2, device_type="cpu"))


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
@needs_megatron
def test_a_mesh_larger_than_the_gang_is_refused(tmp_path):
    """In-process (no torch.distributed: a world of 1) with a 2-rank mesh: refused before any Megatron set-up."""
    from examples.vllm_megatron.megatron_trainer import MegatronTrainer

    with pytest.raises(ValueError, match=r"the gang has 1 worker\(s\) but the DeviceMesh has 2 \(tp=2 x pp=1 x dp=1\)"):
        MegatronTrainer(str(tmp_path), device_mesh=DeviceMesh.from_sizes(tp_size=2, device_type="cpu"))


def test_unmapped_hf_configs_and_checkpoints_are_refused(tiny, tmp_path):
    import torch
    from transformers import AutoConfig

    from examples.vllm_megatron.hf_megatron import LlamaSpec, load_hf_state

    cfg = AutoConfig.from_pretrained(tiny["path"])
    for field, value, msg in (("attention_bias", True, "attention_bias=True is not mapped"),
                              ("hidden_act", "gelu", "hidden_act='gelu' is not mapped"),
                              ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4}, "rope_type 'llama3'")):
        bad = AutoConfig.from_pretrained(tiny["path"])
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=msg):
            LlamaSpec.from_hf(bad)
    spec = LlamaSpec.from_hf(cfg)
    with pytest.raises(ValueError, match="num_hidden_layers=2 is not divisible by pp_size=4"):
        spec.check_parallel(1, 4)
    with pytest.raises(KeyError, match="no HF tensor for Megatron parameter 'decoder.layers.0.mlp.router.weight'"):
        spec.shard_from_hf(tiny["state"], "decoder.layers.0.mlp.router.weight", layer_offset=0, tp_rank=0, tp=1)
    wrong = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"decoder.final_layernorm.weight is \(3, 3\) but the HF checkpoint gives \(128,\)"):
        spec.load_into([("decoder.final_layernorm.weight", wrong)], tiny["state"], layer_offset=0, tp_rank=0, tp=1)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors in"):
        load_hf_state(str(tmp_path))


def test_mesh_group_check_names_the_sizes():
    from examples.vllm_megatron.megatron_trainer import check_mesh_groups

    mesh = DeviceMesh.from_sizes(pp_size=2, tp_size=2, device_type="cpu")
    check_mesh_groups(mesh, {"tp": [2, 3], "pp": [1, 3], "dp": [3]}, rank=3)
    with pytest.raises(ValueError, match=r"tp group of rank 3 is \[1, 3\] but the DeviceMesh's is \[2, 3\] "
                                         r"\(mesh sizes tp=2, pp=2, dp=1"):
        check_mesh_groups(mesh, {"tp": [1, 3], "pp": [2, 3], "dp": [3]}, rank=3)


def test_hf_megatron_mapping_round_trips_without_megatron(tiny):
    """Sharding HF tensors for TP=2 and gathering them back gives every HF tensor bit-equal."""
    import torch
    from transformers import AutoConfig

    from examples.vllm_megatron.hf_megatron import LlamaSpec

    spec = LlamaSpec.from_hf(AutoConfig.from_pretrained(tiny["path"]))
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(spec.layers):
        names += [f"decoder.layers.{i}.{k}" for k in (
            "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
    back = {}
    for name in names:
        shards = [spec.shard_from_hf(tiny["state"], name, layer_offset=0, tp_rank=r, tp=2) for r in range(2)]
        if spec.tp_dim(name) is not None:
            assert shards[0].shape != spec.full_from_hf(tiny["state"], name, 0).shape, name
        back.update(spec.hf_from_shards(name, shards, layer_offset=0))
    assert sorted(back) == sorted(tiny["state"])
    for k, v in tiny["state"].items():
        assert torch.equal(back[k], v), k
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp_size=4"):
        spec.check_parallel(4, 1)


# ------------------------------------------------------------------------------ real Megatron, gangs
def _trainer(runtime, tiny, mesh, **kw):
    mt = _modules()
    runtime.initialize("ray", groups=[DeviceGroup("trainer", 2, "cpu")])
    return mt.MegatronTrainer(tiny["path"], device_mesh=mesh, remote_group="trainer", **kw)


def _hf_logprobs(model, rows):
    import torch

    n = len(rows[0]["prompt_ids"])
    seq = torch.tensor([r["prompt_ids"] + r["completion_ids"] for r in rows])
    with torch.no_grad():
        logp = model.eval()(input_ids=seq).logits[:, n - 1:-1].float().log_softmax(-1)
    return logp.gather(-1, seq[:, n:, None])[..., 0]


def _train(trainer, tiny, steps):
    losses, metrics = [], []
    for _ in range(steps):
        m = trainer.train_step(tiny["rollouts"], tiny["scores"])()
        metrics.append(m)
        losses.append(m["loss"])
    return losses, metrics


@needs_megatron
@pytest.mark.slow
def test_tp2_round_trip_logprobs_groups_and_training(runtime, tiny, tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    mesh = DeviceMesh.from_sizes(tp_size=2, device_type="cpu")
    trainer = _trainer(runtime, tiny, mesh, lr=2e-3, ppo_epochs=2, entropy_coef=0.1)
    for r in trainer.mesh_report()():
        assert r["megatron"] == r["mesh"], r
        assert r["megatron"]["tp"] == [0, 1]
    # HF -> Megatron TP=2 -> HF: bit-equal
    back = trainer.hf_state()()
    assert sorted(back) == sorted(tiny["state"])
    for k, v in tiny["state"].items():
        assert torch.equal(back[k], v), k
    # the TP=2 model's log-probs (vocab-parallel cross-entropy over its logits) equal HF's within 1e-4
    got = torch.tensor(trainer.probe_logprobs(tiny["rollouts"])())
    assert (got - tiny["logprobs"]).abs().max().item() <= 1e-4
    # and its logits over the whole vocabulary (TP shards gathered) equal HF's within 1e-4
    from examples.vllm_megatron.tiny_llama import build_model

    seq = torch.tensor([r["prompt_ids"] + r["completion_ids"] for r in tiny["rollouts"]])
    with torch.no_grad():
        want = build_model(3).eval()(input_ids=seq).logits.float()
    logits = trainer.full_logits(tiny["rollouts"])()
    assert logits.shape == want.shape and (logits - want).abs().max().item() <= 1e-4
    losses, metrics = _train(trainer, tiny, 4)
    assert metrics[0]["ratio_err"] <= 1e-4, metrics[0]  # rollout log-probs are the trainer's
    assert losses[-1] < losses[0], losses
    # the trained weights save as an HF checkpoint that from_pretrained loads, equal to the gathered ones
    after = trainer.hf_state()()
    assert any(not torch.equal(after[k], tiny["state"][k]) for k in after)
    path = trainer.save_hf(str(tmp_path / "ckpt"))()
    loaded = LlamaForCausalLM.from_pretrained(path)
    for k, v in after.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # what a sampler loading these tensors computes is what the trainer computes
    got = torch.tensor(trainer.probe_logprobs(tiny["rollouts"])())
    assert (got - _hf_logprobs(loaded, tiny["rollouts"])).abs().max().item() <= 1e-4


@needs_megatron
@pytest.mark.slow
def test_pp2_groups_round_trip_and_training(runtime, tiny):
    import torch

    mesh = DeviceMesh.from_sizes(pp_size=2, device_type="cpu")
    trainer = _trainer(runtime, tiny, mesh, lr=2e-3, ppo_epochs=2, micro_batch_size=2)
    reports = trainer.mesh_report()()
    for r in reports:
        assert r["megatron"] == r["mesh"], r
    assert sorted(r["pp_rank"] for r in reports) == [0, 1]
    back = trainer.hf_state()()  # stage 1's layers come to rank 0
    assert sorted(back) == sorted(tiny["state"])
    for k, v in tiny["state"].items():
        assert torch.equal(back[k], v), k
    got = torch.tensor(trainer.probe_logprobs(tiny["rollouts"])())
    assert (got - tiny["logprobs"]).abs().max().item() <= 1e-4
    with pytest.raises(Exception, match=r"micro_batch_size=2 does not divide this data rank's 7 rows"):
        trainer.probe_logprobs(tiny["rollouts"][:7])()  # refused on every rank before any collective
    losses, _ = _train(trainer, tiny, 4)
    assert losses[-1] < losses[0], losses


@needs_megatron
@pytest.mark.slow
def test_a_mesh_whose_layout_is_not_megatrons_is_refused(runtime, tiny):
    """tp ranks [1, 0]: Megatron's tp group is [0, 1]; the constructor names the sizes, nothing hangs."""
    mesh = DeviceMesh(mesh=np.array([1, 0]), mesh_dim_names=("tp",), device_type="cpu")
    with pytest.raises(Exception, match=r"Megatron's tp group of rank \d is \[0, 1\] but the DeviceMesh's is "
                                        r"\[1, 0\] \(mesh sizes tp=2, pp=1, dp=1"):
        trainer = _trainer(runtime, tiny, mesh)
        trainer.mesh_report()()


@needs_megatron
@pytest.mark.slow
def test_pp2_with_tied_embeddings(runtime, tiny, tmp_path):
    """Tied embeddings over PP=2 (Megatron keeps a copy on the last stage, W8): the export has one
    embedding, and after training the saved checkpoint computes the trainer's log-probs."""
    import torch
    from transformers import LlamaForCausalLM

    from examples.vllm_megatron.tiny_llama import build_tokenizer, model_config

    torch.manual_seed(4)
    cfg = model_config()
    cfg.tie_word_embeddings = True
    hf = LlamaForCausalLM(cfg).float().eval()
    path = str(tmp_path / "tied")
    hf.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    mt = _modules()
    runtime.initialize("ray", groups=[DeviceGroup("trainer", 2, "cpu")])
    trainer = mt.MegatronTrainer(path, device_mesh=DeviceMesh.from_sizes(pp_size=2, device_type="cpu"), lr=2e-3,
                                 remote_group="trainer")
    back = trainer.hf_state()()
    want = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert sorted(back) == sorted(want)
    assert all(torch.equal(back[k], v) for k, v in want.items())
    got = torch.tensor(trainer.probe_logprobs(tiny["rollouts"])())
    assert (got - _hf_logprobs(hf, tiny["rollouts"])).abs().max().item() <= 1e-4
    _train(trainer, tiny, 2)
    loaded = LlamaForCausalLM.from_pretrained(trainer.save_hf(str(tmp_path / "ckpt"))())
    assert not torch.equal(loaded.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    got = torch.tensor(trainer.probe_logprobs(tiny["rollouts"])())
    assert (got - _hf_logprobs(loaded, tiny["rollouts"])).abs().max().item() <= 1e-4
