"""Teardown leaves nothing; a long random soak loses, duplicates or misroutes nothing."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
import zlib

import pytest
import ray

from conftest import leftovers
from twinkle_ray import DeviceGroup, DeviceMesh, get_rank, remote_class, remote_function


@remote_class(distributed=False)
class Tiny:
    @remote_function(dispatch="slice", collect="flatten")
    def double(self, xs: list) -> list:
        return [2 * x for x in xs]


@pytest.mark.slow
def test_five_cycles_leak_nothing(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    for i in range(5):  # back to back: each cycle's names are taken again while the last die
        twinkle_ray.initialize(groups=[DeviceGroup("cyc", 2, "cpu")])  # 3 actors a cycle
        assert Tiny(remote_group="cyc").double([i, i + 1])() == [2 * i, 2 * i + 2]
        twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


EXITING_DRIVER = textwrap.dedent(
    """
    import os, sys
    import twinkle_ray as twinkle
    from twinkle_ray import DeviceGroup, remote_class, remote_function

    @remote_class()
    class Held:
        @remote_function(dispatch="all", collect="first")
        def ping(self):
            return "pong"

    twinkle.initialize(address=sys.argv[1], namespace="twinkle-exit",
                       groups=[DeviceGroup("held", 2, "cpu")])
    assert Held(remote_group="held").ping()() == "pong"
    print("READY", flush=True)
    os._exit(0)   # no shutdown(), no atexit: as if the driver crashed
    """
)


@pytest.mark.slow
def test_driver_exit_without_shutdown_leaves_nothing(ray_session):
    from ray.util import state

    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run([sys.executable, "-c", EXITING_DRIVER, address], capture_output=True,
                          text=True, timeout=180, env=env)
    assert "READY" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    deadline = time.monotonic() + 30
    while True:
        actors = [a for a in state.list_actors(address=address, filters=[("state", "!=", "DEAD")])
                  if a.get("ray_namespace") == "twinkle-exit"]
        pgs = [pg["name"] for pg in ray.util.placement_group_table().values()
               if pg["name"].startswith("twinkle/twinkle-exit/") and pg["state"] != "REMOVED"]
        if (not actors and not pgs) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not actors, [a["name"] for a in actors]
    assert not pgs, pgs


# Calls made (a chained pair counts 2): over 1,000 results checked in rounds of up to 64 pending
# (seed 1234). Kept at 2,000: this soak is the routing invariant's long run.
SOAK_CALLS = 2000


def checksum(call: int, i: int) -> int:
    return zlib.crc32(f"{call}:{i}".encode())


@remote_class(distributed=False)
class Soaker:
    def __init__(self, device_mesh: DeviceMesh):
        self.mesh = device_mesh

    @remote_function(dispatch="slice_dp", collect="none")
    def recv(self, items: list) -> list:
        return [get_rank(), list(items)]

    @remote_function(dispatch="slice", collect="none")
    def recv_slice(self, items: list) -> list:
        return [get_rank(), list(items)]

    @remote_function(dispatch="slice_dp", collect="flatten")
    def emit(self, items: list) -> list:
        return list(items)


def _span(n: int, parts: int, k: int) -> range:
    q, r = divmod(n, parts)
    start = k * q + min(k, r)
    return range(start, start + q + (1 if k < r else 0))


@pytest.mark.slow
def test_soak_two_thousand_calls_nothing_lost_duplicated_or_misrouted(runtime):
    runtime.initialize(groups=[DeviceGroup("p", 2, "cpu"), DeviceGroup("c", 3, "cpu")])
    p = Soaker(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="p")
    c = Soaker(device_mesh=DeviceMesh.from_sizes(dp_size=3), remote_group="c")
    rng = random.Random(1234)
    calls = 0
    pending = []
    checked = 0
    while calls < SOAK_CALLS:
        n = rng.randint(3, 40)
        batch = [(calls, i, checksum(calls, i)) for i in range(n)]
        mode = rng.choice(["p.recv", "c.recv", "c.recv_slice", "p->c", "c->p"])
        if mode == "p.recv":
            pending.append((p.recv(batch), batch, 2))
            calls += 1
        elif mode == "c.recv":
            pending.append((c.recv(batch), batch, 3))
            calls += 1
        elif mode == "c.recv_slice":
            pending.append((c.recv_slice(batch), batch, 3))
            calls += 1
        elif mode == "p->c":
            pending.append((c.recv(p.emit(batch)), batch, 3))
            calls += 2
        else:
            pending.append((p.recv(c.emit(batch)), batch, 2))
            calls += 2
        if len(pending) >= 64 or calls >= SOAK_CALLS:
            for lazy, b, dp in pending:
                per_rank = lazy()
                seen = []
                for k, (rank, items) in enumerate(per_rank):
                    assert rank == k
                    assert items == [b[j] for j in _span(len(b), dp, k)], (k, len(b), dp)
                    seen.extend(items)
                assert sorted(seen) == sorted(b)  # nothing lost, nothing duplicated
                assert all(cs == checksum(ci, i) for ci, i, cs in seen)
                checked += 1
            pending.clear()
    assert calls >= SOAK_CALLS and checked > SOAK_CALLS // 2
