"""The rebuild room starts one build at a time: a failure reported while a build is under way
(a restart() or an automatic rebuild) ends that build before the next starts (issue 28, item 2).

Plain asyncio on the Rebuilder with a stand-in builder: no Ray needed.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from twinkle_ray import WorkerDiedError
from twinkle_ray.runtime.health import DeathRecord
from twinkle_ray.runtime.rebuild import Rebuilder


class SlowBuilder:
    """Counts builds under way at once; each takes ``build_s``."""

    def __init__(self, max_restarts: int, build_s: float = 0.2):
        spec = SimpleNamespace(max_restarts=max_restarts, restart_window_s=None, restart_times=(),
                               restarts=0, label="g/C", metrics=False, start_timeout_s=None,
                               group=SimpleNamespace(name="g"), cls_name="C")
        self.state = SimpleNamespace(spec=spec, stopped=False, label="g/C", actor_ids=list)
        self.deaths = DeathRecord()
        self.build_s = build_s
        self.now = self.most = self.finished = 0

    async def kill(self, graceful: bool = False) -> None:
        pass

    async def start_within(self, limit) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(self.build_s)
        finally:
            self.now -= 1
        self.finished += 1
        self.deaths.revived()


def _rebuilder(max_restarts: int) -> tuple[Rebuilder, SlowBuilder]:
    builder = SlowBuilder(max_restarts)
    rebuilds = Rebuilder(builder)

    async def placed():
        return None

    rebuilds._placement_ready = placed
    return rebuilds, builder


def _death() -> WorkerDiedError:
    return WorkerDiedError("g", "C", 0, None, "killed")


def test_a_failure_during_restart_ends_that_build_first():
    async def main():
        rebuilds, builder = _rebuilder(max_restarts=1)
        restart = asyncio.ensure_future(rebuilds.restart())
        await asyncio.sleep(0.05)  # the restart's build is under way
        await rebuilds.fail(_death())  # an automatic rebuild follows it
        await restart
        await rebuilds.settled()
        return builder, rebuilds

    builder, rebuilds = asyncio.run(main())
    assert (builder.most, builder.finished, rebuilds.restarts) == (1, 1, 1)
    assert builder.deaths.error is None


def test_a_failure_past_the_budget_during_a_rebuild_ends_it_and_the_gang_stays_down():
    async def main():
        rebuilds, builder = _rebuilder(max_restarts=1)
        await rebuilds.fail(_death())  # the one automatic rebuild
        await asyncio.sleep(0.05)
        await rebuilds.fail(_death())  # its budget is spent: it ends, nothing more is built
        await rebuilds.settled()
        return builder

    builder = asyncio.run(main())
    assert (builder.most, builder.finished) == (1, 0)
    assert "restart budget is spent" in str(builder.deaths.error)
