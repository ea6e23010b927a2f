"""examples/rlhf_fsdp_hf.py: an FSDP2 trainer gang and a Hugging Face sampler gang, on CPU.

- the torch process groups FSDP2 shards over are the ones twinkle's mesh says;
- a weight sync from the DTensor shards is bit-equal, on every sampler worker,
  to the trainer's full state dict (sha256 per tensor), and so is the HF
  checkpoint loaded back with ``from_pretrained``;
- ``--quick`` learns (the reward rises), read from its RESULT line.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import ray.cloudpickle
import torch

import twinkle_ray
from conftest import leftovers
from conftest import load_example as _load_example
from twinkle_ray import DeviceGroup
from twinkle_ray.weights import sync_weights

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rlhf_fsdp_hf.py"


def load_example():
    return _load_example(EXAMPLE, "rlhf_fsdp_hf_example")


# ------------------------------------------------------------------------------ no Ray
def test_tokenizer_task_and_reward():
    ex = load_example()
    tok = ex.build_tokenizer()
    ids = tok(["3914="])["input_ids"][0]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "3", "9", "1", "4", "="]
    assert ids[1:5] == [3, 9, 1, 4]  # digit d is token d
    assert ex.expected("3914=") == "4025"
    assert ex.score_text("3914=", "4025") == 1.0 and ex.score_text("3914=", "4?27") == 0.5
    assert ex.answer_texts(tok, torch.tensor([[4, 0, tok.bos_token_id, 5]])) == ["40?5"]
    prompts = ex.make_prompts(5, 4, seed=1)
    assert len(prompts) == 5 and all(len(p) == 5 and p.endswith("=") for p in prompts)
    assert ex.reward_curve([0.1, 0.2, 0.3], window=2, baseline=0.1).count("\n  steps") == 2


def _gather_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from twinkle_ray.weights.layout import module_slabs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)))
        sharded = type(next(iter(model.state_dict().values()))).__name__
        slabs = module_slabs(model)
        row = {"sharded": sharded, "metas": [s.meta() for s in slabs],
               "equal": all(torch.equal(s.tensor, reference[s.name].narrow(s.dim, s.start, s.tensor.shape[s.dim]))
                            for s in slabs),
               "plain": all(type(s.tensor) is torch.Tensor for s in slabs)}
        Path(out_dir, f"{rank}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_module_slabs_of_fsdp2_shards_are_each_ranks_own_rows(tmp_path):
    """``module_slabs`` of a ``fully_shard`` model: every rank its own rows of every tensor, nothing
    gathered (what a weight sync sends from each rank)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gather_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    rows = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert rows[0]["sharded"] == rows[1]["sharded"] == "DTensor"
    for row in rows:
        assert [m[0] for m in row["metas"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert row["equal"] and row["plain"]
    # the two ranks' rows cover every tensor once (torch's Shard(0): ceil chunks)
    for a, b in zip(rows[0]["metas"], rows[1]["metas"], strict=True):
        assert a[4] == 0 and b[4] == a[5] and a[5] + b[5] == a[2][0], (a, b)


# ------------------------------------------------------------------------------ the gangs
@pytest.mark.slow
def test_fsdp2_gang_uses_the_mesh_groups_and_sync_from_shards_is_bit_equal(runtime, tmp_path):
    ex = load_example()
    runtime.initialize("ray", groups=[DeviceGroup("sampler", 2, "cpu"), DeviceGroup("trainer", 2, "cpu")])
    sampler_mesh = twinkle_ray.DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    trainer_mesh = ex.create_fsdp2_mesh(world_size=2, device_type="cpu")
    sampler = ex.Sampler(sampler_mesh, 4, 2, 0, remote_group="sampler")
    trainer = ex.Trainer(trainer_mesh, 4, 0, 1e-2, 1, 0.0, remote_group="trainer")

    # 1. FSDP2's process groups are the mesh's: torch's dim groups == twinkle's rank lists.
    report = trainer.mesh_report()()
    assert [r["rank"] for r in report] == [0, 1]
    for r in report:
        assert r["torch"] == r["twinkle"], r
        assert r["twinkle"]["dp_shard"] == r["twinkle"]["dp"] == r["twinkle"]["dp_shard_cp"] == [0, 1]
        fsdp = r["fsdp"]
        assert fsdp["all_dtensor"] and fsdp["same_mesh"], fsdp
        assert fsdp["dim_names"] == ["dp_shard"] and fsdp["mesh_ranks"] == [0, 1]
        assert fsdp["group_ranks"] == [trainer_mesh.get_group_ranks("dp_shard", r["rank"])]
        assert fsdp["placements"] == ["(Shard(dim=0),)"]
        assert fsdp["local_numel"] < fsdp["full_numel"]  # each rank holds about half
    assert [r["data_rank"] for r in report] == [0, 1]

    # 2. An update on the shards, then a sync: every sampler worker == the trainer's full state dict.
    before = trainer.full_digest()()
    assert len(before) == 1  # rank 0 only: other ranks gathered and returned {}
    sync_weights(trainer, sampler)
    rollouts = sampler.generate(ex.make_prompts(8, 4, seed=3))
    n = 8 * 2
    scores = {"advantage": np.random.default_rng(0).standard_normal(n).astype(np.float32),
              "reward": np.zeros(n, np.float32)}
    metrics = trainer.train_step(rollouts, scores)()
    assert metrics["ratio_err"] < 1e-4, metrics  # the sampler's log-probs are the trainer's
    full = trainer.full_digest()()[0]
    assert full.keys() == before[0].keys() and full != before[0]  # the optimizer moved the shards
    stats = sync_weights(trainer, sampler)
    assert stats.tensors == len(full) and stats.bytes > 0
    samplers = sampler.weight_digest()()
    assert len(samplers) == 2
    for got in samplers:
        assert got == full  # sha256 per tensor, names included: bit-equal

    # 3. The HF checkpoint of the gathered weights loads with from_pretrained, bit-equal too.
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = str(tmp_path / "ckpt")
    assert trainer.save_pretrained(path)() == [path]
    loaded = LlamaForCausalLM.from_pretrained(path)
    assert ex.digest(loaded.state_dict()) == full
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.convert_ids_to_tokens(tok("3914=")["input_ids"]) == ["<bos>", "3", "9", "1", "4", "="]


@pytest.mark.slow
def test_quick_run_learns_and_writes_a_loadable_checkpoint(ray_session, capsys, tmp_path):
    ex = load_example()
    twinkle_ray.shutdown()
    try:
        assert ex.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    finally:
        twinkle_ray.shutdown()
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    with capsys.disabled():
        print(f"\nrlhf_fsdp_hf --quick: reward {result['reward_first']:.3f} -> {result['reward_last']:.3f}, "
              f"greedy {result['greedy_reward']:.3f}, sync {result['sync_mb']:.3f} MB "
              f"{result['sync_s']:.4f}s {result['sync_gb_per_s']:.3f} GB/s, total {result['total_s']:.0f}s")
    assert len(result["rewards"]) == result["steps"] == 30
    assert result["reward_last"] > result["reward_first"] + 0.1, result
    assert result["max_ratio_err"] < 1e-3, result  # every step: the sampler had the trainer's weights
    assert Path(result["checkpoint"], "config.json").is_file()
    assert (tmp_path / "reward_curve.txt").is_file()
    if result["png"]:
        assert Path(result["png"]).stat().st_size > 0
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


# ------------------------------------------------------------------------------ the GPU adapter, on CPU
@pytest.mark.slow
def test_vllm_megatron_fsdp2_trainer_adapter_runs_on_cpu(runtime, tmp_path):
    """examples/vllm_megatron/fsdp2_trainer.py on CPU: loads an HF checkpoint, trains on vLLM-shaped
    rollouts, and syncs HF-named weights (what vLLM's load_weights takes) from its FSDP2 shards."""
    ex = load_example()
    sys.path.insert(0, str(EXAMPLE.parent.parent))
    from examples.vllm_megatron import fsdp2_trainer, megatron_trainer

    for mod in (fsdp2_trainer, megatron_trainer):
        ray.cloudpickle.register_pickle_by_value(mod)
    model = ex.build_model(4, seed=7).eval()
    path = str(tmp_path / "tiny")
    model.save_pretrained(path)
    reference = ex.digest(model.state_dict())

    # vLLM's rollout layout (prompt_ids, completion_ids, logprobs), sampled from the same weights
    tok = ex.build_tokenizer()
    ids = tok(ex.make_prompts(4, 4, seed=5), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=4,
                             eos_token_id=None, pad_token_id=tok.pad_token_id, top_k=0)
        logp = model(input_ids=seq).logits[:, ids.shape[1] - 1:-1].log_softmax(-1)
        logp = logp.gather(-1, seq[:, ids.shape[1]:, None])[..., 0]
    rollouts = [{"prompt_ids": seq[i, :ids.shape[1]].tolist(), "completion_ids": seq[i, ids.shape[1]:].tolist(),
                 "logprobs": logp[i].tolist()} for i in range(4)]
    scores = {"advantage": [1.0, -1.0, 0.5, -0.5], "reward": [1.0, 0.0, 0.75, 0.25]}

    runtime.initialize("ray", groups=[DeviceGroup("trainer", 2, "cpu"), DeviceGroup("sampler", 2, "cpu")])
    trainer = fsdp2_trainer.FSDP2Trainer(path, device_mesh=ex.create_fsdp2_mesh(world_size=2, device_type="cpu"),
                                         lr=1e-2, remote_group="trainer")
    sampler = ex.Sampler(twinkle_ray.DeviceMesh.from_sizes(dp_size=2, device_type="cpu"), 4, 2, 0,
                         remote_group="sampler")
    stats = sync_weights(trainer, sampler)
    assert sorted(stats.names) == sorted(reference)  # HF names, straight from the FSDP2 state dict
    assert sampler.weight_digest()() == [reference, reference]  # bit-equal to the checkpoint
    metrics = trainer.train_step(rollouts, scores)()
    assert metrics["ratio_err"] < 1e-4, metrics  # the trainer's log-probs are the sampler's
    sync_weights(trainer, sampler)
    after = sampler.weight_digest()()
    assert after[0] == after[1] and after[0] != reference  # trained, and the same on both receivers
