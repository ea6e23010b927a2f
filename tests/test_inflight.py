"""Requests in flight (``in_flight=k``) and ``LazyResult.as_completed``.

One module-scoped gang of sleep engines (2 data-parallel groups, no torch.distributed)
serves most cases; the fault cases build their own. What is checked: every index exactly
once and get() in input order under generated lengths and k (hypothesis); the
k-concurrency per group; tp peers get the same chunks; errors (a raising request, a
worker killed mid-stream, a timeout); every bad input (decoration, as_completed on other
calls); versions read from the weight-version counter.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from twinkle_ray import (
    CallTimeoutError,
    Completed,
    DeviceGroup,
    DeviceMesh,
    WorkerDiedError,
    get_rank,
    remote_class,
    remote_function,
)
from twinkle_ray.core.balance import WEIGHT_VERSION_ATTR


@remote_class(distributed=False)
class Engine:
    """A sleep engine: each request awaits its length; counts requests running at once."""

    def __init__(self, device_mesh=None):
        self.running = 0
        self.peak = 0
        self.seen: list[int] = []

    async def _one(self, x: float) -> float:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(x)
        finally:
            self.running -= 1
        return x

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=4)
    async def gen4(self, xs: list) -> list:
        self.seen.extend(xs)
        return [await self._one(x) for x in xs]

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=1)
    async def gen1(self, xs: list) -> list:
        return [await self._one(x) for x in xs]

    @remote_function(dispatch="balance", collect="flatten", chunk_size=2, in_flight=3)
    async def pairs(self, xs: list) -> tuple:
        await asyncio.sleep(0.001 * len(xs))
        return [x * 2 for x in xs], [get_rank()] * len(xs)

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=3)
    async def versioned(self, xs: list) -> list:
        setattr(self, WEIGHT_VERSION_ATTR, getattr(self, WEIGHT_VERSION_ATTR, 0) + 1)
        await asyncio.sleep(0.001)
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=2)
    async def flaky(self, xs: list) -> list:
        if xs[0] == "bad":
            raise KeyError("a bad request")
        await asyncio.sleep(0.05)
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=2,
                     timeout=0.5)
    async def too_slow(self, xs: list) -> list:
        await asyncio.sleep(5.0)
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
    def plain(self, xs: list) -> list:
        return [x + 1 for x in xs]

    @remote_function(dispatch="slice_dp", collect="flatten")
    def sliced(self, xs: list) -> list:
        return xs

    @remote_function(dispatch="all", collect="none")
    def peak_and_reset(self) -> int:
        peak, self.peak = self.peak, 0
        return peak

    @remote_function(dispatch="all", collect="none")
    def streams_held(self) -> int:
        return 0

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def engines(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("engines", 2, "cpu")])
    gang = Engine(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="engines")
    yield gang
    twinkle_ray.shutdown()


def _drain(lazy, timeout=60.0) -> list[Completed]:
    return list(lazy.as_completed(timeout=timeout))


def test_smoke_every_index_once_and_get_in_input_order(engines):
    xs = [0.001 * (i % 7) for i in range(30)]
    lazy = engines.gen4(xs)
    got = _drain(lazy)
    assert sorted(c.index for c in got) == list(range(30))
    assert all(c.value == xs[c.index] for c in got)
    assert {c.rank for c in got} <= {0, 1}
    assert lazy.get() == xs
