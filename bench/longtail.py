"""B8: a long-tailed batch through ``slice_dp`` and ``dispatch='balance'``, beside the ideal.

The workload: a 4-worker gang whose method sleeps in proportion to each item's
cost; 256 items with Pareto(alpha=1.2) costs (fixed seed, in the order drawn),
scaled so the ideal makespan ``max(sum / 4, largest item)`` is ``IDEAL_S``.
Printed, all from one run: the makespan (call + collect) of ``slice_dp``
(fixed slices by data rank), of ``balance`` with ``chunk_size=1`` and ``4``,
and the ideal (with, for each balanced row, the makespan an in-order list
schedule would reach at zero cost per chunk); then the cost per chunk: ``balance`` (chunk 1) on zero-cost
items against ``slice_dp`` on the same items, per chunk on a worker's path
(the extra time over the chunks one worker runs), beside one no-op call's cost
on the same gang (B1's measure: lazy call, then get).

Example::

    python -m bench --only B8
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function

WORKERS = 4
ITEMS = 256
ALPHA = 1.2
SEED = 2  # slice_dp 1.47x the ideal; in-order list scheduling 1.016x (see list_schedule)
IDEAL_S = 2.0  # the workload is scaled so the ideal makespan is this long
TARGET_VS_IDEAL = 1.15


@remote_class(distributed=False)
class LongTail:
    """Sleeps ``cost`` seconds per item; the same work under three dispatch modes."""

    def __init__(self, device_mesh=None):
        pass

    def _work(self, costs: list) -> list:
        for c in costs:
            if c > 0:
                time.sleep(c)
        return costs

    @remote_function(dispatch="slice_dp", collect="flatten")
    def fixed(self, costs: list) -> list:
        return self._work(costs)

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
    def balanced1(self, costs: list) -> list:
        return self._work(costs)

    @remote_function(dispatch="balance", collect="flatten", chunk_size=4)
    def balanced4(self, costs: list) -> list:
        return self._work(costs)

    @remote_function(dispatch="all", collect="none")
    def noop(self) -> None:
        return None


def costs(scale_to: float = IDEAL_S) -> tuple[list[float], float]:
    """The batch's costs in seconds (in the order drawn) and the ideal makespan."""
    raw = np.random.default_rng(SEED).pareto(ALPHA, ITEMS) + 1.0  # Pareto with x_m = 1
    ideal = max(raw.sum() / WORKERS, raw.max())
    scaled = raw * (scale_to / ideal)
    return [float(c) for c in scaled], float(max(scaled.sum() / WORKERS, scaled.max()))


def list_schedule(costs: list[float], chunk: int, workers: int = WORKERS) -> float:
    """The makespan of handing chunks in input order to whichever worker is free first, at
    no cost per chunk: the best ``balance`` can do on this order (a huge item drawn late
    still lands late: with seed 0 any in-order scheme is 1.6x the ideal).

    >>> list_schedule([3, 1, 1, 1], 1, 2)
    3
    """
    free = [0] * workers
    for i in range(0, len(costs), chunk):
        w = free.index(min(free))
        free[w] += sum(costs[i:i + chunk])
    return max(free)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_longtail(cfg) -> list[dict]:
    """B8 rows: three makespans and the ideal, then the per-chunk overhead."""
    repeats = max(1, min(3, cfg.chain_repeats))
    twinkle.initialize("ray", groups=[DeviceGroup("b8", WORKERS, "cpu")], namespace="twinkle-bench")
    gang = LongTail(device_mesh=DeviceMesh.from_sizes(dp_size=WORKERS), remote_group="b8")
    work, ideal = costs()
    zero = [0.0] * ITEMS
    sides = {"slice_dp": gang.fixed, "balance chunk 1": gang.balanced1, "balance chunk 4": gang.balanced4}
    try:
        for fn in sides.values():  # warm up: each method's tasks once
            assert fn(zero[:8])() == zero[:8]
        spans: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(repeats):
            for name, fn in sides.items():
                spans[name].append(_timed(lambda fn=fn: fn(work)()))
        per_call, fixed0, bal0 = [], [], []
        for _ in range(max(3, cfg.repeats // 4)):
            per_call.append(_timed(lambda: gang.noop().get()))
            fixed0.append(_timed(lambda: gang.fixed(zero)()))
            bal0.append(_timed(lambda: gang.balanced1(zero)()))
    finally:
        twinkle.shutdown()
    med = {k: statistics.median(v) for k, v in spans.items()}
    chunks_per_worker = ITEMS / WORKERS
    overhead = (statistics.median(bal0) - statistics.median(fixed0)) / chunks_per_worker
    call = statistics.median(per_call)
    rows = []
    for name, t in med.items():
        row = {"name": f"B8 long tail, {ITEMS} Pareto({ALPHA}) items, 4 workers: {name}", "b8": True,
               "makespan_s": t, "ideal_s": ideal, "vs_ideal": t / ideal}
        if name.startswith("balance"):
            bound = list_schedule(work, int(name.rsplit(" ", 1)[1]))
            row.update(bound_s=bound, vs_bound=t / bound)
        if name == "balance chunk 1":
            row.update(target=f"<= {TARGET_VS_IDEAL}x ideal", checks=(("vs_ideal", "<=", TARGET_VS_IDEAL),))
        rows.append(row)
    rows.append({"name": "B8 ideal max(sum/4, largest item)", "b8": True, "makespan_s": ideal,
                 "ideal_s": ideal, "vs_ideal": 1.0})
    rows.append({"name": "B8 balance overhead per chunk (zero-cost items, vs slice_dp)", "b8": True,
                 "b8_overhead": True, "overhead_per_chunk_s": overhead, "call_s": call,
                 "vs_call": overhead / call, "balance0_s": statistics.median(bal0),
                 "slice_dp0_s": statistics.median(fixed0), "target": "< one call (B1's no-op call + get)",
                 "checks": (("vs_call", "<=", 1.0),)})
    return rows


def table_lines(rows: list[dict], check) -> list[str]:
    """B8's section of the bench table (``check(row)``: the ok/MISS mark)."""
    if not rows:
        return []
    lines = ["", "B8 long tail: makespan (call + collect) vs the ideal max(sum/4, largest item)",
             f"{'':<72} {'makespan':>10} {'vs ideal':>9}  target"]
    for row in rows:
        if row.get("b8_overhead"):
            lines.append(f"{row['name']:<72} {row['overhead_per_chunk_s'] * 1000:7.2f} ms per chunk on a "
                         f"worker's path; one no-op call {row['call_s'] * 1000:.2f} ms "
                         f"({row['vs_call']:.2f}x)  {check(row)}")
            lines.append(f"{'':<72} (zero-cost batch: balance {row['balance0_s'] * 1000:.1f} ms, "
                         f"slice_dp {row['slice_dp0_s'] * 1000:.1f} ms)")
            continue
        lines.append(f"{row['name']:<72} {row['makespan_s']:8.3f} s {row['vs_ideal']:8.2f}x  {check(row)}")
        if "bound_s" in row:
            lines.append(f"{'   in-order list schedule at zero cost per chunk':<72} {row['bound_s']:8.3f} s "
                         f"{row['bound_s'] / row['ideal_s']:8.2f}x  (measured / it: {row['vs_bound']:.3f}x)")
    return lines
