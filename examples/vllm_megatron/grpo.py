"""GRPO with a vLLM sampler group and a Megatron trainer group (GPUs), on the same API as the CPU example.

    loader -> VLLMSampler gang (engines of TP=--sampler-tp) -> reward (CPU)
        -> MegatronTrainer gang (dp x tp) -> weight sync (NCCL) -> next step

    python examples/vllm_megatron/grpo.py --check            # what is installed, what is missing
    python examples/vllm_megatron/grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --prompts rows.jsonl
    ray job submit --working-dir . -- python examples/vllm_megatron/grpo.py --model ... --prompts ...
    python examples/vllm_megatron/grpo.py --trainer fsdp2 ...   # FSDP2Trainer (HF model, fully_shard)

``--trainer fsdp2`` swaps Megatron for :class:`FSDP2Trainer` (fsdp2_trainer.py):
the HF model under torch FSDP2 on ``--trainer-dp`` GPUs, the building blocks
that ``examples/rlhf_fsdp_hf.py`` runs on CPU in CI; it needs no Megatron.

``--prompts`` is a JSON-lines file of {"prompt": str, "answer": str}; the
reward is 1 when the completion contains the answer. Needs vLLM,
Megatron-Bridge and (sampler_gpus + trainer_gpus) CUDA GPUs. Not run in this
repository (no GPU, neither framework installed): see README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `examples.vllm_megatron` as a package, as the workers see it

import numpy as np  # noqa: E402

import twinkle_ray as twinkle  # noqa: E402
from examples.vllm_megatron.common import MissingDependency, require  # noqa: E402
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function  # noqa: E402
from twinkle_ray.data import DataLoader  # noqa: E402
from twinkle_ray.weights import sync_weights  # noqa: E402


@remote_class()
class AnswerReward:
    """1.0 when the completion contains the row's answer; GRPO advantages within each prompt's group."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    @remote_function(collect="flatten")
    def score(self, rollouts: list[dict]) -> dict:
        reward = np.array([float(str(r.get("answer", "")) in r["text"]) for r in rollouts], dtype=np.float32)
        groups = reward.reshape(-1, self.group_size)
        adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-4)
        return {"reward": reward, "advantage": adv.reshape(-1)}


def endless(loader):
    """Batches across epochs (the loader reshuffles each epoch)."""
    while True:
        yield from loader


def check() -> int:
    """Say what this machine has for the GPU example; 0 when everything is there."""
    missing = []
    for module, install in (("vllm", "pip install vllm"), ("megatron.bridge", "pip install megatron-bridge")):
        try:
            require(module, install, "examples/vllm_megatron")
            print(f"{module}: installed")
        except MissingDependency as e:
            missing.append(str(e))
            print(f"{module}: MISSING ({install})")
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        n = 0
    print(f"CUDA GPUs visible here: {n}")
    if missing or n == 0:
        print("=> this machine cannot run examples/vllm_megatron/grpo.py; "
              "examples/rlhf_grpo.py runs the same flow on CPU")
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only report what is installed")
    p.add_argument("--model", help="HF model id or path (both frameworks load it)")
    p.add_argument("--prompts", help="JSON-lines file of {prompt, answer}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step (global)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--sampler-engines", type=int, default=2)
    p.add_argument("--sampler-tp", type=int, default=2, help="GPUs per vLLM engine (gpus_per_worker)")
    p.add_argument("--trainer", choices=("megatron", "fsdp2"), default="megatron",
                   help="Megatron-Core via Megatron-Bridge, or the HF model under torch FSDP2")
    p.add_argument("--trainer-dp", type=int, default=2)
    p.add_argument("--trainer-tp", type=int, default=2, help="Megatron only (FSDP2 shards over --trainer-dp)")
    p.add_argument("--lr", type=float, default=1e-6)
    args = p.parse_args(argv)
    if args.check:
        return check()
    if not (args.model and args.prompts):
        p.error("--model and --prompts are required (or --check)")
    needed = [("vllm", "pip install vllm")]
    if args.trainer == "megatron":
        needed.append(("megatron.bridge", "pip install megatron-bridge"))
    for module, install in needed:
        require(module, install, "examples/vllm_megatron/grpo.py")  # fail here, clearly, not in a gang
    trainer_gpus = args.trainer_dp * (args.trainer_tp if args.trainer == "megatron" else 1)

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    tp, engines = args.sampler_tp, args.sampler_engines
    groups = [
        DeviceGroup("data", 1, "cpu"),
        DeviceGroup("reward", 1, "cpu"),
        DeviceGroup("sampler", engines * tp, "cuda", gpus_per_worker=tp),
        DeviceGroup("trainer", trainer_gpus, "cuda"),
    ]
    extra = {} if os.environ.get("RAY_ADDRESS") else {
        "runtime_env": {"env_vars": {"PYTHONPATH": str(ROOT)}}}  # workers import examples.vllm_megatron
    twinkle.initialize("ray", groups=groups, **extra)
    try:
        from examples.vllm_megatron.fsdp2_trainer import FSDP2Trainer
        from examples.vllm_megatron.megatron_trainer import MegatronTrainer
        from examples.vllm_megatron.vllm_sampler import VLLMSampler
        from twinkle_ray.mesh_factory import create_fsdp2_mesh

        print(twinkle.get_device_placement())
        sampler_mesh = DeviceMesh.from_sizes(dp_size=engines, tp_size=tp)
        if args.trainer == "fsdp2":
            trainer_mesh = create_fsdp2_mesh(world_size=trainer_gpus)
        else:
            trainer_mesh = DeviceMesh.from_sizes(dp_size=args.trainer_dp, tp_size=args.trainer_tp)
        loader = DataLoader(rows, batch_size=args.batch_size, device_mesh=sampler_mesh, shuffle=True,
                            remote_group="data")
        sampler = VLLMSampler(args.model, device_mesh=sampler_mesh, n=args.group_size, remote_group="sampler")
        reward = AnswerReward(args.group_size, remote_group="reward")
        trainer_cls = FSDP2Trainer if args.trainer == "fsdp2" else MegatronTrainer
        trainer = trainer_cls(args.model, device_mesh=trainer_mesh, lr=args.lr, remote_group="trainer")
        print(f"initial weight sync: {sync_weights(trainer, sampler)}")
        batches = endless(loader)
        for step in range(1, args.steps + 1):
            rollouts = sampler.generate(next(batches))
            scores = reward.score(rollouts)
            metrics = trainer.train_step(rollouts, scores)()
            stats = sync_weights(trainer, sampler)
            print(f"step {step}/{args.steps}  reward {metrics['reward']:.3f}  loss {metrics['loss']:+.4f}  "
                  f"sync {stats.bytes / 1e9:.2f} GB {stats.seconds:.2f}s ({stats.gb_per_s:.1f} GB/s)")
    finally:
        twinkle.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
