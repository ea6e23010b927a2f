"""B1/B2 side by side with their one-hop floors, repeated in alternation; optionally profiled.

A focused probe of the call path (issue 47): the 200-link chain of lazy calls (B2) and the
eager no-op (B1) against the one-hop floor, each pair timed back to back ``--rounds``
times, medians and the load average printed. ``--profile SECONDS`` instead runs the chain
in a loop while ``py-spy`` samples the driver, the dispatcher and one worker, and prints
each process's hottest frames (own time and inclusive).

Usage::

    python -m bench.chain_probe --rounds 7                 # B2 and B1 figures
    python -m bench.chain_probe --profile 15 --out /tmp/p  # where a link's time goes
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import threading
import time

import ray

from bench import cases, whatif
from bench.raw import RawGang
from bench.run import _start_ray


def _chain(gang, n: int, length: int):
    start = [[i] for i in range(n)]

    def tw():
        x = gang.step([i for xs in start for i in xs])
        for _ in range(length - 1):
            x = gang.step(x)
        assert x.get() == list(range(n))

    return tw, start


def _floor_chain(hop, start, length: int, n: int):
    def floor():
        link = hop.step.remote(start)
        for _ in range(length - 1):
            link = hop.step.remote(link)
        assert [i for xs in ray.get(ray.get(link)) for i in xs] == list(range(n))

    return floor


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def figures(gang, actors, n: int, rounds: int, length: int, b1_reps: int) -> dict:
    hop = whatif.Hop.options(max_concurrency=1000).remote(actors)
    tw, start = _chain(gang, n, length)
    floor = _floor_chain(hop, start, length, n)
    tw(), floor()  # warm
    b2 = {"tw": [], "floor": []}
    for i in range(rounds):
        for side in (("tw", "floor") if i % 2 == 0 else ("floor", "tw")):
            b2[side].append(_time(tw if side == "tw" else floor))
    b1 = {"eager": [], "floor": []}
    for _ in range(3):
        gang.noop_eager(), ray.get(ray.get(hop.refs.remote()))
    for i in range(b1_reps):
        for side in (("eager", "floor") if i % 2 == 0 else ("floor", "eager")):
            fn = gang.noop_eager if side == "eager" else (lambda: ray.get(ray.get(hop.refs.remote())))
            b1[side].append(_time(fn))
    ray.kill(hop)
    med = {f"b2_{k}": statistics.median(v) for k, v in b2.items()}
    med.update({f"b1_{k}": statistics.median(v) for k, v in b1.items()})
    # B2 is throughput: the floor's time over ours; B1 is time: ours over the floor's
    med["b2_ratio"] = med["b2_floor"] / med["b2_tw"]
    med["b2_pair_ratios"] = sorted(f / t for t, f in zip(b2["tw"], b2["floor"], strict=True))
    med["b1_ratio"] = med["b1_eager"] / med["b1_floor"]
    med["load"] = os.getloadavg()
    return med


def _pyspy(pid: int, seconds: float, out: str) -> subprocess.Popen:
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200",
                             "-f", "raw", "-o", out, "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize(path: str, top: int = 25) -> str:
    own, incl, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            c = int(count)
            frames = stack.split(";")
            # idle: a thread waiting in a select/epoll/lock
            total += c
            own[frames[-1]] += c
            for fr in set(frames):
                incl[fr] += c
    lines = [f"{path}: {total} samples"]
    lines.append("  own:")
    lines += [f"    {100 * c / total:5.1f}% {fr}" for fr, c in own.most_common(top)]
    lines.append("  inclusive:")
    lines += [f"    {100 * c / total:5.1f}% {fr}" for fr, c in incl.most_common(top)]
    return "\n".join(lines)


def profile(gang, n: int, seconds: float, out: str, what: str = "chain") -> None:
    os.makedirs(out, exist_ok=True)
    topo = gang.topology()
    pids = {"dispatcher": topo["dispatcher_pid"], "worker0": topo["ranks"][0]["pid"],
            "worker1": topo["ranks"][1]["pid"], "driver": os.getpid()}
    if what == "chain":
        tw, _ = _chain(gang, n, 200)
    else:  # the eager no-op, 200 at a time
        def tw():
            for _ in range(200):
                gang.noop_eager()
    tw()
    stop = threading.Event()
    links = [0]

    def loop():
        while not stop.is_set():
            tw()
            links[0] += 200

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(1.0)
    procs = {k: _pyspy(p, seconds, f"{out}/{k}.txt") for k, p in pids.items()}
    t0 = time.perf_counter()
    l0 = links[0]
    for p in procs.values():
        p.wait()
    dt = time.perf_counter() - t0
    stop.set()
    t.join()
    print(f"profiled {what} {seconds}s: ~{(links[0] - l0) / dt:.0f} calls/s (py-spy running), "
          f"load {os.getloadavg()}")
    for k in procs:
        if os.path.exists(f"{out}/{k}.txt"):
            print(summarize(f"{out}/{k}.txt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--length", type=int, default=200)
    p.add_argument("--b1", type=int, default=40)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--profile", type=float, default=0)
    p.add_argument("--out", default="/tmp/chain_profile")
    p.add_argument("--what", default="chain", choices=["chain", "eager"])
    a = p.parse_args()
    _start_ray()
    n = a.workers
    gang = cases._gang(n, "b1")
    raw = RawGang(n)
    raw.start()
    try:
        if a.profile:
            profile(gang, n, a.profile, a.out, a.what)
        else:
            r = figures(gang, raw.actors, n, a.rounds, a.length, a.b1)
            for k, v in r.items():
                print(f"{k}: {[round(x, 3) for x in v] if isinstance(v, list | tuple) else round(v, 5)}")
    finally:
        raw.close()
        import twinkle_ray as twinkle

        twinkle.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
