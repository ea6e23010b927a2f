"""Probes behind the call path's design: what Ray charges for what a call carries.

    .venv/bin/python -m bench.probes [--rounds 300]

Plain Ray only (no twinkle_ray code), each pair of variants timed in the same
rounds in balanced orders (:func:`bench.timing.compare_many`), medians printed:

- **arguments**: an async actor's method called with the nine fields of a call
  as nine task arguments, as one tuple (what ``CallRequest`` is), and with none;
  and the one tuple with a previous call's ref nested in it (what ``SETTLED``
  saves): round trip, call and reply;
- **gets**: an async actor fans a no-op out to N plain actors and awaits the N
  results on its event loop (``asyncio.gather``) or with one ``ray.get`` in a
  helper thread (what ``aio.ThreadedGets`` does), N = 4 and 32, beside the
  driver doing the fan-out itself (raw Ray); and the whole fan-out (submits and
  the get) run in the helper thread, and by a plain (not async) actor: where
  the per-worker cost of an actor's fan-out comes from;
- **heads**: the same actor fans 32 tasks out whose one argument is the call's
  head, as a tuple ``('noop', seq, 0)`` (what worker tasks once carried), as one
  str ``'noop/seq/0'``, as a bare str, as an int, as bytes ``b'noop/seq/0'``,
  and no argument at all (what a raw Ray no-op carries); each
  round awaits the 32 results with one ``ray.get``. And the head as the
  task's name (``.options(name='noop/seq/0')``, read back in the worker with
  ``ray.get_runtime_context().get_task_name()``, which only this row pays
  for): nearly free, but Ray labels its ``ray_tasks`` metric series by task
  name, so a name per call would grow the node's Prometheus series without
  bound; the call number cannot travel so.

What its runs decided: docs/decisions/head-free-task.md (the runs: git log -p BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from concurrent.futures import ThreadPoolExecutor

import ray

from bench.timing import compare_many

FIELDS = ("noop", [((), {})], "all", "all", None, False, ("caller", 1, None), "none", True)


@ray.remote(num_cpus=0)
class Plain:
    def noop(self) -> None:
        return None

    def run(self, head) -> None:
        return None

    def named(self) -> None:
        ray.get_runtime_context().get_task_name()  # the head, read back
        return None


@ray.remote(num_cpus=0)
class Probe:
    def __init__(self, actors: list):
        self.actors = actors
        self.pool = ThreadPoolExecutor(1)

    async def nine(self, method, per_worker, dispatch, execute, caller, wait_meta, turn, collect,
                   inline):
        return None

    async def one(self, request: tuple):
        return None

    async def none(self):
        return None

    async def gathered(self, n: int) -> list:
        return list(await asyncio.gather(*[a.noop.remote() for a in self.actors[:n]]))

    async def one_get(self, n: int) -> list:
        refs = [a.noop.remote() for a in self.actors[:n]]
        return await asyncio.get_running_loop().run_in_executor(self.pool, ray.get, refs)

    async def fan_out_in_thread(self, n: int) -> list:
        def fan_out():
            return ray.get([a.noop.remote() for a in self.actors[:n]])
        return await asyncio.get_running_loop().run_in_executor(self.pool, fan_out)

    async def heads(self, kind: str, seq: int) -> list:
        head = {"tuple": ("noop", seq, 0), "str": f"noop/{seq}/0", "bare str": "noop",
                "int": seq, "bytes": f"noop/{seq}/0".encode()}.get(kind)
        if kind == "none":
            refs = [a.noop.remote() for a in self.actors]
        elif kind == "task name":
            refs = [a.named.options(name=f"noop/{seq}/0").remote() for a in self.actors]
        else:
            refs = [a.run.remote(head) for a in self.actors]
        return await asyncio.get_running_loop().run_in_executor(self.pool, ray.get, refs)


@ray.remote(num_cpus=0)
class SyncProbe:
    """A plain actor fanning out: no event loop between its submits."""

    def __init__(self, actors: list):
        self.actors = actors

    def fan_out(self, n: int) -> list:
        return ray.get([a.noop.remote() for a in self.actors[:n]])


def _medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.probes", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args(argv)
    ray.init(num_cpus=40, include_dashboard=False)
    try:
        actors = [Plain.remote() for _ in range(32)]
        ray.get([a.noop.remote() for a in actors])
        probe = Probe.options(max_concurrency=1000).remote(actors)
        plain = SyncProbe.remote(actors)
        prev = [ray.put(None)]
        args_ms = _medians(compare_many({
            "nine task arguments": lambda: ray.get(probe.nine.remote(*FIELDS)),
            "one tuple": lambda: ray.get(probe.one.remote(FIELDS)),
            "one tuple, a ref nested": lambda: ray.get(probe.one.remote((*FIELDS[:6], ("caller", 1, prev),
                                                                          *FIELDS[7:]))),
            "no argument": lambda: ray.get(probe.none.remote()),
        }, repeats=args.rounds, warmup=10))
        print("arguments of an async actor's call, round trip (ms):")
        for k, v in args_ms.items():
            print(f"  {k:28} {v:7.3f}")
        for n in (4, 16, 32):
            gets_ms = _medians(compare_many({
                "asyncio.gather": lambda n=n: ray.get(probe.gathered.remote(n)),
                "one ray.get in a thread": lambda n=n: ray.get(probe.one_get.remote(n)),
                "raw Ray from the driver": lambda n=n: ray.get([a.noop.remote() for a in actors[:n]]),
                "fan-out in a thread": lambda n=n: ray.get(probe.fan_out_in_thread.remote(n)),
                "fan-out by a plain actor": lambda n=n: ray.get(plain.fan_out.remote(n)),
            }, repeats=max(args.rounds // 10, 10), warmup=3))
            print(f"an actor awaiting {n} no-op results (ms):")
            for k, v in gets_ms.items():
                print(f"  {k:28} {v:7.3f}")
        heads_ms = _medians(compare_many({
            kind: lambda kind=kind: ray.get(probe.heads.remote(kind, 7))
            for kind in ("tuple", "str", "bare str", "int", "bytes", "task name", "none")
        }, repeats=max(args.rounds // 5, 10), warmup=3))
        print("an actor's 32 tasks, by the head each carries (ms per round):")
        for k, v in heads_ms.items():
            print(f"  {k:28} {v:7.3f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
