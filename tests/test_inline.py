"""Eager calls get their values in the dispatcher's reply (issue 28: small eager results come
back without an extra ownership round trip), and payload still never passes through it: only
certainly small plain data does; anything else stays in its worker's store (Held)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import numpy as np
import pytest
import ray
from ray.util import state

from twinkle_ray import DeviceGroup, DeviceMesh, WorkerDiedError, remote_class, remote_function
from twinkle_ray.runtime.inline import Held, certainly_small, hold_unless_small, unhold
from twinkle_ray.runtime.lazy import LazyResult
from twinkle_ray.runtime.message import CallRequest
from twinkle_ray.runtime.sequencer import SETTLED


class Traced:
    """Writes ``<pid>-<uuid>`` into ``trace_dir`` whenever it is unpickled."""

    def __init__(self, trace_dir: str):
        self.trace_dir = trace_dir

    def __reduce__(self):
        return (_arrived, (self.trace_dir,))


def _arrived(trace_dir: str) -> Traced:
    with open(os.path.join(trace_dir, f"{os.getpid()}-{uuid.uuid4().hex}"), "w"):
        pass
    return Traced(trace_dir)


class Boxed:
    """A user's class holding an array: its size cannot be read from its structure."""

    def __init__(self, arr, trace_dir: str):
        self.arr, self.tag = arr, Traced(trace_dir)


def _pids(trace_dir) -> set[int]:
    return {int(name.split("-")[0]) for name in os.listdir(trace_dir)}


@remote_class()
class Echo:
    def __init__(self, device_mesh=None):
        self.mesh = device_mesh

    @remote_function(dispatch="slice_dp", collect="flatten", sync=True)
    def double(self, xs: list) -> list:
        return [2 * x for x in xs]

    @remote_function(dispatch="all", collect="mean", sync=True)
    def rank(self) -> float:
        import twinkle_ray

        return float(twinkle_ray.get_rank())

    @remote_function(dispatch="all", collect="none", sync=True)
    def traced(self, trace_dir: str, n: int) -> dict:
        """n float32 values and a tracer (256 KB at n = 65536: large; 16 B at n = 4: small)."""
        return {"x": np.full(n, 1.0, dtype=np.float32), "tag": Traced(trace_dir)}

    @remote_function(dispatch="all", collect="none", sync=True)
    def boxed(self, trace_dir: str, n: int) -> Boxed:
        return Boxed(np.ones(n, dtype=np.float32), trace_dir)

    @remote_function(dispatch="all", collect="none")
    def plain(self, n: int) -> dict:
        return {"loss": 0.5, "ids": list(range(n)), "x": np.zeros(n, dtype=np.float32)}

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    @remote_function(dispatch="all", collect="none", sync=True)
    def refuse(self) -> int:
        import twinkle_ray

        if twinkle_ray.get_rank() == 1:
            raise ValueError("rank one says no")
        return 0


def _dispatcher_pid(gang) -> int:
    label = gang.topology()["label"]
    rows = state.list_actors(address=ray.get_runtime_context().gcs_address,
                             filters=[("name", "=", label), ("state", "=", "ALIVE")])
    return rows[0]["pid"]


def test_only_certainly_small_plain_data_comes_back_inline(ray_session):
    small = {"x": np.zeros(4, dtype=np.float32), "ids": [1, 2, 3], "name": "ok", "t": (1.5, None)}
    assert certainly_small(small) and hold_unless_small(small) is small
    assert not certainly_small(np.arange(65536, dtype=np.float32))  # 256 KB
    assert not certainly_small({"a": {"b": {"c": list(range(100_000))}}})  # large, however deep
    assert not certainly_small(Boxed(np.zeros(4), "/nonexistent"))  # a user's class: not sizable
    assert not certainly_small(np.array([object()]))  # numpy holding Python objects
    big = np.arange(65536, dtype=np.float32)
    held = hold_unless_small(big)
    assert isinstance(held, Held)
    got = unhold([1, held, None], lambda refs, at: ray.get(refs))
    assert got[0] == 1 and got[2] is None and np.array_equal(got[1], big)


def _inline_call(gang, method: str, *args):
    """Submit ``method`` the way an eager call is (inline=True); the dispatcher's reply and its ref."""
    plan, _ = gang._gang.dispatcher.call.remote(
        CallRequest(method, [(args, {})], "all", "all", collect="none", inline=True))
    return ray.get(plan), plan


@pytest.mark.slow
def test_eager_results_come_back_inline_and_payload_stays_off_the_dispatcher(runtime, tmp_path):
    runtime.initialize(groups=[DeviceGroup("inline", 4, "cpu")])
    gang = Echo(device_mesh=DeviceMesh.from_sizes(dp_size=4), remote_group="inline")
    assert gang.double([1, 2, 3, 4, 5, 6, 7, 8]) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert gang.rank() == 1.5
    # This caller had the eager call's reply: its next call tells the dispatcher SETTLED
    # instead of nesting the previous call's ref in its arguments (runtime.sequencer).
    assert gang._prev.told() == SETTLED
    pending = gang.plain(1)  # lazy: until its reply is here, the next call carries its settled ref
    assert isinstance(gang._prev.told(), list)
    assert pending.get()[0]["ids"] == [0]
    assert gang._prev.told() == SETTLED
    dispatcher = _dispatcher_pid(gang)

    # Small plain data rides in the dispatcher's reply: no refs, no Held.
    out, _ = _inline_call(gang, "plain", 3)
    assert out.refs == [] and len(out.values) == 4
    assert all(v["ids"] == [0, 1, 2] and v["loss"] == 0.5 for v in out.values)

    # A large array, and a user's class whose size the structure does not tell (4 MB inside):
    # both stay in their worker's store until the caller fetches them from there.
    for what, method, n in (("array", "traced", 65536), ("user class", "boxed", 1 << 20)):
        trace = tmp_path / what.replace(" ", "_")
        trace.mkdir()
        got = getattr(gang, method)(str(trace), n)
        sums = [float(o["x"].sum()) if isinstance(o, dict) else float(o.arr.sum()) for o in got]
        assert sums == [float(n)] * 4
        assert os.getpid() in _pids(trace)
        assert dispatcher not in _pids(trace), f"a {what} eager result passed through the dispatcher"
    gang.close()


@pytest.mark.slow
def test_a_held_result_whose_worker_died_is_a_worker_death(runtime, tmp_path):
    runtime.initialize(groups=[DeviceGroup("inline", 2, "cpu")])
    gang = Echo(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="inline")
    out, plan = _inline_call(gang, "boxed", str(tmp_path), 1 << 18)
    assert [type(v) for v in out.values] == [Held, Held]
    os.kill(gang.pid()()[0], signal.SIGKILL)  # rank 0 dies before the caller fetched its result
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the gang (and so Ray) knows the worker is gone
        try:
            gang.check_health()
        except WorkerDiedError:
            break
        time.sleep(0.2)
    time.sleep(2)  # and the caller has heard that the Held object's owner is gone
    with pytest.raises(WorkerDiedError) as info:
        LazyResult(plan, collect="none", gang=gang._gang, method="boxed").get()
    assert "Echo" in str(info.value) and "'inline'" in str(info.value), str(info.value)
    gang.close()


@pytest.mark.slow
def test_an_eager_call_that_raises_names_the_rank(runtime):
    runtime.initialize(groups=[DeviceGroup("inline", 2, "cpu")])
    gang = Echo(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="inline")
    with pytest.raises(ValueError, match="rank one says no") as info:
        gang.refuse()
    assert "raised in Echo.refuse() on rank 1 of group 'inline'" in "\n".join(info.value.__notes__)
    assert gang.double([1, 2]) == [2, 4]  # the gang goes on
    gang.close()
