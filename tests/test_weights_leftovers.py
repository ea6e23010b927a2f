"""Weight sync failures found in review: a refused set-up reaches every lane, a failed receiver
frees the source without anybody reading the handle, and ``SyncHandle.get(timeout)`` is bounded
as a whole (small gangs of plain torch modules)."""

from __future__ import annotations

import time

import pytest
import torch

import twinkle_ray
from twinkle_ray import (
    CallTimeoutError,
    DeviceGroup,
    DeviceMesh,
    get_rank,
    remote_class,
    remote_function,
)
from twinkle_ray.weights import WeightSync, WeightSyncMixin

LIMIT_S = 20.0  # fault -> answer, on a loaded 2-core machine; typical is a few seconds
MESH = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")


@remote_class()
class Staged(WeightSyncMixin):
    """A trainer (``lanes=2``: every rank a source of its own half) or a sampler (the whole model)."""

    def __init__(self, device_mesh=None, version: float = 0.0, lanes: int = 1):
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        self.lanes = lanes
        self.fail: set = set()
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(version)

    @remote_function(dispatch="all", collect="none")
    def work(self, seconds: float = 0.0) -> float:
        time.sleep(seconds)
        return float(self.model[1].weight[0, 0])

    @remote_function(dispatch="all")
    def fail_next(self, *what: str, ranks: tuple = (1,)) -> None:
        """Make the receiver operations ``what`` ('join', 'recv') fail on ``ranks``; none clears."""
        self.fail, self.fail_ranks = set(what), tuple(ranks)

    def weight_sync_lane(self):
        if self.lanes == 1:
            return super().weight_sync_lane()
        return get_rank(), self.lanes

    def weight_sync_tensors(self):
        full = super().weight_sync_tensors()
        if self.lanes == 1:
            return full
        return {n: t for n, t in full.items() if n.startswith(f"{get_rank()}.")}

    def weight_sync_fanout(self, op, *args):
        if op in self.fail and get_rank() in self.fail_ranks:
            raise RuntimeError(f"receiver {op} failed on rank {get_rank()}")
        return super().weight_sync_fanout(op, *args)


def _generation(gang) -> int:
    return gang.topology()["generation"]


@pytest.fixture
def gangs(runtime):
    runtime.initialize(groups=[DeviceGroup("trainer", 2, "cpu"), DeviceGroup("sampler", 2, "cpu")])
    return runtime


@pytest.mark.slow
def test_a_refused_set_up_reaches_every_lane(gangs):
    """A receiver failing to join refuses the set-up on every lane: lane 1's source (trainer rank 1)
    leaves the rendezvous at once, the trainer gang is not torn down."""
    trainer = Staged(MESH, 1.0, lanes=2, remote_group="trainer")
    sampler = Staged(MESH, 0.0, remote_group="sampler")
    sampler.fail_next("join")()
    ws = WeightSync(trainer, sampler, timeout_s=120)  # a source left at the gate would wait this long
    gens = _generation(trainer), _generation(sampler)
    with pytest.raises(RuntimeError, match="receiver join failed on rank 1"):
        ws.sync()
    assert trainer.work().get(timeout=LIMIT_S) == [1.0, 1.0]
    assert (_generation(trainer), _generation(sampler)) == gens  # nobody was left inside the sync
    sampler.fail_next()()
    stats = ws.sync()
    assert (stats.lanes, stats.tensors, stats.receivers) == (2, 4, 2)
    assert sampler.work()() == [1.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [(0, 1), (1,)], ids=["every-receiver", "one-receiver"])
def test_a_failed_receiver_frees_the_source_without_get(gangs, ranks):
    """wait=False, receivers failing before they reach the sync: the trainer's next call answers
    within seconds though nobody reads the handle, and neither gang is torn down."""
    trainer = Staged(MESH, 1.0, remote_group="trainer")
    sampler = Staged(MESH, 0.0, remote_group="sampler")
    ws = WeightSync(trainer, sampler, timeout_s=120)
    ws.sync()  # the channel is set up
    gens = _generation(trainer), _generation(sampler)
    sampler.fail_next("recv", ranks=ranks)()
    handle = ws.sync(wait=False)
    assert trainer.work().get(timeout=LIMIT_S) == [1.0, 1.0]  # nobody called handle.get()
    assert sampler.work().get(timeout=LIMIT_S) == [1.0, 1.0]  # the first sync's weights
    assert (_generation(trainer), _generation(sampler)) == gens
    with pytest.raises(RuntimeError, match=f"receiver recv failed on rank {ranks[0]}"):
        twinkle_ray.get(handle)
    sampler.fail_next()()
    assert ws.sync().receivers == 2  # the channel is still usable (or set up again)
    assert sampler.work()() == [1.0, 1.0]


@pytest.mark.slow
def test_a_failed_receiver_at_join_frees_the_source_without_get(gangs):
    """The brief's case: wait=False, the receiver fails at set-up; the trainer's next call answers."""
    trainer = Staged(MESH, 1.0, remote_group="trainer")
    sampler = Staged(MESH, 0.0, remote_group="sampler")
    sampler.fail_next("join")()
    ws = WeightSync(trainer, sampler, timeout_s=120)
    handle = ws.sync(wait=False)
    assert trainer.work().get(timeout=LIMIT_S) == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="receiver join failed on rank 1"):
        twinkle_ray.get(handle)


@pytest.mark.slow
def test_get_timeout_bounds_the_whole_get(gangs):
    """A sync queued behind a long call: get(timeout) raises CallTimeoutError naming the sync by
    then, though one of its calls has not started on any rank yet; the sync itself goes on."""
    trainer = Staged(MESH, 1.0, remote_group="trainer")
    sampler = Staged(MESH, 0.0, remote_group="sampler")
    ws = WeightSync(trainer, sampler, timeout_s=120)
    busy = sampler.work(8.0)
    handle = ws.sync(wait=False)  # the set-up: the source's open() reads the sampler's probe
    with pytest.raises(CallTimeoutError, match=f"weight sync {ws.channel}"):
        handle.get(timeout=1.0)
    assert not busy.done()  # raised while the earlier call still ran: get() did not wait for it
    assert twinkle_ray.get(handle).tensors == 4  # it went on, and finishes
    assert sampler.work()() == [1.0, 1.0]


class _Unplanned:
    """A sync end whose call has not started on any rank (its gang is being rebuilt): asking for its
    plan waits up to the timeout given, then raises as LazyResult.plan does; without one, 3 s."""

    def __init__(self):
        self.asked: list = []
        self.gang = type("G", (), {"group": "sampler", "cls_name": "Staged"})()
        self.method = "weight_sync_recv"

    def reply(self, timeout=None):
        self.asked.append(timeout)
        time.sleep(3.0 if timeout is None else min(timeout, 3.0))
        if timeout is not None and timeout < 3.0:
            raise CallTimeoutError(f"Staged.weight_sync_recv() on group 'sampler': not started on any rank "
                                   f"within {timeout:g}s", [])
        return type("Out", (), {"refs": [], "workers": []})()

    refs = property(lambda self: list(self.reply().refs))
    ranks = property(lambda self: list(self.reply().workers))

    def done(self):
        return False

    def get(self, timeout=None):
        self.reply(timeout)
        return []


def test_get_timeout_bounds_fetching_the_plans():
    from twinkle_ray.weights import SyncHandle

    ws = WeightSync(object(), [object()])
    end = _Unplanned()
    handle = SyncHandle(ws, [("sampler", end)], None, None)
    with pytest.raises(CallTimeoutError, match=f"weight sync {ws.channel}: not finished within 0.5s") as info:
        handle.get(timeout=0.5)
    assert "not started on any rank" in str(info.value)
    assert len(end.asked) == 1 and 0 < end.asked[0] <= 0.5  # the plan was asked for within the bound
