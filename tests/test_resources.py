"""What a gang holds, and for how long: a failed gang creation keeps no device claim, and an idle
gang, its LazyResults and its dispatcher's tables hold nothing their callers dropped.
"""

from __future__ import annotations

import gc
import pickle
import threading
import time
import weakref

import numpy as np
import pytest
import ray
from ray.util import state

from conftest import NAMESPACE
from twinkle_ray import DeviceGroup, remote_class, remote_function
from twinkle_ray.runtime.dispatcher import TURN_CALLERS_KEPT
from twinkle_ray.runtime.routed import RECENT_REPLIES


@remote_class()
class Holder:
    def __init__(self, thing=None):
        self.thing = thing

    @remote_function(dispatch="all", collect="none")
    def devices(self) -> list:
        import os

        return [os.environ.get("CUDA_VISIBLE_DEVICES"),
                ray.get_runtime_context().get_assigned_resources()]


@remote_class()
class Boom:
    def __init__(self):
        raise ValueError("no constructor today")


def _full_share(gang) -> None:
    """Each worker of ``gang`` holds its own GPU and a CPU (not the 0 of a leaked claim)."""
    got = gang.devices()()
    visible = [v for v, _ in got]
    assert all(v is not None and len(v.split(",")) == 1 for v in visible), got
    assert len(set(visible)) == len(got), got
    for _, res in got:
        assert res.get("GPU") == 1.0 and res.get("CPU") == 1.0, got


@pytest.mark.slow
def test_unpicklable_constructor_argument_is_named_and_keeps_no_claim(runtime):
    runtime.initialize(groups=[DeviceGroup("dev", 2, "gpu")])
    with pytest.raises(TypeError) as info:
        Holder(thing=threading.Lock(), remote_group="dev")
    msg = str(info.value)
    assert msg.startswith("Holder(remote_group='dev'): argument 'thing' of type lock cannot be "
                          "pickled"), msg
    assert len(msg) < 300, len(msg)
    first = Holder(remote_group="dev")
    _full_share(first)
    first.close()
    again = Holder(remote_group="dev")  # after close() too
    _full_share(again)


@pytest.mark.slow
def test_constructor_that_raises_keeps_no_claim(runtime):
    runtime.initialize(groups=[DeviceGroup("dev", 2, "gpu")])
    with pytest.raises(ValueError, match=r"gang dev/Boom failed to start \(rank \d\): "
                                           r"ValueError: no constructor today"):
        Boom(remote_group="dev")
    _full_share(Holder(remote_group="dev"))


# ------------------------------------------------------------------------- item 7
@remote_class()
class Blob:
    @remote_function(dispatch="all", collect="none")
    def make(self, mib: int) -> bytes:
        return b"x" * (mib << 20)

    @remote_function(dispatch="all", collect="none")
    def size(self, blob) -> int:
        return len(blob)


def _store_bytes() -> int:
    """Bytes of the distinct objects Ray's state API sees referenced in this session."""
    address = ray.get_runtime_context().gcs_address
    rows = state.list_objects(address=address, limit=10_000, raise_on_missing_output=False)
    sizes = {o["object_id"]: o.get("object_size") or 0 for o in rows}
    return sum(v for v in sizes.values() if v > 0)


def _settles_to(limit: int, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        now = _store_bytes()
        if now <= limit or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


@pytest.mark.slow
def test_an_idle_gang_pins_no_output_its_callers_dropped(runtime):
    runtime.initialize(groups=[DeviceGroup("blob", 1, "cpu")])
    g = Blob(remote_group="blob")
    assert g.size(g.make(1))() == 1 << 20  # chained on its own gang: routed, not fetched
    baseline = _settles_to(0, timeout_s=5)
    mib = 24
    for _ in range(RECENT_REPLIES + 1):
        out = g.make(mib)
        assert len(out()) == mib << 20
        del out
    gc.collect()
    left = _settles_to(baseline + (mib << 20) // 2)
    assert left <= baseline + (mib << 20) // 2, (baseline, left)
    assert g.size(g.make(2))() == 2 << 20  # the chain still routes


# ------------------------------------------------------------------------- item 8
@remote_class()
class Count:
    @remote_function(dispatch="all", collect="none")
    def count(self, xs) -> int:
        return len(xs)


@pytest.mark.slow
def test_a_lazy_result_does_not_hold_its_inputs(runtime):
    runtime.initialize(groups=[DeviceGroup("cnt", 2, "cpu")])
    g = Count(remote_group="cnt")
    batch = np.ones(2 << 20)  # 16 MiB
    alive = weakref.ref(batch)
    kept = [g.count(batch) for _ in range(3)]
    assert [r() for r in kept] == [[2 << 20] * 2] * 3
    assert not any(batch is x for r in kept for x in gc.get_referents(r))
    del batch
    gc.collect()
    assert alive() is None  # the LazyResults kept, their input gone


# ------------------------------------------------------------------------- item 9
@remote_class(distributed=False)  # the dispatcher's tables need no torch.distributed
class Nop:
    @remote_function(dispatch="all", collect="none")
    def nop(self) -> None:
        return None

    @remote_function(dispatch="all", collect="none")
    def through(self, other, k: int) -> int:
        for _ in range(k):  # each rank's copy of ``other`` is a caller of its own
            other.nop()()
        return k


def _stats(label: str) -> dict:
    return ray.get(ray.get_actor(label, namespace=NAMESPACE).stats.remote())


@pytest.mark.slow
def test_dispatcher_tables_stay_bounded_however_many_callers(runtime):
    runtime.initialize(groups=[DeviceGroup("smp", 2, "cpu"), DeviceGroup("trn", 2, "cpu")])
    sampler, trainer = Nop(remote_group="smp"), Nop(remote_group="trn")
    assert sampler.nop()() == [None, None]  # the driver's proxy: a caller, dropped later

    def phase(n: int) -> None:
        for _ in range(4):  # 2 callers each: a copy per trainer rank, called from the worker
            assert trainer.through(sampler, 2)() == [2, 2]
        copies = [pickle.loads(pickle.dumps(sampler)) for _ in range(n)]  # a caller each
        outs = [c.nop() for c in copies for _ in range(2)]
        assert [o() for o in outs] == [[None, None]] * (2 * n)

    n = TURN_CALLERS_KEPT + 100  # each phase sees more callers than are kept
    phase(n)
    gc.collect()
    first, store = _stats("smp/Nop"), _store_bytes()
    phase(n)
    gc.collect()
    second = _stats("smp/Nop")
    assert first["turns"] <= TURN_CALLERS_KEPT and second["turns"] <= TURN_CALLERS_KEPT, second
    assert second["turn_waiters"] == 0 and second["recent_replies"] <= RECENT_REPLIES, second
    assert second["producers"] <= 1 and second["bound_submitters"] <= 2, second
    assert _settles_to(store + (1 << 20)) <= store + (1 << 20)
    assert first["turns"] == second["turns"] == TURN_CALLERS_KEPT  # flat, not growing with calls
    # the driver's entry was dropped: its next calls still go, in order
    assert [o() for o in [sampler.nop(), sampler.nop()]] == [[None, None]] * 2
