"""Interleaved timing: twinkle_ray and raw Ray take turns, so drift hits both alike.

``compare_many`` does the same for more than two sides (B1: twinkle eager,
twinkle lazy, the one-hop floor and raw, in balanced orders).

Example::

    r = compare(lambda: gang.noop().get(), lambda: ray.get([a.noop.remote() for a in raw]),
                repeats=50, warmup=5)
    r["twinkle_s"], r["raw_s"], r["ratio"]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

Step = Callable[[], object]


def timed(fn: Step, before: Step | None = None, after: Step | None = None) -> float:
    """Seconds ``fn()`` took; ``before``/``after`` run untimed around it."""
    if before is not None:
        before()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    if after is not None:
        after()
    return dt


def compare(
    twinkle: Step,
    raw: Step,
    *,
    repeats: int,
    warmup: int = 1,
    before: tuple[Step | None, Step | None] = (None, None),
    after: tuple[Step | None, Step | None] = (None, None),
) -> dict:
    """Median seconds of ``twinkle`` and ``raw``, run alternately ``repeats`` times each.

    The order alternates (T R, R T, ...) so neither side always runs first.
    Returns ``{'twinkle_s', 'raw_s', 'ratio', 'paired_ratio', 'twinkle_samples',
    'raw_samples'}``; ``ratio`` is the ratio of the medians.
    """
    sides = {"twinkle": (twinkle, before[0], after[0]), "raw": (raw, before[1], after[1])}
    for _ in range(warmup):
        for fn, b, a in sides.values():
            timed(fn, b, a)
    samples: dict[str, list[float]] = {"twinkle": [], "raw": []}
    for i in range(repeats):
        order = ("twinkle", "raw") if i % 2 == 0 else ("raw", "twinkle")
        for side in order:
            fn, b, a = sides[side]
            samples[side].append(timed(fn, b, a))
    t, r = statistics.median(samples["twinkle"]), statistics.median(samples["raw"])
    pairs = [a / b for a, b in zip(samples["twinkle"], samples["raw"], strict=True) if b > 0]
    return {
        "twinkle_s": t,
        "raw_s": r,
        "ratio": t / r if r > 0 else float("nan"),
        # robust to drift: the median of the ratios of neighbouring (twinkle, raw) runs
        "paired_ratio": statistics.median(pairs) if pairs else float("nan"),
        "twinkle_samples": samples["twinkle"],
        "raw_samples": samples["raw"],
    }


def compare_many(
    sides: dict[str, Step], *, repeats: int, warmup: int = 1, before: dict[str, Step] | None = None,
) -> dict[str, list[float]]:
    """Samples (seconds) of every side, ``repeats`` rounds of each side once.

    The rounds' orders follow a Williams design (:func:`balanced_orders`): every
    side takes every position, and follows every other side, equally often. A
    plain rotation kept each side's predecessor fixed, and what one call leaves
    behind (a lazy call's borrowed refs are released after it returns) slowed
    whichever side always came next by ~10 %.
    ``before[side]`` (optional) runs untimed just before each run of that side.
    Returns ``{side: [seconds, ...]}`` in run order.
    """
    names = list(sides)
    before = before or {}
    orders = balanced_orders(len(names))
    for _ in range(warmup):
        for name in names:
            timed(sides[name], before.get(name))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for j in orders[i % len(orders)]:
            samples[names[j]].append(timed(sides[names[j]], before.get(names[j])))
    return samples


def balanced_orders(k: int) -> list[list[int]]:
    """Orders of ``k`` sides (a Williams design: k orders, 2k when k is odd) in which every side
    takes every position, and directly follows every other side, equally often.

    >>> balanced_orders(4)
    [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    """
    base, low, high = [0], 1, k - 1
    while len(base) < k:
        base.append(low)
        low += 1
        if len(base) < k:
            base.append(high)
            high -= 1
    rows = [[(x + r) % k for x in base] for r in range(k)]
    return rows + [row[::-1] for row in rows] if k % 2 else rows


def ratios(num: list[float], den: list[float]) -> tuple[float, float]:
    """``(median(num) / median(den), median of the per-round ratios)`` of two sample lists."""
    a, b = statistics.median(num), statistics.median(den)
    pairs = [x / y for x, y in zip(num, den, strict=True) if y > 0]
    return (a / b if b > 0 else float("nan"), statistics.median(pairs) if pairs else float("nan"))


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs`` (nan with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def driver_cpu_per_call(submit: Callable[[], object], calls: int,
                        drain: Callable[[object], object]) -> float:
    """The driver process's CPU seconds per ``submit()`` (every thread: Ray's core worker threads
    that send the tasks count too), ``calls`` back to back; ``drain`` then waits for each one's
    results, outside the measurement (B10, and the peer bench's lazy-call row)."""
    outs = []
    t0 = time.process_time()
    for _ in range(calls):
        outs.append(submit())
    used = time.process_time() - t0
    for out in outs:
        drain(out)
    return used / calls
