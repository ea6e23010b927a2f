"""``LazyResult.done()`` never waits, also for a large gang's reply (its refs packed in a bundle).

A reply with more than PACK_REFS_OVER refs carries one ObjectRef of them, owned by the
dispatcher (``Reply.packed``). ``done()`` used to fetch that bundle to read the refs: a
bundle not yet local (on another node, behind a busy link) made a poll block. Here the bundle
is a task's output that is held back until the test releases it.
"""

from __future__ import annotations

import asyncio
import threading

import ray

from twinkle_ray.runtime.diagnose import GangRef
from twinkle_ray.runtime.lazy import LazyResult
from twinkle_ray.runtime.reply import Reply


@ray.remote(num_cpus=0)
class Gate:
    def __init__(self):
        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()

    def open(self) -> None:
        self.event.set()


@ray.remote(num_cpus=0)
def bundle_when(gate, refs: list, metas: list) -> tuple[list, list]:
    ray.get(gate.wait.remote())
    return refs, metas


def test_done_does_not_fetch_a_bundle_that_is_not_here(ray_session):
    gate = Gate.remote()
    try:
        outputs = [ray.put([k]) for k in range(3)]
        bundle = bundle_when.remote(gate, outputs, [1, 1, 1])
        reply = Reply(refs=[], records=[], workers=[0, 1, 2], bundle=bundle)
        lazy = LazyResult(ray.put(reply), collect="flatten", gang=GangRef("g", "Model", dispatcher=None),
                          method="rows")
        polled: list[bool] = []
        poll = threading.Thread(target=lambda: polled.append(lazy.done()), daemon=True)
        poll.start()
        poll.join(30)  # a liveness bound, not a timing check: the bundle is held until released
        assert polled == [False], "done() waited for the bundle of refs"
        gate.open.remote()
        assert ray.get(bundle)[1] == [1, 1, 1]
        ray.wait([bundle], timeout=30)  # local now: done() reads the refs and polls them
        assert lazy.done()
        assert ray.get(lazy.refs) == [[0], [1], [2]]
    finally:
        ray.kill(gate)
