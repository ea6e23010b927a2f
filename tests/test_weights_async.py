"""Weight sync with ``wait=False``: its place in both gangs' call order, and its failures.

A sync made with ``wait=False`` returns a handle at once and runs after the calls already made
on each gang, before the later ones. Failures end it on both sides within seconds and hurt only
what failed: a source whose ``weight_sync_tensors()`` raises tells the receivers (the sampler
stays up), a receiver that fails to join at set-up ends the source's wait, and a death on either
side ends the sync on the other.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import twinkle_ray
from twinkle_ray import (
    DeviceGroup,
    DeviceMesh,
    WorkerDiedError,
    get_rank,
    remote_class,
    remote_function,
)
from twinkle_ray.weights import SyncHandle, WeightSync, WeightSyncMixin, sync_weights

LIMIT_S = 20.0  # fault -> error, on a loaded 2-core machine; typical is a few seconds
MESH = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")


@remote_class()
class Policy(WeightSyncMixin):
    """A trainer or a sampler whose weights all equal its policy version."""

    def __init__(self, device_mesh=None, version: float = 0.0):
        self.model = torch.nn.Linear(8, 8)
        self.fail: dict = {}
        self._fill(version)

    def _fill(self, version: float) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(version)

    @remote_function(dispatch="all")
    def set_version(self, version: float) -> None:
        self._fill(version)

    @remote_function(dispatch="all", collect="none")
    def work(self, seconds: float = 0.0) -> float:
        """A generate or a train step: sleeps, then says which version its weights are."""
        time.sleep(seconds)
        return float(self.model.weight[0, 0])

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    @remote_function(dispatch="all")
    def fail_next(self, what: str | None, rank: int | None = None) -> None:
        """Make ``what`` ('tensors' or 'join') fail on ``rank`` (None: every rank); None clears."""
        self.fail = {} if what is None else {what: rank}

    def _fails(self, what: str) -> bool:
        return what in self.fail and self.fail[what] in (None, get_rank())

    def weight_sync_tensors(self):
        if self._fails("tensors"):
            raise ValueError("no tensors today")
        return super().weight_sync_tensors()

    def weight_sync_fanout(self, op, *args):
        if op == "join" and self._fails("join"):
            raise RuntimeError(f"engine refused to join on rank {get_rank()}")
        return super().weight_sync_fanout(op, *args)


@pytest.fixture
def pair(runtime):
    runtime.initialize(groups=[DeviceGroup("trainer", 2, "cpu"), DeviceGroup("sampler", 2, "cpu")])
    trainer = Policy(MESH, 1.0, remote_group="trainer")
    sampler = Policy(MESH, 0.0, remote_group="sampler")
    return trainer, sampler


def _generation(gang) -> int:
    return gang.topology()["generation"]


def _sync(ws: WeightSync, wait: bool):
    return ws.sync() if wait else twinkle_ray.get(ws.sync(wait=False))


# ------------------------------------------------------------------------------ order
@pytest.mark.slow
def test_wait_false_takes_its_place_in_both_gangs_orders(pair):
    trainer, sampler = pair
    # The first sync sets the channel up, also without waiting: the sampler is busy for 2 s.
    before = sampler.work(2.0)
    start = time.monotonic()
    handle = sync_weights(trainer, sampler, wait=False)
    assert isinstance(handle, SyncHandle) and not handle.done() and not before.done()
    after = sampler.work()
    trainer.set_version(2.0)  # made after the sync: not part of it
    assert time.monotonic() - start < 1.5  # nothing above waited for the 2 s call
    assert twinkle_ray.get(before) == [0.0, 0.0]  # made before the sync: the old weights
    assert twinkle_ray.get(handle).tensors == 2
    assert twinkle_ray.get(after) == [1.0, 1.0]  # made after it: the new ones

    # An established channel, both gangs busy: the trainer trains while the sampler generates.
    training, generating = trainer.work(1.0), sampler.work(1.0)
    handle = sync_weights(trainer, sampler, wait=False)
    trainer.set_version(3.0)
    after = sampler.work()
    assert twinkle_ray.get([training, generating]) == [[2.0, 2.0], [1.0, 1.0]]
    stats = twinkle_ray.get(handle)
    assert stats.receivers == 2 and stats.tensors == 2
    assert twinkle_ray.get(after) == [2.0, 2.0]
    assert handle.done() and twinkle_ray.get(handle) is stats


# ------------------------------------------------------------------------------ failures
@pytest.mark.slow
@pytest.mark.parametrize("wait", [True, False])
def test_source_error_before_sending_leaves_the_sampler_working(pair, wait):
    trainer, sampler = pair
    ws = WeightSync(trainer, sampler, timeout_s=60)
    _sync(ws, wait)
    gens = _generation(trainer), _generation(sampler)
    trainer.fail_next("tensors", 0)()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="no tensors today") as info:
        _sync(ws, wait)
    assert "rank 0 of group 'trainer'" in "\n".join(info.value.__notes__)
    assert sampler.work().get(timeout=LIMIT_S) == [1.0, 1.0]  # answered at once, no GangStuckError
    assert time.monotonic() - t0 < LIMIT_S
    assert (_generation(trainer), _generation(sampler)) == gens  # neither gang was torn down
    trainer.fail_next(None)()
    trainer.set_version(4.0)()
    assert _sync(ws, wait).tensors == 2  # the channel is still in step
    assert sampler.work()() == [4.0, 4.0]


@pytest.mark.slow
@pytest.mark.parametrize("wait", [True, False])
def test_receiver_failing_to_join_ends_the_source_wait(pair, wait):
    trainer, sampler = pair
    sampler.fail_next("join", 1)()
    ws = WeightSync(trainer, sampler, timeout_s=120)  # the source would wait this long
    gens = _generation(trainer), _generation(sampler)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="engine refused to join on rank 1"):
        _sync(ws, wait)
    assert trainer.work().get(timeout=LIMIT_S) == [1.0, 1.0]  # its rank 0 left the rendezvous
    assert sampler.work().get(timeout=LIMIT_S) == [0.0, 0.0]
    assert time.monotonic() - t0 < LIMIT_S
    assert (_generation(trainer), _generation(sampler)) == gens
    sampler.fail_next(None)()
    assert _sync(ws, wait).receivers == 2  # set up again, this time whole
    assert sampler.work()() == [1.0, 1.0]


@pytest.mark.slow  # a gang rebuild: 10-20 s on 2 busy cores
@pytest.mark.parametrize("side", ["sampler", "trainer"])
def test_death_during_a_wait_false_sync_ends_it_on_both_sides(pair, side):
    trainer, sampler = pair
    ws = WeightSync(trainer, sampler, timeout_s=120)
    ws.sync()
    victim, other = (sampler, trainer) if side == "sampler" else (trainer, sampler)
    gen_other = _generation(other)
    pid = victim.pid()()[1]
    victim.work(30.0)  # the victim's side reaches the sync only after this: the other one waits in it
    handle = ws.sync(wait=False)
    after = other.work()  # queued behind the sync on the healthy side
    time.sleep(1.0)
    assert not handle.done()
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as info:
        twinkle_ray.get(handle)
    took = time.monotonic() - t0
    assert info.value.group == side
    assert twinkle_ray.get(after, LIMIT_S) is not None  # the healthy side left the sync
    print(f"\n{side} killed while the other side waited in a wait=False sync: error after {took:.2f}s")
    assert took < LIMIT_S
    assert _generation(other) == gen_other  # not torn down: it only waited
    with pytest.raises(WorkerDiedError):
        victim.work()()
    victim.restart()
    trainer.set_version(5.0)()
    assert twinkle_ray.get(ws.sync(wait=False)).receivers == 2  # a fresh channel after the restart
    assert sampler.work()() == [5.0, 5.0]


def test_sync_handle_of_local_objects():
    class Box(WeightSyncMixin):
        def __init__(self, value):
            self.model = torch.nn.Linear(2, 2)
            with torch.no_grad():
                self.model.weight.fill_(value)

    a, b = Box(1.0), Box(0.0)
    handle = sync_weights(a, b, wait=False)
    assert handle.done() and twinkle_ray.get(handle).tensors == 2
    assert bool((b.model.weight == 1.0).all())
