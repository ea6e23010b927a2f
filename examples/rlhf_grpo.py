"""GRPO on CPU with twinkle_ray: a tiny policy that really learns.

    loader (1 worker) -> sampler group (dp=2) -> reward group (1 CPU worker)
        -> trainer group (dp=2, DDP over the gang, gloo) -> weight sync -> next step

The task: a prompt is 6 random digits; the policy answers 6 digits and the
reward is the fraction of positions ``t`` where the answer is
``(prompt[t] + t) % 10``. A random policy scores 0.1; with the default
settings the mean reward passes about 0.7 within 100 steps (about a minute
or two on 2 CPU cores).

The policy is a tiny autoregressive model: at answer position ``t`` it sees
the previous answer token, the prompt digit at ``t`` and ``t`` itself. The
sampler draws ``--group-size`` answers per prompt; the reward worker scores
them and normalises rewards within each prompt's group (GRPO's advantage);
the trainer takes one clipped policy-gradient step per batch (one step per
batch, so the ratio to the sampler's log-probs is 1 and the clipped
objective is the plain policy gradient), plus an entropy bonus, with DDP
all-reducing gradients over the gang. Then the trainer's rank 0 broadcasts
the new weights to both sampler workers over a separate gloo group.

Data never passes through the driver: batches stay in the loader's worker
until the samplers pull their halves, rollouts go from the samplers straight
to the reward worker and the trainers. The driver only reads each step's
metrics.

    python examples/rlhf_grpo.py                 # 100 steps, embedded Ray
    python examples/rlhf_grpo.py --quick         # 20 steps, larger learning rate
    python examples/rlhf_grpo.py --ray-data      # prompts from a Ray Data dataset
    ray job submit --working-dir . -- python examples/rlhf_grpo.py   # on a cluster

It prints one line per step and the reward curve at the end (text, and a
PNG when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import numpy as np
import torch

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.data import DataLoader
from twinkle_ray.weights import WeightSyncMixin, sync_weights

VOCAB = 10
LENGTH = 6
HIDDEN = 128


def target(prompts: torch.Tensor) -> torch.Tensor:
    """The right answer: each digit shifted by its position."""
    return (prompts + torch.arange(prompts.shape[1])) % VOCAB


class Policy(torch.nn.Module):
    """Logits for answer position t from (previous token, prompt digit t, t)."""

    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.prev = torch.nn.Embedding(VOCAB + 1, hidden)  # VOCAB = begin-of-answer
        self.prompt = torch.nn.Embedding(VOCAB, hidden)
        self.pos = torch.nn.Embedding(LENGTH, hidden)
        self.head = torch.nn.Sequential(
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, VOCAB),
        )

    def forward(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [N, LENGTH, VOCAB] of every answer position (teacher-forced)."""
        prev = torch.cat([torch.full_like(answers[:, :1], VOCAB), answers[:, :-1]], dim=1)
        h = self.prev(prev) + self.prompt(prompts) + self.pos.weight[None]
        return torch.log_softmax(self.head(h), dim=-1)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample answers token by token; returns (answers, their log-probs)."""
        answers = torch.zeros_like(prompts)
        logp = torch.zeros(prompts.shape, dtype=torch.float32)
        for t in range(prompts.shape[1]):
            lp = self(prompts, answers)[:, t]
            tok = torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]
            answers[:, t] = tok
            logp[:, t] = lp.gather(1, tok[:, None])[:, 0]
        return answers, logp


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """The prompt set (built inside the loader's worker)."""
    return np.random.default_rng(seed).integers(0, VOCAB, (n, LENGTH)).tolist()


@remote_class()
class Sampler(WeightSyncMixin):
    """Generates group_size answers per prompt with the latest synced weights."""

    def __init__(self, device_mesh: DeviceMesh, group_size: int, seed: int):
        self.model = Policy().eval()
        self.group_size = group_size
        self.gen = torch.Generator().manual_seed(seed * 1000 + twinkle.get_rank())

    @remote_function(dispatch="slice_dp", collect="flatten")
    def generate(self, prompts: list) -> dict:
        p = torch.tensor(prompts, dtype=torch.long).repeat_interleave(self.group_size, dim=0)
        answers, logp = self.model.generate(p, self.gen)
        return {"prompt": p.numpy(), "answer": answers.numpy(), "logp": logp.numpy()}


@remote_class()
class Reward:
    """Scores rollouts; GRPO advantages are rewards normalised within each prompt's group."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    @remote_function(collect="flatten")
    def score(self, rollouts: dict) -> dict:
        prompts = torch.tensor(rollouts["prompt"])  # a copy: arrays from the object store are read-only
        answers = torch.tensor(rollouts["answer"])
        reward = (answers == target(prompts)).float().mean(dim=1)
        groups = reward.view(-1, self.group_size)
        adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-4)
        return {"reward": reward.numpy(), "advantage": adv.reshape(-1).numpy()}


@remote_class()
class Trainer(WeightSyncMixin):
    """The policy under DDP over the gang (gloo); one GRPO step per batch."""

    def __init__(self, device_mesh: DeviceMesh, lr: float, entropy_coef: float, clip: float = 0.2):
        import torch.distributed as dist

        self.model = Policy()  # every worker is seeded alike; DDP also broadcasts rank 0's weights
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model) if dist.is_initialized() else self.model
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.entropy_coef = entropy_coef
        self.clip = clip

    @remote_function(dispatch="slice_dp", collect="mean")
    def train_step(self, rollouts: dict, scores: dict) -> dict:
        prompts = torch.tensor(rollouts["prompt"])
        answers = torch.tensor(rollouts["answer"])
        old_logp = torch.tensor(rollouts["logp"])
        adv = torch.tensor(scores["advantage"])[:, None]
        lp_all = self.ddp(prompts, answers)
        logp = lp_all.gather(-1, answers[..., None])[..., 0]
        ratio = torch.exp(logp - old_logp)
        surrogate = torch.min(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
        entropy = -(lp_all.exp() * lp_all).sum(-1).mean()
        loss = -surrogate.mean() - self.entropy_coef * entropy
        self.opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients over the gang here
        self.opt.step()
        return {"loss": loss.item(), "entropy": entropy.item(),
                "reward": float(np.mean(scores["reward"]))}


def groups() -> list[DeviceGroup]:
    return [
        DeviceGroup("data", 1, "cpu"),
        DeviceGroup("sampler", 2, "cpu"),
        DeviceGroup("reward", 1, "cpu"),
        DeviceGroup("trainer", 2, "cpu"),
    ]


def endless(loader):
    """Batches across epochs (each epoch reshuffled by the loader)."""
    while True:
        yield from loader


def ray_data_prompts(n: int, seed: int):
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray.data.from_items([{"prompt": p} for p in make_prompts(n, seed)])


def prompts_of(rows: list[dict]) -> list:
    return [r["prompt"] for r in rows]


def run(steps: int = 100, *, lr: float = 0.005, batch_size: int = 16, group_size: int = 8,
        entropy_coef: float = 0.05, seed: int = 0, num_prompts: int = 4096, ray_data: bool = False,
        log=print) -> dict:
    """Train for ``steps`` steps; returns {'rewards': [...], 'sync': [SyncStats...], 'seconds': s}.

    Needs ``twinkle.initialize`` (with :func:`groups`) first.
    """
    sampler_mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    trainer_mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    if ray_data:
        source, collate = ray_data_prompts(num_prompts, seed), prompts_of
    else:
        source, collate = functools.partial(make_prompts, num_prompts, seed), None
    loader = DataLoader(source, batch_size=batch_size, device_mesh=sampler_mesh, shuffle=True, seed=seed,
                        collate_fn=collate, remote_group="data")
    sampler = Sampler(sampler_mesh, group_size, seed, remote_group="sampler")
    reward = Reward(group_size, remote_group="reward")
    trainer = Trainer(trainer_mesh, lr, entropy_coef, remote_group="trainer")
    first = sync_weights(trainer, sampler)  # sets up the trainer -> sampler group once
    log(f"weight sync set up: {first}")

    rewards, syncs = [], []
    start = time.perf_counter()
    batches = endless(loader)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        prompts = next(batches)                       # LazyResult in the loader's worker
        rollouts = sampler.generate(prompts)          # each sampler pulls its half
        scores = reward.score(rollouts)               # rollouts go sampler -> reward directly
        metrics = trainer.train_step(rollouts, scores)()   # the only value the driver reads
        stats = sync_weights(trainer, sampler)
        rewards.append(metrics["reward"])
        syncs.append(stats)
        log(f"step {step:3d}/{steps}  reward {metrics['reward']:.3f}  loss {metrics['loss']:+.4f}  "
            f"entropy {metrics['entropy']:.2f}  sync {stats.bytes / 1e6:.2f} MB {stats.seconds * 1e3:.1f} ms  "
            f"step {time.perf_counter() - t0:.2f}s")
    return {"rewards": rewards, "sync": syncs, "seconds": time.perf_counter() - start}


def reward_curve(rewards: list[float], window: int = 10, width: int = 40) -> str:
    """The curve as text: mean reward per window of steps, with a bar."""
    lines = ["reward curve (mean reward per window of steps; random policy = 0.10)"]
    for i in range(0, len(rewards), window):
        chunk = rewards[i:i + window]
        m = sum(chunk) / len(chunk)
        lines.append(f"  steps {i + 1:3d}-{i + len(chunk):3d}  {m:.3f}  {'#' * round(m * width)}")
    return "\n".join(lines)


def save_plot(rewards: list[float], path: str) -> str | None:
    """Save a PNG of the reward curve if matplotlib is installed; returns the path or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(rewards) + 1)
    ax.plot(steps, rewards, alpha=0.35, label="per step")
    k = min(10, len(rewards))
    smooth = np.convolve(rewards, np.ones(k) / k, mode="valid")
    ax.plot(steps[k - 1:], smooth, label=f"mean of {k}")
    ax.axhline(0.1, color="grey", linestyle=":", label="random policy")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.set_title("GRPO on CPU with twinkle_ray")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 100; 20 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a short run with a larger learning rate")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default 0.005; 0.01 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-data", action="store_true", help="feed prompts from a Ray Data dataset")
    parser.add_argument("--plot", default=os.path.join(tempfile.gettempdir(), "rlhf_grpo_reward.png"),
                        help="where to save the PNG (when matplotlib is installed)")
    args = parser.parse_args(argv)
    steps = args.steps or (20 if args.quick else 100)
    lr = args.lr or (0.01 if args.quick else 0.005)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Embedded Ray when run as a script; attaches instead under `ray job submit` (RAY_ADDRESS).
    # 8 CPUs: 6 one-CPU workers in placement groups, the rest for Ray Data tasks.
    twinkle.initialize("ray", groups=groups(), seed=args.seed, num_cpus=8)
    try:
        print(twinkle.get_device_placement())
        out = run(steps, lr=lr, seed=args.seed, ray_data=args.ray_data)
    finally:
        twinkle.shutdown()
    rewards = out["rewards"]
    syncs = out["sync"]
    print()
    print(reward_curve(rewards, window=5 if steps <= 40 else 10))
    k = max(1, min(5, len(rewards) // 4))
    print(f"mean reward: first {k} steps {np.mean(rewards[:k]):.3f} -> last {k} steps "
          f"{np.mean(rewards[-k:]):.3f}  ({steps} steps in {out['seconds']:.1f}s)")
    mb = syncs[-1].bytes / 1e6
    rate = np.mean([s.gb_per_s for s in syncs])
    print(f"weight sync: {mb:.2f} MB per step, mean {np.mean([s.seconds for s in syncs]) * 1e3:.1f} ms, "
          f"{rate:.2f} GB/s ({syncs[-1].backend})")
    png = save_plot(rewards, args.plot)
    print(f"reward curve PNG: {png}" if png else "reward curve PNG: skipped (matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
