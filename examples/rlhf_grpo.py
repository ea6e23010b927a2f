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
    python examples/rlhf_grpo.py --async 1       # generation of step k+1 overlaps training of step k
    python examples/rlhf_grpo.py --quick --long-tail --balance 1   # long-tailed generation, balanced
    python examples/rlhf_grpo.py --quick --stream   # fully async: partial rollouts, weights synced in flight
    python examples/rlhf_grpo.py --chaos         # SIGKILL a trainer/sampler worker every 5 steps
    python examples/rlhf_grpo.py --checkpoint-dir /tmp/grpo   # a checkpoint every 5 steps
    python examples/rlhf_grpo.py --checkpoint-dir /tmp/grpo --resume   # after the driver died
    ray job submit --working-dir . -- python examples/rlhf_grpo.py   # on a cluster

It prints one line per step and the reward curve at the end (text, and a
PNG when matplotlib is installed). The last line is ``RESULT {json}``:
``steps``, ``resumed_from`` (the checkpoint's step, or null), ``rewards`` (the
mean reward of every step of the run, those before a resume included),
``policy_versions`` (per step, the policy version the samples were drawn
with; the trainer is at version ``step - 1`` when it trains on them),
``step_s`` (seconds per step) and ``gen_s`` (per step, the seconds of its
generate call in the sampler gang: from the first sampler starting it to the
last one finishing it).

``--async N`` runs N-step off-policy (N >= 1): generation of step k+N is
submitted before training step k, and the weight sync of step k follows both
without blocking the driver (``sync_weights(..., wait=False)`` takes its place
in both gangs' call order). The samplers generate while the trainer trains;
each step trains on samples N versions old (fewer while the pipeline fills),
and the GRPO ratio uses the sampler's own (behaviour) log-probs.

``--stream`` (``--max-staleness S``, default 1; ``--in-flight K``; ``--token-s T``) is fully
asynchronous GRPO with partial rollouts, as vLLM's ``AsyncLLM`` runs it in
``examples/vllm_megatron/grpo.py --stream``: each sampler runs K requests (one prompt's group
each) at once as an ``async def`` balanced method, sampling a token at a time and awaiting T
seconds after each (an engine step); each step's prompts go out up to S steps ahead of
training, the driver reads the groups with ``as_completed()`` and trains as soon as a step's
are in, and the weight sync after each step does not wait. A sync that lands while requests
run is applied between two of their tokens (the runtime suspends them at their awaits), so a
request may span a sync: a partial rollout, each token's log-prob the one it was sampled with.
Every sample's ``versions`` (first, last) come from ``Completed``; staleness (the trainer's
version minus the first) is bounded by S by admission. Per step it logs the staleness, the
samples that spanned a sync, the log-prob gap on samples generated under one version (against
the trainer's weights of that version, which it keeps for S + 1 versions) and samples/s; the
RESULT adds ``inflight_syncs``, ``spanned``, ``max_staleness_seen``, ``max_staleness``,
``max_logprob_gap``, ``samples_per_s``.

``--long-tail [S]`` makes generation long-tailed: each prompt also takes S
seconds (0.01) times a simulated length (Pareto, alpha 1.2, fixed per prompt:
most prompts short, a few 10-50x the median), as real generation lengths are.
With ``slice_dp`` a step waits for the sampler that drew the long prompts;
``--balance [CHUNK]`` hands chunks of CHUNK prompts (default: the library's
choice) to whichever sampler is free (``dispatch='balance'``), and ``gen_s``
shows the difference. Both work with and without ``--async N`` (the balanced
generation of step k+N is then in flight while step k trains).

``--checkpoint-dir DIR`` saves a checkpoint every ``--checkpoint-every`` steps
and after the last: ``DIR/step-000010/`` holds every trainer rank's model
(with its policy version) and optimizer, every sampler rank's sampling RNG,
the loader's position, the reward history and the driver's RNGs; it is
written under a temporary name and renamed when complete (see
examples/checkpointing.py and twinkle_ray.checkpoint). ``--resume`` continues
after the newest complete checkpoint (a torn one is skipped): with the same
seed, the steps after it give the same rewards as an uninterrupted run.

``--chaos`` runs the same loop with ``max_restarts`` on the trainer and
sampler gangs and SIGKILLs a random worker of one of them at a random moment
of every ``--kill-every``-th step (seeded by ``--seed``). The dispatcher
rebuilds the gang by itself and restores the trainer's last ``save_state()``
(model, optimizer, version); the driver re-syncs the weights and redoes the
step with the same batch, so every step finishes. The policy's weights carry
a version (a buffer, so it travels with ``save_state`` and the weight sync):
the trainer refuses rollouts sampled with other weights than its own, which
makes "was this step applied?" an exact question after any kill. The last
line is ``chaos: N steps, K kills, K recoveries, max recovery X.Xs, reward A
-> B``; the exit status is 0 only if every step finished, every kill was
recovered from and the reward rose.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import checkpointing  # examples/ is on sys.path
import numpy as np
import torch
from reward_report import gen_seconds, reward_curve, save_plot

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, DeviceMesh, WorkerDiedError, remote_class, remote_function
from twinkle_ray.data import DataLoader
from twinkle_ray.weights import WeightSyncMixin, sync_weights

RANDOM_POLICY_REWARD = 0.10  # mean reward of a random policy on this task
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
        # Updates these weights have had: saved and synced with them, so a sampler's rollouts say
        # which weights made them (the trainer applies only rollouts of its own version).
        self.register_buffer("version", torch.zeros((), dtype=torch.long))

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

    def __init__(self, device_mesh: DeviceMesh, group_size: int, seed: int, long_tail_s: float = 0.0):
        self.model = Policy().eval()
        self.model.version.fill_(-1)  # no weights synced yet
        self.group_size = group_size
        self.gen = torch.Generator().manual_seed(seed * 1000 + twinkle.get_rank())
        self.long_tail_s = long_tail_s  # --long-tail: seconds per unit of simulated length
        self.spans: dict = {}  # tag -> [start, end] (time.time()) of the generate calls made with it

    @remote_function(dispatch="slice_dp", collect="flatten")
    def generate(self, prompts: list, tag: int | None = None) -> dict:
        """group_size answers per prompt, as rows; ``tag`` names the call in :meth:`generate_spans`."""
        return self.rollout(prompts, tag)

    def rollout(self, prompts: list, tag: int | None) -> dict:
        start = time.time()
        p = torch.tensor(prompts, dtype=torch.long).repeat_interleave(self.group_size, dim=0)
        answers, logp = self.model.generate(p, self.gen)
        version = np.full(len(p), int(self.model.version))
        if self.long_tail_s:  # --long-tail: each prompt takes as long as its simulated length
            time.sleep(sum(simulated_length(q) for q in prompts) * self.long_tail_s)
        if tag is not None:
            span = self.spans.setdefault(tag, [start, start])
            span[1] = time.time()
        return {"prompt": p.numpy(), "answer": answers.numpy(), "logp": logp.numpy(), "version": version}

    async def rollout_async(self, prompt: list[int], tag: int | None, token_s: float) -> dict:
        """One prompt's group_size answers, a token at a time, awaiting ``token_s`` (plus its
        simulated length's share with ``--long-tail``) after each token, as an engine step
        would: a weight sync that lands meanwhile (in flight, while the request awaits) changes
        the weights the next tokens are sampled with, a partial rollout. Each token's log-prob
        is the one it was sampled with; ``version`` / ``version_last``: the policy's version
        when the request started / ended."""
        start = time.time()
        p = torch.tensor([prompt], dtype=torch.long).repeat(self.group_size, 1)
        answers = torch.zeros_like(p)
        logp = torch.zeros(p.shape, dtype=torch.float32)
        first = int(self.model.version)
        pause = token_s + self.long_tail_s * simulated_length(prompt) / LENGTH
        for t in range(LENGTH):
            with torch.no_grad():
                lp = self.model(p, answers)[:, t]
            tok = torch.multinomial(lp.exp(), 1, generator=self.gen)[:, 0]
            answers[:, t] = tok
            logp[:, t] = lp.gather(1, tok[:, None])[:, 0]
            await asyncio.sleep(pause)
        if tag is not None:
            span = self.spans.setdefault(tag, [start, start])
            span[1] = time.time()
        n = self.group_size
        return {"prompt": p.numpy(), "answer": answers.numpy(), "logp": logp.numpy(),
                "version": np.full(n, first), "version_last": np.full(n, int(self.model.version))}

    @remote_function(dispatch="all", collect="none")
    def generate_spans(self) -> dict:
        """Every rank: {tag: [start, end]} of its tagged generate calls since the last ask."""
        spans, self.spans = self.spans, {}
        return spans

    # A checkpoint keeps the sampling stream (the weights come back with the next sync).
    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])

    @remote_function(dispatch="all", collect="first")
    def load_rank_state(self, path: str) -> None:
        """Load this rank's file of a ``save_state(path)`` (resuming from a checkpoint)."""
        load_rank_file(self, path)


def simulated_length(prompt: list[int]) -> float:
    """A long-tailed generation length for ``prompt`` (Pareto, alpha 1.2: mean 6, a few
    prompts 10-50x the median), fixed per prompt: the workload of ``--long-tail``.

    >>> simulated_length([1, 2, 3, 4, 5, 6]) == simulated_length([1, 2, 3, 4, 5, 6]) >= 1.0
    True
    """
    seed = int("".join(str(int(d)) for d in prompt))
    return float(np.random.default_rng(seed).pareto(1.2) + 1.0)


def balanced_sampler(cls: type, chunk: int | None) -> type:
    """``cls`` plus a generation that hands prompts to whichever sampler is free (``--balance``):
    ``generate_grouped`` runs with ``dispatch='balance'`` and ``chunk_size=chunk`` prompts (None:
    the library's choice). A balanced method returns one result per input item, so it returns
    each prompt's group_size answers as one item (arrays [prompts, group_size, ...]); ``rows``
    (``slice_dp``, in the sampler gang) makes them the rows the reward and the trainer take::

        sampler = balanced_sampler(Sampler, 1)(mesh, 8, 0, remote_group="sampler")
        rollouts = sampler.rows(sampler.generate_grouped(prompts))
    """

    @remote_class()
    class BalancedSampler(cls):
        @remote_function(dispatch="balance", collect="flatten", chunk_size=chunk)
        def generate_grouped(self, prompts: list, tag: int | None = None) -> dict:
            out = self.rollout(prompts, tag)
            return {k: v.reshape(len(prompts), self.group_size, *v.shape[1:]) for k, v in out.items()}

        @remote_function(dispatch="slice_dp", collect="flatten")
        def rows(self, grouped: dict) -> dict:
            return {k: v.reshape(-1, *v.shape[2:]) for k, v in grouped.items()}

    BalancedSampler.__name__ = BalancedSampler.__qualname__ = f"{cls.__name__}Balanced"
    return BalancedSampler


def streaming_sampler(cls: type, in_flight: int) -> type:
    """``cls`` plus ``generate_stream`` (``--stream``): one request (a prompt's group) per chunk,
    ``async def``, ``in_flight`` at once on each sampler, each request sampled a token at a time
    (:meth:`Sampler.rollout_async`), read with ``as_completed()``::

        sampler = streaming_sampler(Sampler, 8)(mesh, 8, 0, token_s=0.005, remote_group="sampler")
        for c in sampler.generate_stream(prompts).as_completed():
            c.value, c.versions      # the prompt's group (arrays [group_size, ...]), (first, last)
    """

    @remote_class()
    class StreamingSampler(cls):
        def __init__(self, *args, token_s: float = 0.005, **kwargs):
            super().__init__(*args, **kwargs)
            self.token_s = token_s  # an engine step's seconds: each request awaits it after each token

        @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=in_flight)
        async def generate_stream(self, prompts: list, tag: int | None = None) -> list[dict]:
            return [await self.rollout_async(list(p), tag, self.token_s) for p in prompts]

    StreamingSampler.__name__ = StreamingSampler.__qualname__ = f"{cls.__name__}Streaming"
    return StreamingSampler


def generate(sampler, prompts, balance: bool, tag: int | None = None):
    """Rollouts of a batch (a LazyResult): per data rank (``slice_dp``), or balanced (``--balance``):
    each prompt's answers then come back as one item and are made rows again in the sampler gang
    (lazily: nothing passes through the driver)."""
    if not balance:
        return sampler.generate(prompts, tag)
    return sampler.rows(sampler.generate_grouped(prompts, tag))


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

    def __init__(self, device_mesh: DeviceMesh, lr: float, entropy_coef: float, clip: float = 0.2,
                 max_staleness: int = 0):
        import torch.distributed as dist

        self.model = Policy()  # every worker is seeded alike; DDP also broadcasts rank 0's weights
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model) if dist.is_initialized() else self.model
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.entropy_coef = entropy_coef
        self.clip = clip
        self.max_staleness = max_staleness  # --async N: samples up to N versions old are applied
        self.last_metrics: dict = {}
        self.kept: dict[int, dict] = {}  # version -> weights (the last max_staleness + 1): gap checks

    @remote_function(dispatch="slice_dp", collect="mean")
    def train_step(self, rollouts: dict, scores: dict) -> dict:
        import torch.distributed as dist

        version = int(self.model.version)
        # Rollouts from other weights (a sampler rebuilt after a crash, or a trainer restored to an
        # older state) are not applied; every rank decides alike, or DDP would wait for the others.
        # With --async N, samples up to N versions old are the plan.
        age = version - np.asarray(rollouts["version"])
        fresh = torch.tensor([int(bool(((age >= 0) & (age <= self.max_staleness)).all()))])
        sample_version = float(np.min(rollouts["version"]))
        if dist.is_initialized():
            dist.all_reduce(fresh, op=dist.ReduceOp.MIN)
        if not fresh.item():
            return {"loss": 0.0, "entropy": 0.0, "reward": float(np.mean(scores["reward"])),
                    "applied": 0.0, "version": float(version), "sample_version": sample_version}
        prompts = torch.tensor(rollouts["prompt"])
        answers = torch.tensor(rollouts["answer"])
        old_logp = torch.tensor(rollouts["logp"])
        adv = torch.tensor(scores["advantage"])[:, None]
        gap = self._gap(rollouts, prompts, answers, old_logp, version)
        lp_all = self.ddp(prompts, answers)
        logp = lp_all.gather(-1, answers[..., None])[..., 0]
        ratio = torch.exp(logp - old_logp)
        surrogate = torch.min(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
        entropy = -(lp_all.exp() * lp_all).sum(-1).mean()
        loss = -surrogate.mean() - self.entropy_coef * entropy
        self.opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients over the gang here
        self.opt.step()
        self.model.version += 1
        self.last_metrics = {"loss": loss.item(), "entropy": entropy.item(),
                             "reward": float(np.mean(scores["reward"])), "applied": 1.0,
                             "version": float(version + 1), "sample_version": sample_version, "gap": gap}
        return self.last_metrics

    def _gap(self, rollouts: dict, prompts, answers, old_logp, version: int) -> float:
        """Largest |sampler - trainer| log-prob over the rows sampled under one weight version
        (``version_last`` == ``version``), the trainer's computed under that version's weights (the
        last ``max_staleness + 1`` are kept); -1 when there is none. The max over the gang."""
        import torch.distributed as dist

        self.kept[version] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        for v in sorted(self.kept)[:-(self.max_staleness + 1)]:
            del self.kept[v]
        gap = torch.tensor([-1.0])
        if "version_last" in rollouts:
            first, last = np.asarray(rollouts["version"]), np.asarray(rollouts["version_last"])
            for v in sorted(set(first[first == last].tolist()) & set(self.kept)):
                rows = torch.from_numpy(np.flatnonzero((first == v) & (last == v)))
                policy = Policy()
                policy.load_state_dict(self.kept[v])
                with torch.no_grad():
                    lp = policy(prompts[rows], answers[rows]).gather(-1, answers[rows][..., None])[..., 0]
                gap = torch.maximum(gap, (lp - old_logp[rows]).abs().max()[None])
        if dist.is_initialized():
            dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        return float(gap.item())

    @remote_function(dispatch="all", execute="first", collect="first")
    def status(self) -> dict:
        """Rank 0's weights version and the metrics of the update that made it."""
        return {"version": int(self.model.version), "metrics": dict(self.last_metrics)}

    # save_state() keeps these per rank; after a rebuild each new rank gets its own back.
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "metrics": self.last_metrics}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.last_metrics = dict(state["metrics"])

    @remote_function(dispatch="all", collect="first")
    def load_rank_state(self, path: str) -> None:
        """Load this rank's file of a ``save_state(path)`` (resuming from a checkpoint)."""
        load_rank_file(self, path)


def load_rank_file(instance, path: str) -> None:
    """``instance.load_state_dict`` of this rank's ``rank<r>.pt`` under ``path`` (what save_state(path) wrote)."""
    instance.load_state_dict(torch.load(os.path.join(path, f"rank{twinkle.get_rank()}.pt"), weights_only=False))


# --chaos: the same classes, rebuilt by their dispatchers after a worker dies.
CHAOS_MAX_RESTARTS = 1000


@remote_class(max_restarts=CHAOS_MAX_RESTARTS)
class ChaosSampler(Sampler):
    """Sampler whose gang is rebuilt automatically (its weights come back with the next sync)."""


@remote_class(max_restarts=CHAOS_MAX_RESTARTS)
class ChaosTrainer(Trainer):
    """Trainer whose gang is rebuilt automatically with the state of its last save_state()."""


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


def build(*, lr: float, batch_size: int, group_size: int, entropy_coef: float, seed: int,
          num_prompts: int, ray_data: bool, chaos: bool = False, max_staleness: int = 0,
          balance: bool = False, chunk: int | None = None, long_tail_s: float = 0.0, in_flight: int = 0,
          token_s: float = 0.005):
    """The four gangs: (loader, sampler, reward, trainer); with ``chaos`` the self-rebuilding ones,
    with ``balance`` a sampler that also generates balanced (:func:`balanced_sampler`), with
    ``in_flight`` k > 0 one that streams k requests at once (:func:`streaming_sampler`)."""
    sampler_mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    trainer_mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    if ray_data:
        source, collate = ray_data_prompts(num_prompts, seed), prompts_of
    else:
        source, collate = functools.partial(make_prompts, num_prompts, seed), None
    sampler_cls, trainer_cls = (ChaosSampler, ChaosTrainer) if chaos else (Sampler, Trainer)
    if balance:  # --balance [CHUNK]
        sampler_cls = balanced_sampler(sampler_cls, chunk)
    extra = {}
    if in_flight:  # --stream
        sampler_cls, extra = streaming_sampler(sampler_cls, in_flight), {"token_s": token_s}
    with twinkle.start_together():  # the four gangs start up at the same time
        loader = DataLoader(source, batch_size=batch_size, device_mesh=sampler_mesh, shuffle=True, seed=seed,
                            collate_fn=collate, remote_group="data")
        sampler = sampler_cls(sampler_mesh, group_size, seed, long_tail_s, remote_group="sampler", **extra)
        reward = Reward(group_size, remote_group="reward")
        trainer = trainer_cls(trainer_mesh, lr, entropy_coef, max_staleness=max_staleness, remote_group="trainer")
    return loader, sampler, reward, trainer


def run(steps: int = 100, *, lr: float = 0.005, batch_size: int = 16, group_size: int = 8,
        entropy_coef: float = 0.05, seed: int = 0, num_prompts: int = 4096, ray_data: bool = False,
        checkpoint_dir: str | None = None, checkpoint_every: int = 5, resume: bool = False,
        async_steps: int = 0, balance: bool = False, chunk: int | None = None, long_tail_s: float = 0.0,
        log=print) -> dict:
    """Train for ``steps`` steps; returns {'rewards': [...], 'sync': [SyncStats...], 'seconds': s,
    'resumed_from': step or None, 'checkpoints': [steps saved], 'policy_versions': [...],
    'step_s': [...], 'gen_s': [...]}.

    With ``checkpoint_dir``, a checkpoint is saved every ``checkpoint_every``
    steps and after the last one (see examples/checkpointing.py); with
    ``resume``, the run continues after the newest complete checkpoint there
    (``rewards`` then holds the whole run, the steps before the resume included).
    ``async_steps`` N > 0: N-step off-policy (see the module docstring; not
    with checkpoints). ``balance``: generation with ``dispatch='balance'`` (``chunk`` prompts
    per chunk); ``long_tail_s``: each prompt's generation also sleeps its simulated length times
    this. ``gen_s``: per step, the seconds of its generate call in the sampler gang (read from
    the samplers after the last step, so the driver never waits on a generation for it).
    Needs ``twinkle.initialize`` (with :func:`groups`) first.
    """
    loader, sampler, reward, trainer = build(
        lr=lr, batch_size=batch_size, group_size=group_size, entropy_coef=entropy_coef, seed=seed,
        num_prompts=num_prompts, ray_data=ray_data, max_staleness=async_steps, balance=balance,
        chunk=chunk, long_tail_s=long_tail_s)
    ckpt, latest = checkpointing.open_checkpoints(checkpoint_dir, resume)
    saved_gangs = {"trainer": trainer, "sampler": sampler}
    rewards, syncs, saves, first_step = [], [], [], 1
    versions, step_s = [], []
    if latest is not None:
        state = checkpointing.restore(latest, loader=loader, gangs=saved_gangs)
        rewards, first_step = list(state["history"]), latest.step + 1
        log(f"resumed from {latest.path}: step {latest.step}, policy version {trainer.status()()['version']}")
    first = sync_weights(trainer, sampler)  # sets up the trainer -> sampler group once
    log(f"weight sync set up: {first}")

    start = time.perf_counter()
    batches = endless(loader)
    ahead: list = []  # rollouts (and their scores) generated ahead of training: at most async_steps
    handles: list = []
    made = first_step  # the next step whose rollouts are to be generated
    t0 = time.perf_counter()
    for step in range(first_step, steps + 1):
        while made <= min(step + async_steps, steps):  # --async N: generation runs N steps ahead
            prompts = next(batches)                   # LazyResult in the loader's worker
            rollouts = generate(sampler, prompts, balance, tag=made)   # each sampler pulls its prompts
            ahead.append((rollouts, reward.score(rollouts)))   # rollouts go sampler -> reward directly
            made += 1
        rollouts, scores = ahead.pop(0)
        metrics = trainer.train_step(rollouts, scores)
        # After this step's training and the generation submitted above, in both gangs' order;
        # with --async the driver goes on at once.
        handles.append(sync_weights(trainer, sampler, wait=not async_steps))
        metrics = metrics()                           # the only value the driver reads
        done = handles[-1] if not async_steps else handles[-2] if len(handles) > 1 else None
        stats = twinkle.get(done)                     # --async: the previous step's sync (finished)
        rewards.append(metrics["reward"])
        versions.append(int(metrics["sample_version"]))
        now = time.perf_counter()
        step_s.append(now - t0)
        log(step_line(step, steps, metrics, stats, now - t0))
        t0 = now
        if ckpt is not None and (step % checkpoint_every == 0 or step == steps):
            t1 = time.perf_counter()
            path = checkpointing.save(ckpt, step, loader=loader, gangs=saved_gangs,
                                      version=trainer.status()()["version"], history=rewards)
            saves.append(step)
            log(f"checkpoint: step {step} saved in {path} ({time.perf_counter() - t1:.2f}s)")
            t0 = time.perf_counter()
    syncs = [twinkle.get(h) for h in handles]
    seconds = time.perf_counter() - start
    gen_s = gen_seconds(sampler.generate_spans()(), list(range(first_step, steps + 1)))
    return {"rewards": rewards, "sync": syncs, "seconds": seconds,
            "resumed_from": latest.step if latest is not None else None, "checkpoints": saves,
            "policy_versions": versions, "step_s": step_s, "gen_s": gen_s,
            "samples": (steps - first_step + 1) * batch_size * group_size}


# ------------------------------------------------------------------------------ --stream
def stream_facts(completed: list, version: int) -> dict:
    """A batch's version facts from its items' ``Completed.versions`` (syncs applied by the
    sampler gang when the request started / ended) and ``version``, the trainer's version (in the
    same count) when it trains on them: per item its staleness ``version - first``; the samples
    whose versions differ (they spanned a sync: partial rollouts); the syncs some sample was in
    flight across; samples without versions (the runtime could not say) counted apart.

    >>> from collections import namedtuple
    >>> C = namedtuple("C", "index value rank versions")
    >>> g = {"prompt": np.zeros((2, 6))}
    >>> f = stream_facts([C(0, g, 0, (2, 2)), C(1, g, 1, (1, 2)), C(2, g, 0, None)], 2)
    >>> f["staleness"], f["spanned"], f["synced"], f["unversioned"]
    ([0, 1], 2, [2], 2)
    """
    staleness, spanned, synced, unversioned = [], 0, set(), 0
    for c in completed:
        n = len(c.value["prompt"])
        if c.versions is None:
            unversioned += n
            continue
        first, last = c.versions
        staleness.append(version - first)
        if first != last:
            spanned += n
            synced.update(range(first + 1, last + 1))
    return {"staleness": staleness, "spanned": spanned, "synced": sorted(synced), "unversioned": unversioned}


def run_stream(steps: int = 20, *, lr: float = 0.01, batch_size: int = 16, group_size: int = 8,
               entropy_coef: float = 0.05, seed: int = 0, num_prompts: int = 4096, ray_data: bool = False,
               max_staleness: int = 1, in_flight: int | None = None, token_s: float = 0.005,
               long_tail_s: float = 0.0, timeout_s: float = 300.0, log=print) -> dict:
    """``--stream``: fully asynchronous GRPO with partial rollouts (see ``--stream`` in the module
    docstring). Each step's prompts are one balanced call of one request per prompt
    (``generate_stream``, ``in_flight`` per sampler; default: each sampler's share of a step),
    submitted up to ``max_staleness`` steps ahead of training; the driver reads each step's groups
    with ``as_completed()``, trains once they are all in, and syncs the weights after each step
    without waiting. Staleness (the trainer's version minus the one a sample began under) is
    bounded by admission: step b's prompts start after the sync of step b - 1 - s was issued
    (checked: a violation raises, and the trainer refuses such a batch anyway).
    """
    in_flight = in_flight or max(1, batch_size // 2)
    loader, sampler, reward, trainer = build(
        lr=lr, batch_size=batch_size, group_size=group_size, entropy_coef=entropy_coef, seed=seed,
        num_prompts=num_prompts, ray_data=ray_data, max_staleness=max_staleness, in_flight=in_flight,
        token_s=token_s, long_tail_s=long_tail_s)
    first_sync = sync_weights(trainer, sampler)  # sets up the channel: the sampler gang's version 1
    log(f"weight sync set up: {first_sync}")
    synced = 1
    batches = endless(loader)
    waves: dict = {}
    rewards, syncs, gaps, step_s, facts, versions, pending = [], [], [], [], [], [], []

    def submit(b: int) -> None:
        waves[b] = sampler.generate_stream(next(batches), tag=b)

    def finish(item: dict) -> None:
        m = item["metrics"]()
        stats = twinkle.get(item["sync"])
        if not m["applied"]:
            raise StaleRollouts(f"step {item['step']}: the trainer refused its batch (samples beyond "
                                f"max_staleness {max_staleness})")
        f = item["facts"]
        rewards.append(m["reward"])
        syncs.append(stats)
        gaps.append(m["gap"] if m["gap"] >= 0 else None)
        versions.append(int(m["sample_version"]))
        log(f"{step_line(item['step'], steps, m, stats, item['step_s'])}  staleness max "
            f"{max(f['staleness'], default=0)}  spanned {f['spanned']}/{item['samples']}  "
            f"gap {'-' if gaps[-1] is None else f'{gaps[-1]:.1e}'}  samples/s {item['samples'] / item['step_s']:.0f}")

    start = t0 = time.perf_counter()
    for b in range(1, min(steps, 1 + max_staleness) + 1):
        submit(b)
    for b in range(1, steps + 1):
        version = synced + b - 1  # syncs the trainer has sent before step b: its weights' version
        got = sorted(waves.pop(b).as_completed(timeout=timeout_s), key=lambda c: c.index)
        f = stream_facts(got, version)
        if max(f["staleness"], default=0) > max_staleness:
            raise StaleRollouts(f"step {b}: a sample began {max(f['staleness'])} versions behind the trainer "
                                f"(max_staleness {max_staleness}): the admission bound broke")
        rows = {k: np.concatenate([c.value[k] for c in got]) for k in got[0].value}
        scores = reward.score(rows)
        metrics = trainer.train_step(rows, scores)
        sync = sync_weights(trainer, sampler, wait=False)   # in flight once the sampler runs step b+1's requests
        if b + 1 + max_staleness <= steps:
            submit(b + 1 + max_staleness)
        now = time.perf_counter()
        step_s.append(now - t0)
        t0 = now
        facts.append(f)
        pending.append({"step": b, "metrics": metrics, "sync": sync, "facts": f, "samples": len(rows["prompt"]),
                        "step_s": step_s[-1]})
        while len(pending) > 1:
            finish(pending.pop(0))
    while pending:
        finish(pending.pop(0))
    seconds = time.perf_counter() - start
    gen_s = gen_seconds(sampler.generate_spans()(), list(range(1, steps + 1)))
    return {"rewards": rewards, "sync": syncs, "seconds": seconds, "policy_versions": versions, "step_s": step_s,
            "gen_s": gen_s, "gaps": gaps, "facts": facts, "samples": steps * batch_size * group_size,
            "max_staleness": max_staleness, "in_flight": in_flight}


def stream_summary(out: dict) -> dict:
    """--stream's RESULT keys, from the versions every sample came back with (nothing assumed)."""
    facts, gaps = out["facts"], [g for g in out["gaps"] if g is not None]
    return {"max_logprob_gap": max(gaps) if gaps else None, "gap_checked_steps": len(gaps),
            "inflight_syncs": len({k for f in facts for k in f["synced"]}),
            "spanned": sum(f["spanned"] for f in facts), "spanned_per_step": [f["spanned"] for f in facts],
            "max_staleness_seen": max((max(f["staleness"], default=0) for f in facts), default=0),
            "staleness_per_step": [max(f["staleness"], default=None) for f in facts],
            "max_staleness": out["max_staleness"], "unversioned": sum(f["unversioned"] for f in facts),
            "samples_per_s": out["samples"] / out["seconds"], "in_flight": out["in_flight"]}


def step_line(step: int, steps: int, metrics: dict, stats, seconds: float) -> str:
    sync = f"sync {stats.bytes / 1e6:.2f} MB {stats.seconds * 1e3:.1f} ms" if stats is not None else "sync -"
    version = (f"  samples v{int(metrics['sample_version'])} (trainer v{int(metrics['version']) - 1})"
               if "sample_version" in metrics else "")
    return (f"step {step:3d}/{steps}  reward {metrics['reward']:.3f}  loss {metrics['loss']:+.4f}  "
            f"entropy {metrics['entropy']:.2f}  {sync}{version}  step {seconds:.2f}s")


# ------------------------------------------------------------------------------ --chaos
SYNC_TIMEOUT_S = 60.0      # a weight sync whose other end died fails within this
RESTART_TIMEOUT_S = 180.0  # one gang rebuild
RECOVER_TIMEOUT_S = 300.0  # one recovery, however many tries it takes
MAX_ATTEMPTS = 20          # tries of one step before the run gives up


class StaleRollouts(RuntimeError):
    """The trainer refused a batch sampled with other weights than its own."""


@dataclass
class Kill:
    step: int           # the step whose start armed it (it may land in the next one)
    gang: str
    rank: int
    pid: int
    at: float           # time.monotonic() of the SIGKILL
    verified: bool = False          # a recovery has run since (the driver knows where things stand)
    recovered_s: float | None = None  # kill -> the first step completed after that recovery


def is_ray_worker(pid: int) -> bool:
    """Whether ``pid`` is (still) a Ray worker process: never SIGKILL a reused pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): trust the pid the dispatcher reported
        return True
    return b"ray::" in cmd or b"default_worker" in cmd


class ChaosMonkey:
    """SIGKILLs one worker of a random gang at a random moment of every ``every``-th step.

    ``arm(step, window_s)`` picks the gang, rank and delay (uniform in
    ``[0, window_s)``, about one step) from a seeded RNG and starts a timer;
    the kill lands while calls are in flight or between them. While the
    driver recovers it ``pause()``s the monkey: a due kill waits until
    ``resume()``, so what a recovery finds is not changed under it.
    """

    def __init__(self, gangs: dict, every: int, seed: int, log=print):
        self.gangs, self.every, self.log = gangs, every, log
        self.rng = random.Random(seed)
        self.kills: list[Kill] = []
        self._cond = threading.Condition()
        self._paused = False
        self._closed = False
        self._timer: threading.Thread | None = None

    def arm(self, step: int, window_s: float) -> None:
        if self.every <= 0 or step % self.every or (self._timer is not None and self._timer.is_alive()):
            return
        name = self.rng.choice(sorted(self.gangs))
        ranks = self.gangs[name].topology()["ranks"]
        rank = self.rng.randrange(len(ranks))
        delay = self.rng.uniform(0.0, window_s)
        self._timer = threading.Thread(target=self._kill, args=(step, name, rank, ranks[rank]["pid"], delay),
                                       name="chaos-monkey", daemon=True)
        self._timer.start()

    def _kill(self, step: int, name: str, rank: int, pid: int, delay: float) -> None:
        deadline = time.monotonic() + delay
        with self._cond:
            while not self._closed and (self._paused or time.monotonic() < deadline):
                self._cond.wait(timeout=max(0.005, deadline - time.monotonic()) if not self._paused else None)
            if self._closed:
                return
            if not pid or not is_ray_worker(pid):
                self.log(f"chaos: {name} rank {rank} pid {pid} is not a live Ray worker; no kill")
                return
            at = time.monotonic()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            self.kills.append(Kill(step, name, rank, pid, at))
        self.log(f"chaos: SIGKILL {name} rank {rank} (pid {pid}), armed at step {step}")

    def pause(self) -> list[Kill]:
        """Hold further kills; returns the kills no recovery has looked at yet."""
        with self._cond:
            self._paused = True
            return [k for k in self.kills if not k.verified]

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def unverified(self) -> list[Kill]:
        with self._cond:
            return [k for k in self.kills if not k.verified]

    def settle(self, now: float) -> None:
        """A step completed at ``now``: every verified kill not yet settled is recovered from."""
        with self._cond:
            for k in self.kills:
                if k.verified and k.recovered_s is None:
                    k.recovered_s = now - k.at

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._timer is not None:
            self._timer.join(timeout=5)


def short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def heal(gang) -> None:
    """Rebuild ``gang`` if it is dead once a rebuild under way has ended (restart() would end
    that rebuild and start afresh)."""
    try:
        gang.check_health(timeout=RESTART_TIMEOUT_S, wait=True)
    except Exception:  # WorkerDiedError (also a failed rebuild) or 'not running'
        gang.restart(timeout=RESTART_TIMEOUT_S)


def recover(trainer, sampler, step: int, log=print) -> tuple[dict, object]:
    """Both gangs up, the trainer's version read, the weights synced; returns (status, sync stats).

    Run with the monkey paused. If the trainer already holds step ``step``'s
    update (version == step), it is saved again (a rebuilt gang restores it).
    """
    deadline = time.monotonic() + RECOVER_TIMEOUT_S
    while True:
        try:
            heal(trainer)
            heal(sampler)
            status = trainer.status()()           # waits for a rebuild under way
            if status["version"] == step:
                trainer.save_state()
            stats = sync_weights(trainer, sampler, timeout_s=SYNC_TIMEOUT_S)
            return status, stats
        except Exception as e:  # a gang that died again, a sync that met a rebuild: look again
            if time.monotonic() > deadline:
                raise
            log(f"  recovery: {short(e)}; trying again")
            time.sleep(0.5)


def run_chaos(steps: int = 100, *, kill_every: int = 5, lr: float = 0.005, batch_size: int = 16,
              group_size: int = 8, entropy_coef: float = 0.05, seed: int = 0, num_prompts: int = 4096,
              ray_data: bool = False, log=print) -> dict:
    """:func:`run` with a worker SIGKILLed every ``kill_every`` steps; every step still finishes.

    One step: sample -> reward -> train -> ``trainer.save_state()`` -> weight
    sync. After a failure, or after a kill that raised nothing, the driver
    waits for both gangs (the dispatchers rebuild them; ``restart()`` if one
    is dead and not rebuilding), reads the trainer's version and re-syncs the
    weights: version == step means the step was applied and saved, version
    == step - 1 means it is redone with the same batch.
    """
    loader, sampler, reward, trainer = build(
        lr=lr, batch_size=batch_size, group_size=group_size, entropy_coef=entropy_coef, seed=seed,
        num_prompts=num_prompts, ray_data=ray_data, chaos=True)
    first = sync_weights(trainer, sampler, timeout_s=SYNC_TIMEOUT_S)
    trainer.save_state()  # version 0: a rebuild before the first step starts from here
    log(f"weight sync set up: {first}")
    monkey = ChaosMonkey({"trainer": trainer, "sampler": sampler}, kill_every, seed, log=log)

    rewards, syncs, clean_s, redone = [], [], [], 0
    start = time.perf_counter()
    batches = endless(loader)
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            prompts = next(batches)  # kept for every try of this step
            monkey.arm(step, float(np.median(clean_s[-10:])) if clean_s else 0.5)
            for attempt in range(1, MAX_ATTEMPTS + 1):
                ta = time.perf_counter()
                metrics = stats = None
                try:
                    rollouts = sampler.generate(prompts)
                    scores = reward.score(rollouts)
                    out = trainer.train_step(rollouts, scores)()
                    if out["applied"] < 1:
                        raise StaleRollouts(f"trainer at version {out['version']:.0f} refused the rollouts")
                    trainer.save_state()
                    stats = sync_weights(trainer, sampler, timeout_s=SYNC_TIMEOUT_S)
                    metrics = out
                except Exception as e:
                    # Deaths are expected here; anything else only right after a kill.
                    if not isinstance(e, WorkerDiedError | StaleRollouts) and not monkey.unverified():
                        raise
                    log(f"  step {step} try {attempt}: {short(e)}")
                kills = monkey.pause()
                if metrics is not None and not kills:
                    monkey.resume()
                    clean_s.append(time.perf_counter() - ta)
                    break
                try:
                    status, sync_stats = recover(trainer, sampler, step, log=log)
                finally:
                    for k in kills:
                        k.verified = True
                    monkey.resume()
                if status["version"] == step:  # applied and saved: the step is done
                    metrics = metrics or status["metrics"]
                    stats = stats or sync_stats
                    log(f"  step {step}: recovered, the update was kept (version {step})")
                    break
                if status["version"] != step - 1:
                    raise RuntimeError(f"step {step}: trainer at version {status['version']}, "
                                       f"expected {step - 1} or {step}")
                redone += 1
                log(f"  step {step}: recovered (trainer at version {step - 1}); redoing it")
            else:
                raise RuntimeError(f"step {step} did not finish in {MAX_ATTEMPTS} tries")
            monkey.settle(time.monotonic())
            rewards.append(metrics["reward"])
            syncs.append(stats)
            log(step_line(step, steps, metrics, stats, time.perf_counter() - t0))
        # A kill armed in the last step may land after it: look once more.
        kills = monkey.pause()
        if kills:
            status, _ = recover(trainer, sampler, steps, log=log)
            for k in kills:
                k.verified = True
            if status["version"] != steps:
                raise RuntimeError(f"after the last step the trainer is at version {status['version']}")
            monkey.settle(time.monotonic())
    finally:
        monkey.close()
    return {"rewards": rewards, "sync": syncs, "seconds": time.perf_counter() - start,
            "kills": monkey.kills, "redone": redone}


# ------------------------------------------------------------------------------ --chaos-nodes
CHAOS_NODES = 4          # worker nodes of 2 CPUs each: the gangs need 6 CPUs, so one can go
NODE_CPUS = 2


@dataclass
class NodeLoss:
    step: int
    node: str           # the removed node's id
    at: float           # time.monotonic() of the removal
    error_s: float | None = None      # removal -> the first error the loop saw
    recovered_s: float | None = None  # removal -> the first step completed after it


def _dispatcher_nodes(gangs) -> set:
    return {g.topology()["dispatcher_node"][0] for g in gangs}


def wait_node_dead(node_id: str, log=print) -> None:
    """Until Ray reports the node dead (its health checks: ~15 s after a hard kill), then a
    moment for the dispatchers that watch workers there to tear their gangs down."""
    import ray

    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {node_id[:8]} still alive {RESTART_TIMEOUT_S:g}s after its removal")
        time.sleep(0.5)
    time.sleep(2.0)
    log(f"  node {node_id[:8]} reported dead")


def heal_all(gangs, deadline: float, log=print) -> None:
    """Every gang up again: wait for the rebuilds under way, restart() the gangs left dead
    (the loader's and reward's have no max_restarts; restart restores a saved state)."""
    while True:
        try:
            for g in gangs:
                try:
                    g.check_health(timeout=RESTART_TIMEOUT_S, wait=True)
                except WorkerDiedError:
                    g.restart(timeout=RESTART_TIMEOUT_S)
            return
        except Exception as e:  # a gang that died again while another was rebuilt
            if time.monotonic() > deadline:
                raise
            log(f"  recovery: {short(e)}; trying again")
            time.sleep(1.0)


def run_chaos_nodes(steps: int = 30, *, every: int = 5, lr: float = 0.01, seed: int = 0,
                    nodes: int = CHAOS_NODES, log=print) -> dict:
    """GRPO on a ``ray.cluster_utils.Cluster`` whose worker nodes go away: every ``every``
    steps a random worker node (one without a dispatcher) is removed while the step runs,
    its raylet and workers killed, and then a fresh node is added.

    The head node holds no gang resources (the driver and the dispatchers live there). Gangs
    on the lost node die whole: the trainer and sampler gangs are rebuilt by their dispatchers
    (``max_restarts``) once the new node lets Ray re-place their bundles; the loader and reward
    gangs are restarted by the driver. The trainer's and loader's states are saved to files
    after every step (a node's object store goes with the node), so a rebuild restores the
    model, the optimizer and the data position: a step is redone with the same batch, and no
    data is lost. Returns what :func:`run_chaos` returns, with ``losses`` (NodeLoss rows).
    """
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    ckpt = tempfile.mkdtemp(prefix="rlhf-chaos-nodes-")
    losses: list[NodeLoss] = []
    rng = random.Random(seed)
    try:
        workers = [cluster.add_node(num_cpus=NODE_CPUS) for _ in range(nodes)]
        cluster.wait_for_nodes()
        twinkle.initialize("ray", address=cluster.address, groups=groups(), seed=seed,
                           placement_timeout_s=RESTART_TIMEOUT_S)
        log(twinkle.get_device_placement())
        loader, sampler, reward, trainer = build(lr=lr, batch_size=16, group_size=8, entropy_coef=0.05,
                                                 seed=seed, num_prompts=4096, ray_data=False, chaos=True)
        gangs = [loader, sampler, reward, trainer]

        def save() -> None:
            trainer.save_state(path=os.path.join(ckpt, "trainer"))
            loader.save_state(path=os.path.join(ckpt, "loader"))

        sync_weights(trainer, sampler, timeout_s=SYNC_TIMEOUT_S)
        save()
        safe = _dispatcher_nodes(gangs)
        rewards, syncs, redone, clean_s = [], [], 0, []
        start = time.perf_counter()
        batches = endless(loader)
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            prompts = next(batches)
            swap = None
            if every > 0 and step % every == 0:
                candidates = [n for n in workers if n.node_id not in safe]
                victim = rng.choice(candidates)
                delay = rng.uniform(0.0, float(np.median(clean_s[-10:])) if clean_s else 0.5)

                def remove(victim=victim, delay=delay, step=step) -> None:
                    time.sleep(delay)
                    losses.append(NodeLoss(step, victim.node_id, time.monotonic()))
                    cluster.remove_node(victim, allow_graceful=False)  # raylet and workers killed

                swap = threading.Thread(target=remove, name="chaos-nodes", daemon=True)
                swap.start()
            for attempt in range(1, MAX_ATTEMPTS + 1):
                metrics = stats = None
                ta = time.perf_counter()
                try:
                    rollouts = sampler.generate(prompts)
                    scores = reward.score(rollouts)
                    out = trainer.train_step(rollouts, scores)()
                    if out["applied"] < 1:
                        raise StaleRollouts(f"trainer at version {out['version']:.0f} refused the rollouts")
                    save()
                    stats = sync_weights(trainer, sampler, timeout_s=SYNC_TIMEOUT_S)
                    metrics = out
                except Exception as e:
                    if swap is None:
                        raise
                    if losses and losses[-1].step == step and losses[-1].error_s is None:
                        losses[-1].error_s = time.monotonic() - losses[-1].at
                    log(f"  step {step} try {attempt}: {short(e)}")
                if swap is not None:
                    swap.join()  # the node is gone: add a fresh one (Ray adds nodes from the main
                    swap = None  # thread only) and recover from what the loss did
                    workers.remove(victim)
                    workers.append(cluster.add_node(num_cpus=NODE_CPUS))
                    wait_node_dead(victim.node_id, log=log)  # the gangs on it know by then
                    loader_gen = loader.topology()["generation"]
                    heal_all(gangs, time.monotonic() + RECOVER_TIMEOUT_S, log=log)
                    status = trainer.status()()
                    sync_weights(trainer, sampler, timeout_s=SYNC_TIMEOUT_S)
                    if status["version"] == step and metrics is not None:
                        break  # the step finished and was saved before its gangs went
                    if status["version"] == step:
                        metrics = status["metrics"]
                        stats = sync_weights(trainer, sampler, timeout_s=SYNC_TIMEOUT_S)
                        break
                    if status["version"] != step - 1:
                        raise RuntimeError(f"step {step}: trainer at version {status['version']}, "
                                           f"expected {step - 1} or {step}")
                    redone += 1
                    log(f"  step {step}: recovered (trainer at version {step - 1}); redoing it")
                    if loader.topology()["generation"] != loader_gen:
                        prompts = next(batches)  # the loader was rebuilt and restored: same batch
                    continue
                if metrics is not None:
                    clean_s.append(time.perf_counter() - ta)
                    break
            else:
                raise RuntimeError(f"step {step} did not finish in {MAX_ATTEMPTS} tries")
            for loss in losses:
                if loss.recovered_s is None:
                    loss.recovered_s = time.monotonic() - loss.at
            safe = _dispatcher_nodes(gangs)
            rewards.append(metrics["reward"])
            syncs.append(stats)
            log(step_line(step, steps, metrics, stats, time.perf_counter() - t0))
        return {"rewards": rewards, "sync": syncs, "seconds": time.perf_counter() - start,
                "losses": losses, "redone": redone}
    finally:
        twinkle.shutdown()
        import ray

        ray.shutdown()
        cluster.shutdown()


def chaos_nodes_report(out: dict, steps: int) -> int:
    """Print the node losses and the final ``chaos:`` line; 0 if every step finished, every loss
    was recovered from and the reward rose."""
    rewards, losses = out["rewards"], out["losses"]
    recovered = [k.recovered_s for k in losses if k.recovered_s is not None]
    for k in losses:
        err = f"first error after {k.error_s:.1f}s" if k.error_s is not None else "no call failed"
        took = f"{k.recovered_s:.1f}s" if k.recovered_s is not None else "not recovered"
        print(f"  node lost: {k.node[:8]} at step {k.step}: {err}, recovered in {took}")
    n = max(1, min(10, max(3, len(rewards) // 10), len(rewards) // 2))
    a, b = float(np.mean(rewards[:n])), float(np.mean(rewards[-n:]))
    print(f"steps redone: {out['redone']}; reward A/B = mean of the first/last {n} steps")
    print(f"chaos: {len(rewards)} steps, {len(losses)} kills, {len(recovered)} recoveries, "
          f"max recovery {max(recovered, default=0.0):.1f}s, reward {a:.3f} -> {b:.3f}")
    return 0 if len(rewards) == steps and len(recovered) == len(losses) and b > a else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 100; 20 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a short run with a larger learning rate")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default 0.005; 0.01 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-data", action="store_true", help="feed prompts from a Ray Data dataset")
    parser.add_argument("--async", dest="async_steps", type=int, default=0, metavar="N",
                        help="N-step off-policy: generate N steps ahead of training, the weight sync "
                             "not blocking the driver (default 0: generate, train, sync in turn)")
    parser.add_argument("--chaos", action="store_true",
                        help="SIGKILL a random trainer or sampler worker every --kill-every steps; "
                             "the loop recovers and redoes the step")
    parser.add_argument("--kill-every", type=int, default=5, help="with --chaos: steps between kills (default 5)")
    parser.add_argument("--chaos-nodes", action="store_true",
                        help="run on a 3+-node ray.cluster_utils.Cluster of its own and remove a random "
                             "worker node every --kill-every steps (a fresh one is added); gangs are "
                             "rebuilt on the remaining capacity and the loop redoes the step")
    parser.add_argument("--plot", default=None,
                        help="where to save the PNG (when matplotlib is installed; default: a name of "
                             "its own per run in the temp directory, "
                             "$TMPDIR/rlhf_grpo_reward-YYYYmmdd-HHMMSS-PID.png)")
    parser.add_argument("--balance", nargs="?", const="auto", default=None, metavar="CHUNK",
                        help="generate with dispatch='balance': chunks of CHUNK prompts go to whichever "
                             "sampler is free (no CHUNK: the library picks the size)")
    parser.add_argument("--long-tail", nargs="?", type=float, const=0.01, default=0.0, metavar="S",
                        help="each prompt's generation also sleeps S seconds (default 0.01) per unit of "
                             "a long-tailed simulated length (Pareto 1.2, mean 6): where --balance pays")
    parser.add_argument("--stream", action="store_true",
                        help="fully asynchronous GRPO with partial rollouts: one request per prompt in flight, "
                             "read as they complete, weights synced in flight after each step")
    parser.add_argument("--max-staleness", type=int, default=1, metavar="S",
                        help="with --stream: samples trained at step b began at most S versions back (default 1)")
    parser.add_argument("--in-flight", type=int, default=None, metavar="K",
                        help="with --stream: requests at once per sampler (default: its share of a step)")
    parser.add_argument("--token-s", type=float, default=0.005, metavar="S",
                        help="with --stream: seconds a request awaits after each token, as an engine step "
                             "(default 0.005)")
    add_checkpoint_args(parser)
    args = parser.parse_args(argv)
    if args.stream and (args.async_steps or args.balance is not None or args.chaos or args.chaos_nodes
                        or args.checkpoint_dir):
        parser.error("--stream is its own loop: not with --async, --balance, --chaos, --chaos-nodes or "
                     "--checkpoint-dir (its staleness bound is --max-staleness)")
    if args.max_staleness < 0 or (args.in_flight is not None and args.in_flight < 1) or args.token_s < 0:
        parser.error("--max-staleness and --token-s must be >= 0, --in-flight >= 1")
    if args.balance not in (None, "auto") and not (args.balance.isdigit() and int(args.balance) > 0):
        parser.error(f"--balance takes a positive chunk size, got {args.balance!r}")
    if (args.balance is not None or args.long_tail) and (args.chaos or args.chaos_nodes):
        parser.error("--balance/--long-tail go with the plain loop (no --chaos or --chaos-nodes)")
    if args.long_tail < 0:
        parser.error("--long-tail must be >= 0")
    if args.chaos and (args.checkpoint_dir or args.resume):
        parser.error("--checkpoint-dir/--resume go with the plain loop, not with --chaos")
    if args.async_steps < 0:
        parser.error("--async must be >= 0")
    if args.async_steps and (args.chaos or args.chaos_nodes or args.checkpoint_dir):
        parser.error("--async goes with the plain loop (no --chaos, --chaos-nodes or --checkpoint-dir)")
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be >= 1")
    steps = args.steps or (20 if args.quick else 100)
    lr = args.lr or (0.01 if args.quick else 0.005)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if args.chaos_nodes:
        out = run_chaos_nodes(args.steps or 30, every=args.kill_every, lr=args.lr or 0.01, seed=args.seed)
        print(reward_curve(out["rewards"], baseline=RANDOM_POLICY_REWARD, window=5))
        return chaos_nodes_report(out, args.steps or 30)
    # Embedded Ray when run as a script; attaches instead under `ray job submit` (RAY_ADDRESS).
    # 8 CPUs: 6 one-CPU workers in placement groups, the rest for Ray Data tasks.
    twinkle.initialize("ray", groups=groups(), seed=args.seed, num_cpus=8)
    try:
        print(twinkle.get_device_placement())
        if args.chaos:
            out = run_chaos(steps, kill_every=args.kill_every, lr=lr, seed=args.seed, ray_data=args.ray_data)
        elif args.stream:
            out = run_stream(steps, lr=lr, seed=args.seed, ray_data=args.ray_data, max_staleness=args.max_staleness,
                             in_flight=args.in_flight, token_s=args.token_s, long_tail_s=args.long_tail)
        else:
            out = run(steps, lr=lr, seed=args.seed, ray_data=args.ray_data, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, resume=args.resume, async_steps=args.async_steps,
                      balance=args.balance is not None,
                      chunk=None if args.balance in (None, "auto") else int(args.balance),
                      long_tail_s=args.long_tail)
    finally:
        twinkle.shutdown()
    rewards = out["rewards"]
    syncs = out["sync"]
    print()
    print(reward_curve(rewards, baseline=RANDOM_POLICY_REWARD, window=5 if steps <= 40 else 10))
    k = max(1, min(5, len(rewards) // 4))
    print(f"mean reward: first {k} steps {np.mean(rewards[:k]):.3f} -> last {k} steps "
          f"{np.mean(rewards[-k:]):.3f}  ({len(syncs)} steps in {out['seconds']:.1f}s)")
    if out.get("gen_s"):
        print(f"generation: mean {np.mean(out['gen_s']):.3f}s per step, max {np.max(out['gen_s']):.3f}s "
              f"({'balanced' if args.balance is not None else 'slice_dp'})")
    if syncs:
        mb = syncs[-1].bytes / 1e6
        rate = np.mean([s.gb_per_s for s in syncs])
        print(f"weight sync: {mb:.2f} MB per step, mean {np.mean([s.seconds for s in syncs]) * 1e3:.1f} ms, "
              f"{rate:.2f} GB/s ({syncs[-1].backend})")
    plot = args.plot or os.path.join(
        tempfile.gettempdir(), f"rlhf_grpo_reward-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.png")
    png = save_plot(rewards, plot, baseline=RANDOM_POLICY_REWARD,
                    title='GRPO on CPU with twinkle_ray')
    print(f"reward curve PNG: {png}" if png else "reward curve PNG: skipped (matplotlib is not installed)")
    result = {"steps": len(rewards), "resumed_from": out.get("resumed_from"), "rewards": rewards,
              "checkpoints": out.get("checkpoints", []), "seconds": out["seconds"],
              "async": args.async_steps, "policy_versions": out.get("policy_versions", []),
              "step_s": out.get("step_s", []), "balance": args.balance, "gen_s": out.get("gen_s", []),
              "reward_first": float(np.mean(rewards[:k])), "reward_last": float(np.mean(rewards[-k:])),
              "samples_per_s": out["samples"] / out["seconds"] if out.get("samples") else None,
              "mode": "stream" if args.stream else (f"async {args.async_steps}" if args.async_steps else "plain")}
    if args.stream:
        result.update(stream_summary(out))
        print(f"stream: {result['inflight_syncs']} syncs applied with requests in flight, {result['spanned']} "
              f"samples spanned a sync, staleness seen at most {result['max_staleness_seen']} (bound "
              f"{result['max_staleness']}), log-prob gap {result['max_logprob_gap']}, "
              f"{result['samples_per_s']:.0f} samples/s")
    print("RESULT " + json.dumps(result), flush=True)  # the last line (before the chaos: line with --chaos)
    if not args.chaos:
        return 0
    return chaos_report(out, steps)


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """--checkpoint-dir, --checkpoint-every, --resume (see examples/checkpointing.py)."""
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save a checkpoint (DIR/step-NNNNNN/, atomic) every --checkpoint-every steps")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (default 5)")
    parser.add_argument("--resume", action="store_true",
                        help="continue after the newest complete checkpoint in --checkpoint-dir")


def chaos_report(out: dict, steps: int) -> int:
    """Print the kills and the final ``chaos:`` line; 0 if every step finished and the reward rose."""
    rewards, kills = out["rewards"], out["kills"]
    recovered = [k.recovered_s for k in kills if k.recovered_s is not None]
    for k in kills:
        took = f"{k.recovered_s:.1f}s" if k.recovered_s is not None else "not recovered"
        print(f"  kill: {k.gang} rank {k.rank} (pid {k.pid}), armed at step {k.step}: recovered in {took}")
    n = max(1, min(10, max(3, len(rewards) // 10), len(rewards) // 2))  # first/last 10% of steps
    a, b = float(np.mean(rewards[:n])), float(np.mean(rewards[-n:]))
    print(f"steps redone: {out['redone']}; reward A/B = mean of the first/last {n} steps")
    print(f"chaos: {len(rewards)} steps, {len(kills)} kills, {len(recovered)} recoveries, "
          f"max recovery {max(recovered, default=0.0):.1f}s, reward {a:.3f} -> {b:.3f}")
    ok = len(rewards) == steps and len(recovered) == len(kills) and b > a
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
