"""A quick look at one gang's call cost on each call path (no raw-Ray ratios: see bench/run.py).

Run it twice on a quiet machine, once per path:

    .venv/bin/python bench/probe_paths.py                      # the task path (default)
    TWINKLE_COMPILED=1 .venv/bin/python bench/probe_paths.py   # the Compiled Graph path

For two gangs of 4 CPU workers in turn it prints: start-up, an eager no-op call plus collect
(mean of 200), 100 lazy calls made back to back then collected once (per call), and which path
the gang took (``topology()["path"]``).
"""

from __future__ import annotations

import os
import time

import twinkle_ray as tw
from twinkle_ray import DeviceGroup, remote_class, remote_function


@remote_class()
class Noop:
    @remote_function(dispatch="all", collect="none")
    def noop(self):
        return None


def main() -> None:
    tw.initialize(groups=[DeviceGroup("g", 4, "cpu")], num_cpus=6)
    label = "graph" if os.environ.get("TWINKLE_COMPILED") == "1" else "tasks"
    for _ in range(2):
        t = time.perf_counter()
        gang = Noop(remote_group="g")
        start_s = time.perf_counter() - t
        gang.noop()()  # first call (a graph compiles at start-up, before this)
        t = time.perf_counter()
        for _ in range(200):
            gang.noop()()
        eager_ms = (time.perf_counter() - t) / 200 * 1000
        t = time.perf_counter()
        out = None
        for _ in range(100):
            out = gang.noop()
        out()
        lazy_ms = (time.perf_counter() - t) / 100 * 1000
        path = gang.topology().get("path")
        print(f"{label}: start {start_s:.2f}s, eager {eager_ms:.2f} ms, "
              f"lazy back to back {lazy_ms:.2f} ms, path={path}", flush=True)
        gang.close()
    tw.shutdown()


if __name__ == "__main__":
    main()
