"""Eager calls get their values in the dispatcher's reply (small eager results come back without
an extra ownership round trip), and payload still never passes through it: a result whose
pickle is at most INLINE_BYTES (measured, not guessed) rides as bytes the dispatcher never
unpickles; anything else stays in its worker's store (Held)."""

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
from twinkle_ray.core.functions import RemoteFunction
from twinkle_ray.runtime.lazy import LazyResult
from twinkle_ray.runtime.reply import (
    INLINE_BYTES,
    INLINE_CALL_BYTES,
    Held,
    Inline,
    inline,
    inline_limit,
    values_of,
)
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

    @remote_function(dispatch="all", collect="none", sync=True)
    def blob(self, n: int) -> bytes:
        return b"x" * n

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


def test_inline_decides_by_the_pickled_size(ray_session):
    import pickle

    small = {"x": np.zeros(4, dtype=np.float32), "ids": [1, 2, 3], "name": "ok", "t": (1.5, None)}
    out = inline(small)
    assert isinstance(out, Inline) and len(out.data) <= INLINE_BYTES
    back = pickle.loads(out.data)
    assert back["ids"] == [1, 2, 3] and np.array_equal(back["x"], small["x"])
    assert isinstance(inline(np.arange(65536, dtype=np.float32)), Held)  # 256 KB
    assert isinstance(inline({"a": {"b": {"c": list(range(100_000))}}}), Held)  # large, however deep
    assert isinstance(inline(Boxed(np.zeros(1 << 18), "/nonexistent")), Held)  # 1 MB in a user class
    assert isinstance(inline(Boxed(np.zeros(4), "/nonexistent")), Inline)  # small: sized, not refused
    # Counted by structure these were "certainly small" and came back inline at 80-468 KB: a str
    # counted in characters (2 bytes each in UTF-8 here), ints as 16 bytes (these pickle to ~130)
    assert isinstance(inline("é" * 40_000), Held)
    assert isinstance(inline([2 ** 1000 + i for i in range(3000)]), Held)
    assert isinstance(inline([ray.put(1)]), Held)  # a ref in it: Ray keeps count of it
    big = np.arange(65536, dtype=np.float32)
    held = inline(big)
    got = values_of([Inline(pickle.dumps(1)), held, None], lambda refs, at: ray.get(refs))
    assert got[0] == 1 and got[2] is None and np.array_equal(got[1], big)


def _inline_call(gang, method: str, *args):
    """Submit ``method`` the way an eager call is (returns='inline'); the dispatcher's reply and
    its ref."""
    g = gang._gang
    spec = RemoteFunction(None, dispatch="all", collect="none")
    call = gang._encode(g, method, spec, "all", args, {}, None, "inline", False)
    reply_ref, _ = g.dispatcher.call.remote(call)
    return ray.get(reply_ref), reply_ref


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

    # Small data rides in the dispatcher's reply, pickled: no refs, no Held.
    out, _ = _inline_call(gang, "plain", 3)
    assert out.refs == [] and len(out.values) == 4 and all(isinstance(v, Inline) for v in out.values)
    values = values_of(out.values, None)
    assert all(v["ids"] == [0, 1, 2] and v["loss"] == 0.5 for v in values)

    # A large array, and a user's class (4 MB inside): both stay in their worker's store until
    # the caller fetches them from there; a small traced result comes back as bytes the
    # dispatcher never unpickles.
    for what, method, n in (("array", "traced", 65536), ("user class", "boxed", 1 << 20),
                            ("small result", "traced", 4)):
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
    out, reply_ref = _inline_call(gang, "boxed", str(tmp_path), 1 << 18)
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
        LazyResult(reply_ref, collect="none", gang=gang._gang, method="boxed").get()
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


@pytest.mark.slow
def test_inline_bytes_are_bounded_per_call_whatever_the_gang_size(runtime):
    """Guards against: the bound was per rank (64 KB), so 64 ranks brought 4 MB through the
    dispatcher in one call. Now the call's inline results come to INLINE_CALL_BYTES at most:
    in a gang of 9, results of 62 KB (each under INLINE_BYTES) stay in their workers' stores."""
    n, size = 9, 62_000
    assert n * size > INLINE_CALL_BYTES and size < INLINE_BYTES
    assert inline_limit(n) * n <= INLINE_CALL_BYTES
    runtime.initialize(groups=[DeviceGroup("inline", n, "cpu", cpus_per_worker=0.5)])
    gang = Echo(device_mesh=DeviceMesh.from_sizes(dp_size=n), remote_group="inline")
    out, _ = _inline_call(gang, "blob", size)
    assert [type(v) for v in out.values] == [Held] * n
    assert gang.blob(size) == [b"x" * size] * n  # the caller fetches them from the ranks
    small, _ = _inline_call(gang, "blob", inline_limit(n) - 100)  # within its share: inline
    assert [type(v) for v in small.values] == [Inline] * n
    gang.close()
