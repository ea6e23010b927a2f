"""B6 through both call paths: what each added worker costs, lazy-then-get against eager.

    .venv/bin/python -m bench.b6_paths [--sizes 1,8,16,32] [--repeats 40]

B6 (``python -m bench --only B6``) times a lazy call and its ``get()``: the
dispatcher submits the workers' tasks, so it owns their outputs, and the
driver's get of each borrowed ref asks that owner. An eager call
(``sync=True``) gets the values in the dispatcher's reply instead. Timing
both beside raw Ray (the driver submits to every worker and gets the values)
on gangs of 1 to 32 workers, in balanced orders (:func:`bench.timing.compare_many`),
tells how much of B6's per-worker cost that ownership round trip is.
Printed: medians (ms) per size, least-squares slopes (ms per worker), and
each path's extra slope beyond raw Ray (target: <= 0.1 ms per worker). What its runs
decided: docs/decisions/ (git log -p BENCHMARKS.md has the runs themselves).
"""

from __future__ import annotations

import argparse
import statistics

import ray

import twinkle_ray as twinkle
from bench.cases import BenchWorker
from bench.raw import RawGang
from bench.timing import compare_many, slope
from twinkle_ray import DeviceGroup, DeviceMesh


def _sides(gang, actors: list) -> dict:
    return {"lazy then get": lambda: gang.noop().get(), "eager": lambda: gang.noop_eager(),
            "raw": lambda: ray.get([w.noop.remote() for w in actors])}


def run(sizes: list[int], repeats: int) -> dict:
    """Medians (ms) per size and side, and each side's slope (ms per worker)."""
    medians: dict[int, dict[str, float]] = {}
    for n in sizes:
        twinkle.initialize("ray", groups=[DeviceGroup(f"b6p_{n}", n, "cpu")])
        gang = BenchWorker(device_mesh=DeviceMesh.from_sizes(dp_size=n), remote_group=f"b6p_{n}")
        raw = RawGang(n)
        raw.start()
        try:
            samples = compare_many(_sides(gang, raw.actors), repeats=repeats, warmup=3)
            medians[n] = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
            print(f"{n:>3} worker(s): " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians[n].items()),
                  flush=True)
        finally:
            raw.close()
            twinkle.shutdown()
    xs = [float(n) for n in sizes]
    slopes = {k: slope(xs, [medians[n][k] for n in sizes]) for k in medians[sizes[0]]}
    return {"medians_ms": medians, "slopes_ms_per_worker": slopes}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.b6_paths", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,8,16,32", help="comma list of gang sizes")
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    ray.init(num_cpus=2 * max(sizes) + 8, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")  # virtual CPUs: one per worker, both sides
    try:
        out = run(sizes, args.repeats)
    finally:
        ray.shutdown()
    s = out["slopes_ms_per_worker"]
    print("slopes, ms per worker: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()))
    print("beyond raw Ray: " + ", ".join(f"{k} {v - s['raw']:+.3f}" for k, v in s.items() if k != "raw")
          + " (target <= 0.1)")


if __name__ == "__main__":
    main()
