"""What-if rows: the design space around the dispatcher hop, measured in the same run.

These are not twinkle_ray features; they bound what any design can reach on
the machine the bench runs on:

- ``Hop`` is the cheapest possible dispatcher: one async actor that fans a
  call out to the raw actors and either awaits the values and returns them
  (``values``), or returns the output ObjectRefs at once (``refs``, which is
  what "refs only" means: the caller then fetches them from the hop, their
  owner). If even ``values`` is above a target, no design with an extra actor
  on the call path can meet it. ``refs`` is B1's *one-hop floor*, a regular
  row of every run (``bench.cases._b1``), not a what-if: B1's target is
  stated against it.
- ``direct_*`` call the twinkle_ray gang's own worker actors straight from the
  driver (the worker's ``run`` with the task the dispatcher would send,
  the pure ``collect``), i.e. a gang whose dispatcher stays the
  owner/health/restart authority but is off the call path -- the proposal in
  BENCHMARKS.md.

Example::

    hop = Hop.options(max_concurrency=1000).remote(raw.actors)
    ray.get(hop.values.remote())
"""

from __future__ import annotations

import asyncio

import ray

from twinkle_ray.core.dispatch import collect
from twinkle_ray.runtime.wire import Resolved, Task


@ray.remote(num_cpus=0)
class Hop:
    """A minimal forwarding actor in front of raw actors."""

    def __init__(self, actors: list):
        self.actors = actors

    async def values(self) -> list:
        """Fan out a no-op, await the results, return them (one hop, values back)."""
        return list(await asyncio.gather(*[a.noop.remote() for a in self.actors]))

    async def refs(self) -> list:
        """Fan out a no-op, return the output refs at once (one hop, refs back)."""
        return [a.noop.remote() for a in self.actors]

    async def step(self, inputs: list) -> list:
        """One link of a chain: each actor's ``step`` on its input (a value or the previous
        link's output ref), the output refs back at once (B2's one-hop floor)."""
        return [a.step.remote(x) for a, x in zip(self.actors, inputs, strict=True)]


def gang_workers(proxy, namespace: str) -> list:
    """The worker actor handles of a twinkle_ray gang, in rank order (found by name)."""
    topo = proxy.topology()
    return [ray.get_actor(f"{topo['label']}/{r['rank']}", namespace=namespace) for r in topo["ranks"]]


def _task(method: str, args: tuple, returns: str = "value") -> Task:
    """A worker task as the dispatcher makes it (runtime.wire), numbered 0."""
    return Task(method, 0, returns, args, {}, [], (), None)


def direct_noop(workers: list) -> object:
    """A no-op through the gang's workers, submitted by the driver; collected as twinkle does."""
    task = _task("noop", ())  # collect 'none': no records
    outs = [w.run.remote(task, []) for w in workers]
    return collect("none", ray.get(outs), worker_indices=list(range(len(workers))))


def direct_chain(workers: list, start: list, length: int) -> list:
    """B2 through the gang's workers from the driver: each link takes the previous output ref
    (a put of the caller's, fetched by the rank, as a routed output is)."""
    def link(w, prev):
        task = _task("step", (Resolved(0),), "meta")
        return w.run.options(num_returns=2).remote(task, [prev])[0]

    refs = [link(w, ray.put(xs)) for w, xs in zip(workers, start, strict=True)]
    for _ in range(length - 1):
        refs = [link(w, r) for w, r in zip(workers, refs, strict=True)]
    return collect("flatten", ray.get(refs), worker_indices=list(range(len(workers))))
