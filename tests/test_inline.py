"""Eager calls get their values in the dispatcher's reply (issue 28: small eager results come
back without an extra ownership round trip), and payload still never passes through it."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import ray
from ray.util import state

from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.runtime.inline import Held, hold_large, unhold


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


def test_hold_large_and_unhold_without_a_gang(ray_session):
    small = {"x": np.zeros(4, dtype=np.float32)}
    assert hold_large(small) is small
    big = np.arange(65536, dtype=np.float32)  # 256 KB: over the 64 KB put threshold
    held = hold_large(big)
    assert isinstance(held, Held)
    got = unhold([1, held, None])
    assert got[0] == 1 and got[2] is None and np.array_equal(got[1], big)


def test_eager_results_come_back_inline_and_payload_stays_off_the_dispatcher(runtime, tmp_path):
    runtime.initialize(groups=[DeviceGroup("inline", 4, "cpu")])
    gang = Echo(device_mesh=DeviceMesh.from_sizes(dp_size=4), remote_group="inline")
    assert gang.double([1, 2, 3, 4, 5, 6, 7, 8]) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert gang.rank() == 1.5
    dispatcher = _dispatcher_pid(gang)

    small_dir = tmp_path / "small"
    small_dir.mkdir()
    out = gang.traced(str(small_dir), 4)
    assert [float(o["x"].sum()) for o in out] == [4.0] * 4
    # A small result rides in the dispatcher's reply: the dispatcher unpickled it.
    assert dispatcher in _pids(small_dir) and os.getpid() in _pids(small_dir)

    big_dir = tmp_path / "big"
    big_dir.mkdir()
    out = gang.traced(str(big_dir), 65536)
    assert [float(o["x"].sum()) for o in out] == [65536.0] * 4
    # A large one stays in its worker's store until the caller fetches it from there.
    assert os.getpid() in _pids(big_dir)
    assert dispatcher not in _pids(big_dir), "a large eager result passed through the dispatcher"
    gang.close()


def test_an_eager_call_that_raises_names_the_rank(runtime):
    runtime.initialize(groups=[DeviceGroup("inline", 2, "cpu")])
    gang = Echo(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="inline")
    with pytest.raises(ValueError, match="rank one says no") as info:
        gang.refuse()
    assert "raised in Echo.refuse() on rank 1 of group 'inline'" in "\n".join(info.value.__notes__)
    assert gang.double([1, 2]) == [2, 4]  # the gang goes on
    gang.close()
