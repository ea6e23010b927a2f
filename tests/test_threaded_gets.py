"""``aio.ThreadedGets``: an eager call's values awaited by one ``ray.get`` in a helper thread.

Checked in the test's own event loop against plain Ray tasks: values in order, the first
failure raised as ``ray.get`` raises it, a get that never ends does not hold up the next one
(a second thread takes it), and with every thread on a get the loop awaits instead.
"""

from __future__ import annotations

import asyncio

import pytest
import ray

from twinkle_ray.runtime.aio import ThreadedGets

HANG_S = 30.0  # only turns a hang into a failure; nothing is timed


@ray.remote(num_cpus=0)
def value(x):
    return x


@ray.remote(num_cpus=0)
def boom():
    raise ValueError("boom on purpose")


@ray.remote(num_cpus=0)
class Gate:
    async def wait(self):
        await asyncio.Event().wait()  # never set: a result that never comes


def test_values_come_in_order_and_the_first_failure_is_raised(ray_session):
    async def main():
        gets = ThreadedGets(threads=2)
        got = await asyncio.wait_for(gets.all([value.remote(i) for i in range(5)]), HANG_S)
        with pytest.raises(ray.exceptions.RayTaskError, match="boom on purpose"):
            await asyncio.wait_for(gets.all([value.remote(1), boom.remote()]), HANG_S)
        return got, gets._busy

    got, busy = asyncio.run(main())
    assert got == [0, 1, 2, 3, 4] and busy == 0


def test_a_get_that_never_ends_holds_up_no_other(ray_session):
    gate = Gate.remote()

    async def main():
        gets = ThreadedGets(threads=2)
        stuck = asyncio.ensure_future(gets.all([gate.wait.remote()]))
        await asyncio.sleep(0)
        # the first thread is on the stuck get: a second one takes this
        second = await asyncio.wait_for(gets.all([value.remote("a")]), HANG_S)
        stuck_too = asyncio.ensure_future(gets.all([gate.wait.remote()]))
        await asyncio.sleep(0)
        # both threads are on stuck gets: this one is awaited on the loop
        third = await asyncio.wait_for(gets.all([value.remote("b"), value.remote("c")]), HANG_S)
        state = (gets._busy, gets._started)
        stuck.cancel()
        stuck_too.cancel()
        return second, third, state

    try:
        second, third, (busy, started) = asyncio.run(main())
    finally:
        ray.kill(gate)
    assert second == ["a"] and third == ["b", "c"]
    assert (busy, started) == (2, 2)
