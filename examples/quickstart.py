"""twinkle_ray quick start: loader -> sampler group (dp=4) -> trainer group (dp=2, tp=2).

Runs on a laptop with no cluster and no GPU: an embedded Ray declares 8
virtual GPUs, so each group gets 4 of them pinned through
CUDA_VISIBLE_DEVICES (torch.distributed falls back to gloo). Under
``ray job submit`` it attaches to the cluster instead.

    python examples/quickstart.py            # 3 steps
    python examples/quickstart.py --steps 5

It prints the topology, where each batch went (which sampler rank generated
each item, which trainer ranks received it), and a loss computed with an
all-reduce inside the trainer gang.
"""

from __future__ import annotations

import argparse
import os

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function


@remote_class(execute="first")
class PromptLoader:
    """Yields batches of prompt ids; lives on one worker, iterated from the driver."""

    def __init__(self, num_prompts: int, batch_size: int):
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.pos = 0

    def __iter__(self):
        self.pos = 0
        return self

    def __next__(self) -> list[int]:
        if self.pos >= self.num_prompts:
            raise StopIteration
        batch = list(range(self.pos, min(self.pos + self.batch_size, self.num_prompts)))
        self.pos += self.batch_size
        return batch


@remote_class()
class Sampler:
    """A stand-in for a vLLM engine: 'generates' a completion per prompt."""

    def __init__(self, device_mesh: DeviceMesh):
        self.mesh = device_mesh

    @remote_function(dispatch="slice_dp", collect="flatten")
    def generate(self, prompts: list[int]) -> list[dict]:
        rank = twinkle.get_rank()
        return [
            {"prompt": p, "completion": [p, p + 1, p + 2], "sampler_rank": rank,
             "sampler_device": os.environ.get("CUDA_VISIBLE_DEVICES")}
            for p in prompts
        ]


@remote_class()
class Trainer:
    """A stand-in for a Megatron model: dp=2 x tp=2, loss all-reduced across the gang."""

    def __init__(self, device_mesh: DeviceMesh):
        import torch

        self.mesh = device_mesh
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.ones(3))

    @remote_function(dispatch="slice_dp", collect="none")
    def train_step(self, samples: list[dict]) -> dict:
        import torch
        import torch.distributed as dist

        x = torch.tensor([s["completion"] for s in samples], dtype=torch.float32)
        local = ((x * self.weight).sum(dim=1) / 100.0).pow(2).mean()
        total = local.detach().clone()
        dist.all_reduce(total)  # every rank of the gang contributes
        rank = twinkle.get_rank()
        return {
            "rank": rank,
            "dp_rank": self.mesh.get_data_rank_from_global_rank(rank),
            "tp_rank": self.mesh.get_coordinate(rank)[self.mesh.mesh_dim_names.index("tp")],
            "device": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "prompts": [s["prompt"] for s in samples],
            "from_samplers": sorted({s["sampler_rank"] for s in samples}),
            "loss": total.item() / dist.get_world_size(),
        }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="batches to run")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)

    twinkle.initialize(
        "ray",
        groups=[
            DeviceGroup("sampler", ranks=4, device_type="cuda"),
            DeviceGroup("trainer", ranks=4, device_type="cuda"),
        ],
        num_gpus=8,  # virtual GPUs for a laptop; ignored when attaching to a cluster
        num_cpus=8,
    )
    try:
        with twinkle.start_together():  # the three gangs start up at the same time
            loader = PromptLoader(args.steps * args.batch_size, args.batch_size, remote_group="sampler")
            sampler = Sampler(device_mesh=DeviceMesh.from_sizes(dp_size=4), remote_group="sampler")
            trainer = Trainer(device_mesh=DeviceMesh.from_sizes(dp_size=2, tp_size=2), remote_group="trainer")
        print(twinkle.get_device_placement())

        losses = []
        for step, prompts in enumerate(loader):
            samples = sampler.generate(prompts)  # LazyResult: stays in the sampler workers
            per_rank = trainer.train_step(samples)()  # routed sampler -> trainer by dp rank
            n_prompts = len({p for r in per_rank for p in r["prompts"]})
            print(f"\nstep {step}: {n_prompts} prompts")
            for r in per_rank:
                print(f"  trainer rank {r['rank']} (dp {r['dp_rank']}, tp {r['tp_rank']}, "
                      f"GPU {r['device']}): prompts {r['prompts']} from sampler ranks "
                      f"{r['from_samplers']}")
            losses.append(per_rank[0]["loss"])
            print(f"  loss (all-reduced over the trainer gang): {losses[-1]:.4f}")
        print(f"\ndone: {len(losses)} steps, losses {[round(v, 4) for v in losses]}")
        return {"losses": losses, "steps": len(losses)}
    finally:
        twinkle.shutdown()


if __name__ == "__main__":
    main()
