"""What an idle gang costs its neighbours: nothing may spin while it waits for calls.

    .venv/bin/python -m bench.idle_spin [--idle-s 5] [--calls 300]

For a 4-worker CPU gang it prints:

- the CPU-seconds its processes (workers and dispatcher, read from
  ``/proc/<pid>/stat``) use while the gang waits ``--idle-s`` seconds for a
  call;
- while that gang sits idle, the median of a raw Ray no-op fan-out to 4 other
  actors and the time of a fixed pure-Python loop in the driver (neighbouring
  work, latency-bound and CPU-bound), beside the same with no gang alive.

An idle gang waits in Ray's task queues, so its CPU use stays near zero. (The
removed Compiled Graph path failed this: its channel readers spin, 5.05-9.4
CPU-s per 5 idle s for a 4-worker gang.) Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, remote_class, remote_function


@remote_class()
class Idle:
    @remote_function(dispatch="all", collect="none")
    def noop(self) -> None:
        return None


@ray.remote(num_cpus=0)
class Neighbour:
    def noop(self) -> None:
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fan_out_ms(actors: list, calls: int) -> float:
    """Median time of one no-op on every actor, submitted and fetched from the driver."""
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        ray.get([a.noop.remote() for a in actors])
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def compute_s(n: int = 3_000_000) -> float:
    """Seconds for a fixed pure-Python loop in this process: a CPU-bound neighbour."""
    t = time.perf_counter()
    x = 0
    for i in range(n):
        x += i & 7
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.idle_spin", description=__doc__.split("\n")[0])
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    twinkle.initialize(groups=[DeviceGroup("idle", 4, "cpu")], num_cpus=8, log_to_driver=False)
    rows = []
    try:
        neighbours = [Neighbour.remote() for _ in range(4)]
        fan_out_ms(neighbours, 20)  # warm-ups
        compute_s()
        rows.append({"gang": "none", "neighbour_ms": fan_out_ms(neighbours, args.calls),
                     "compute_s": min(compute_s() for _ in range(3))})
        gang = Idle(remote_group="idle")
        gang.noop()()
        topo = gang.topology()
        pids = [r["pid"] for r in topo["ranks"]] + [topo["dispatcher_pid"]]
        time.sleep(1.0)  # start-up settles
        before = sum(cpu_seconds(p) for p in pids)
        time.sleep(args.idle_s)
        used = sum(cpu_seconds(p) for p in pids) - before
        rows.append({"gang": "idle", "idle_cpu_s": used, "idle_s": args.idle_s,
                     "neighbour_ms": fan_out_ms(neighbours, args.calls),
                     "compute_s": min(compute_s() for _ in range(3))})
        gang.close()
    finally:
        twinkle.shutdown()
    base, work = rows[0]["neighbour_ms"], rows[0]["compute_s"]
    print(f"no gang alive: raw Ray no-op fan-out to 4 actors {base:.2f} ms, "
          f"a fixed pure-Python loop {work:.3f} s")
    for r in rows[1:]:
        print(f"4-worker gang, idle: {r['idle_cpu_s']:.2f} CPU-s in {r['idle_s']:g} s; "
              f"beside it the fan-out {r['neighbour_ms']:.2f} ms ({r['neighbour_ms'] / base:.2f}x), "
              f"the loop {r['compute_s']:.3f} s ({r['compute_s'] / work:.2f}x)")
    return rows


if __name__ == "__main__":
    main()
