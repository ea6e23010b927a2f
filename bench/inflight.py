"""B11: requests in flight on engines that batch continuously, results as they complete.

The workload: one gang of ``ENGINES`` sleep engines, each of capacity ``K``
(``remote_function(dispatch='balance', chunk_size=1, in_flight=K)`` on an ``async def``
method: each request awaits its length, so an engine runs up to K at once). ``ITEMS``
requests with lognormal(sigma=``SIGMA``) lengths (fixed seed, in the order drawn), scaled so
the zero-overhead pull makespan is ``PULL_S``. Measured in the same run:

- **stream**: the call, read with ``as_completed()`` to its last item (the makespan) and its
  first (time to first result);
- **zero-overhead pull**: simulated on the same lengths (each request, in input order, to the
  first free of the ENGINES x K slots, at no cost; :func:`~twinkle_ray.core.balance.pull_schedule`);
- **batch-synchronous loop**: measured, steps of ENGINES x K requests in input order (one
  ``slice_dp`` call per step, each engine awaiting its K together), each step waiting for its
  longest; its simulation beside it;
- **no-op requests/s**: ``NOOP_ITEMS`` zero-length requests through the same gang, read with
  ``as_completed()``; where a request's time goes: the ask (one ``next_chunk`` round trip to
  the dispatcher, measured from the driver, sequential and K at once).
- **a weight sync mid-stream**: the same requests on engines that also take weights
  (``WeightSyncMixin``, a 64x64 model) from a one-rank trainer; once the first result is in,
  ``sync_weights(trainer, engines)`` (its channel set up before): its wall time, whether it
  returned while the stream still ran, and how many requests started on the new weights.

Example::

    python -m bench --only B11
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import ray

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.core.balance import batch_sync_schedule, pull_schedule
from twinkle_ray.weights import WeightSyncMixin, sync_weights

ENGINES = 2
K = 8
ITEMS = 256
SIGMA = 1.2
SEED = 11
PULL_S = 3.0  # the lengths are scaled so the zero-overhead pull takes this long
NOOP_ITEMS = 2000
ASKS = 400
TARGET_VS_PULL = 1.1
TARGET_FIRST = 0.05  # the first result within 5% of the makespan
TARGET_VS_BATCH = 2.0  # >= 2x faster than the batch-synchronous loop
TARGET_RPS = 1000.0


@remote_class(distributed=False)
class SleepEngine:
    """An engine of capacity K that batches continuously: each request awaits its length."""

    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=K)
    async def generate(self, lengths: list) -> list:
        for t in lengths:
            if t > 0:
                await asyncio.sleep(t)
        return lengths

    @remote_function(dispatch="slice_dp", collect="flatten")
    def step(self, lengths: list) -> list:
        """One batch-synchronous step: this engine's requests together, until the longest."""
        async def together():
            await asyncio.gather(*(asyncio.sleep(t) for t in lengths))

        asyncio.run(together())
        return lengths


@remote_class(distributed=False)
class SyncedEngine(WeightSyncMixin, SleepEngine):
    """A sleep engine that takes weights (paused at its requests' awaits while they load)."""

    def __init__(self, device_mesh=None):
        import torch

        self.model = torch.nn.Linear(64, 64)


@remote_class(distributed=False)
class WeightSource(WeightSyncMixin):
    def __init__(self, device_mesh=None):
        import torch

        self.model = torch.nn.Linear(64, 64)


def _sync_mid_stream(trainer, engines, work: list[float]) -> tuple[float, float, bool, int]:
    """(the sync's wall time, the stream's makespan, whether the sync returned while the stream
    still ran, requests started on the new weights)."""
    sync_weights(trainer, engines)  # the channel, set up before the stream
    t0 = time.perf_counter()
    lazy = engines.generate(work)
    stream = lazy.as_completed(timeout=600)
    got = [next(stream)]
    s0 = time.perf_counter()
    sync_weights(trainer, engines)
    sync_s = time.perf_counter() - s0
    running = not lazy.done()
    got += list(stream)
    span = time.perf_counter() - t0
    assert len(got) == len(work)
    new = max(c.versions[1] for c in got)
    return sync_s, span, running, sum(1 for c in got if c.versions[0] == new)


def lengths(n: int = ITEMS, pull_s: float = PULL_S) -> list[float]:
    """The requests' lengths in seconds (in the order drawn), scaled to ``pull_s``."""
    raw = np.random.default_rng(SEED).lognormal(0.0, SIGMA, n)
    span, _ = pull_schedule([float(x) for x in raw], ENGINES * K)
    return [float(x) * pull_s / span for x in raw]


def _stream(gang, work: list[float]) -> tuple[float, float, int]:
    """(makespan, time to first result, items) of one streamed call."""
    t0 = time.perf_counter()
    first, n = None, 0
    for _ in gang.generate(work).as_completed(timeout=600):
        n += 1
        if first is None:
            first = time.perf_counter() - t0
    return time.perf_counter() - t0, first, n


def _batch_sync(gang, work: list[float]) -> float:
    slots = ENGINES * K
    t0 = time.perf_counter()
    for i in range(0, len(work), slots):
        gang.step(work[i:i + slots])()
    return time.perf_counter() - t0


def _asks(dispatcher, gen: int, concurrent: int) -> float:
    """Seconds per ``next_chunk`` ask answered, ``concurrent`` in flight (a call number no
    call has: each is told None at once, as a group's last ask is)."""
    t0 = time.perf_counter()
    for i in range(0, ASKS, concurrent):
        ray.get([dispatcher.next_chunk.remote(gen, -1 - i - j, 0, 0, 0, 1) for j in range(concurrent)])
    return (time.perf_counter() - t0) / ASKS


def bench_inflight(cfg, items: int = ITEMS, pull_s: float = PULL_S, noop_items: int = NOOP_ITEMS,
                   own_runtime: bool = True) -> list[dict]:
    """B11 rows: the stream against the zero-overhead pull and the batch-synchronous loop, then
    no-op requests per second through one gang (``own_runtime`` False: in the runtime already
    initialised, as a test does, at smaller sizes)."""
    repeats = max(1, min(3, cfg.chain_repeats))
    groups = [DeviceGroup("b11", ENGINES, "cpu"),
              DeviceGroup("b11-synced", ENGINES, "cpu", cpus_per_worker=0.25),
              DeviceGroup("b11-trainer", 1, "cpu", cpus_per_worker=0.25)]
    if own_runtime:
        twinkle.initialize("ray", groups=groups, namespace="twinkle-bench")
    else:
        twinkle.initialize(groups=groups)
    gang = SleepEngine(device_mesh=DeviceMesh.from_sizes(dp_size=ENGINES), remote_group="b11")
    work = lengths(items, pull_s)
    zero = [0.0] * noop_items
    try:
        assert gang.generate(work[:4])() == work[:4] and gang.step(work[:4])() == work[:4]  # warm
        spans, firsts, batches, noops = [], [], [], []
        for _ in range(repeats):
            span, first, n = _stream(gang, work)
            assert n == len(work)
            spans.append(span)
            firsts.append(first)
            batches.append(_batch_sync(gang, work))
            noops.append(_stream(gang, zero)[0])
        topo = gang.topology()
        dispatcher = ray.get_actor(topo["label"], namespace=ray.get_runtime_context().namespace)
        ask_seq = _asks(dispatcher, topo["generation"], 1)
        ask_k = _asks(dispatcher, topo["generation"], K)
        synced = SyncedEngine(device_mesh=DeviceMesh.from_sizes(dp_size=ENGINES),
                              remote_group="b11-synced")
        trainer = WeightSource(remote_group="b11-trainer")
        sync_s, sync_span, sync_in_flight, started_new = _sync_mid_stream(trainer, synced, work)
    finally:
        twinkle.shutdown()
    pull, pull_first = pull_schedule(work, ENGINES * K)
    sync_sim = batch_sync_schedule(work, ENGINES * K)
    span, first, batch, noop = (statistics.median(v) for v in (spans, firsts, batches, noops))
    name = f"B11 in flight, {items} lognormal({SIGMA}) requests, {ENGINES} engines x {K}"
    rows = [
        {"name": f"{name}: stream vs zero-overhead pull", "b11": True, "unit": "s",
         "twinkle_s": span, "raw_s": pull, "ratio": span / pull,
         "target": f"<= {TARGET_VS_PULL}x the zero-overhead pull",
         "checks": (("ratio", "<=", TARGET_VS_PULL),)},
        {"name": f"{name}: time to first result", "b11": True, "unit": "s",
         "twinkle_s": first, "raw_s": span, "ratio": first / span, "pull_first_s": pull_first,
         "target": f"<= {TARGET_FIRST:.0%} of the makespan", "checks": (("ratio", "<=", TARGET_FIRST),)},
        {"name": f"{name}: stream vs batch-synchronous loop", "b11": True, "unit": "s",
         "twinkle_s": span, "raw_s": batch, "ratio": span / batch, "speedup": batch / span,
         "batch_sim_s": sync_sim, "target": f">= {TARGET_VS_BATCH}x faster",
         "checks": (("speedup", ">=", TARGET_VS_BATCH),)},
        {"name": f"B11 no-op requests through one gang ({noop_items}, {ENGINES} engines x {K})",
         "b11": True, "unit": "ms", "twinkle_s": noop / noop_items, "raw_s": ask_seq,
         "ratio": (noop / noop_items) / ask_seq, "requests_per_s": noop_items / noop,
         "per_request_group_ms": noop * ENGINES / noop_items * 1000,
         "ask_ms": ask_seq * 1000, "ask_k_ms": ask_k * 1000,
         "target": f">= {TARGET_RPS:,.0f} requests/s", "checks": (("requests_per_s", ">=", TARGET_RPS),)},
        {"name": f"B11 weight sync mid-stream ({items} requests, {ENGINES} engines x {K})", "b11": True,
         "unit": "s", "twinkle_s": sync_s, "raw_s": sync_span, "ratio": sync_s / sync_span,
         "in_flight": int(sync_in_flight), "started_on_new": started_new,
         "target": "returns while the stream runs", "checks": (("in_flight", ">=", 1),)},
    ]
    return rows


def table_lines(rows: list[dict], check) -> list[str]:
    """B11's section of the bench table (``check(row)``: the ok/MISS mark)."""
    if not rows:
        return []
    lines = ["", "B11 requests in flight (sleep engines of capacity K, lognormal lengths)"]
    for row in rows:
        if "requests_per_s" in row:
            lines.append(f"{row['name']:<72} {row['requests_per_s']:9.0f} req/s  {check(row)}")
            lines.append(f"   per request on a group's path {row['per_request_group_ms']:.2f} ms; one ask "
                         f"(next_chunk round trip) {row['ask_ms']:.2f} ms alone, {row['ask_k_ms']:.2f} ms "
                         f"each with {K} in flight")
            continue
        if "in_flight" in row:
            lines.append(f"{row['name']:<72} {row['twinkle_s']:8.3f} s sync in a {row['raw_s']:.3f} s "
                         f"stream  {check(row)}")
            lines.append(f"   returned while requests were in flight: {bool(row['in_flight'])}; "
                         f"{row['started_on_new']} request(s) started on the new weights")
            continue
        lines.append(f"{row['name']:<72} {row['twinkle_s']:8.3f} s vs {row['raw_s']:8.3f} s "
                     f"{row['ratio']:6.3f}x  {check(row)}")
        if "batch_sim_s" in row:
            lines.append(f"   batch-synchronous loop simulated at zero cost: {row['batch_sim_s']:.3f} s; "
                         f"stream {row['speedup']:.2f}x faster than the measured loop")
    return lines
