"""No hang, ever: failures inside collectives, lazy flows and weight syncs end in seconds,
and a gang's saved state survives a rebuild.

Each test provokes one fault on a small gloo gang and checks the error text, the
time from fault to error and from fault to the next call (printed; bounded
generously for a loaded 2-core machine), that restart() then works with a fresh
torch.distributed world, and (through the ``runtime`` fixture) that nothing leaks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from twinkle_ray import (
    DeviceGroup,
    DeviceMesh,
    GangStuckError,
    WorkerDiedError,
    get_rank,
    remote_class,
    remote_function,
)
from twinkle_ray.runtime.dist_setup import nccl_env
from twinkle_ray.weights import WeightSync, WeightSyncMixin

LIMIT_S = 20.0  # fault -> error, on a loaded 2-core machine; typical is a few seconds


class _Collective:
    def __init__(self, device_mesh=None):
        import torch

        self.value = torch.zeros(4, dtype=torch.float64)

    @remote_function(dispatch="all", collect="first")
    def allreduce(self) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0])
        dist.all_reduce(t)
        return t.item()

    @remote_function(dispatch="all", collect="first")
    def fail_before_allreduce(self, rank: int) -> float:
        import torch
        import torch.distributed as dist

        if get_rank() == rank:
            raise ValueError(f"shape bug on rank {rank}")
        t = torch.tensor([1.0])
        dist.all_reduce(t)  # blocks: the failing rank never joins
        return t.item()

    @remote_function(dispatch="slice_dp", collect="first")
    def allreduce_items(self, items: list) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(len(items))])
        dist.all_reduce(t)
        return t.item()

    @remote_function(dispatch="all", collect="none")
    def ports(self) -> str:
        return os.environ["MASTER_PORT"]

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    # -- state ---------------------------------------------------------------------------------
    @remote_function(dispatch="all", collect="none")
    def set_value(self, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed + get_rank())
        self.value = torch.randn(4, dtype=torch.float64, generator=g)

    @remote_function(dispatch="all", collect="none")
    def get_value(self):
        return self.value.clone()

    def state_dict(self) -> dict:
        return {"value": self.value.clone(), "rank": get_rank()}

    def load_state_dict(self, state: dict) -> None:
        assert state["rank"] == get_rank(), (state["rank"], get_rank())
        self.value = state["value"].clone()


@remote_class()
class Coll(_Collective):
    pass


@remote_class(max_restarts=2)
class HealingColl(_Collective):
    pass


@remote_class()
class Producer:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="all", collect="flatten")
    def produce(self, n: int, seconds: float) -> list:
        time.sleep(seconds)
        return [get_rank()] * n

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


def _rebuild_item(rank: int) -> Any:
    if os.environ.get("TWINKLE_GROUP") == "c" and rank == 1:
        raise RuntimeError("item 1 cannot be rebuilt in group c")
    return _OnlySomewhere(rank)


class _OnlySomewhere:
    """An output that unpickles everywhere but on rank 1 of group 'c' (a CUDA tensor on a CPU
    rank, a module only some nodes have)."""

    def __init__(self, rank: int):
        self.rank = rank

    def __reduce__(self):
        return _rebuild_item, (self.rank,)


@remote_class()
class RoutesSomewhere:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="all", collect="flatten")
    def produce(self) -> list:
        return [_OnlySomewhere(get_rank())]

    @remote_function(dispatch="all", collect="flatten")
    def raises_on(self, rank: int) -> list:
        if get_rank() == rank:
            raise ValueError(f"no items on rank {rank}")
        return [get_rank()]


@remote_class()
class Consumer:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="slice_dp", collect="flatten")
    def consume(self, items: list) -> list:
        return list(items)


class _Model(WeightSyncMixin):
    def __init__(self, device_mesh=None, fail_load_on: int | None = None):
        import torch

        self.model = torch.nn.Linear(64, 64)
        self.fail_load_on = fail_load_on

    def weight_sync_load(self, items):
        if get_rank() == self.fail_load_on:
            raise RuntimeError(f"cannot load on rank {get_rank()}")
        super().weight_sync_load(items)

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    @remote_function(dispatch="all", collect="first")
    def weight_sum(self) -> float:
        return float(sum(p.double().sum() for p in self.model.state_dict().values()))


@remote_class()
class SyncModel(_Model):
    pass


@remote_class(max_restarts=1)
class HealingSyncModel(_Model):
    pass


def _groups(*names_sizes):
    return [DeviceGroup(n, k, "cpu") for n, k in names_sizes]


# ---------------------------------------------------------------------------- 1. collectives
@pytest.mark.slow
def test_exception_in_collective_tears_down_and_restart_works(runtime):
    runtime.initialize(groups=_groups(("c", 2)))
    g = Coll(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="c")
    old_ports = set(g.ports()())
    assert g.allreduce()() == 2.0
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="shape bug on rank 1") as info:
        g.fail_before_allreduce(1)()
    to_error = time.monotonic() - t0
    assert "Coll.fail_before_allreduce() on rank 1 of group 'c'" in "\n".join(info.value.__notes__)
    with pytest.raises(GangStuckError) as stuck:
        g.allreduce()()  # must not wait on rank 0, which sits in the all_reduce
    to_next = time.monotonic() - t0
    err = stuck.value
    assert (err.group, err.cls, err.rank, err.stuck) == ("c", "Coll", 1, [0])
    assert "ValueError: shape bug on rank 1" in str(err) and "restart()" in str(err)
    assert isinstance(err, WorkerDiedError)
    with pytest.raises(GangStuckError):
        g.allreduce()()  # and the next one, at once
    print(f"\nexception in collective: fault->error {to_error:.2f}s, fault->next call {to_next:.2f}s")
    assert to_error < LIMIT_S and to_next < LIMIT_S
    g.restart()
    assert g.allreduce()() == 2.0
    assert not (set(g.ports()()) & old_ports)  # a fresh torch.distributed world


@pytest.mark.slow
def test_a_rank_whose_routed_input_fails_is_seen_like_any_failed_rank(runtime):
    """Rank 1 cannot have its routed input; rank 0 goes on into the all_reduce. Rank 1's
    failure happens inside its call, so the dispatcher sees it: the error names the producer,
    and the next call meets GangStuckError at once, never pairing its collective with rank 0's
    stuck one (a wrong value)."""
    runtime.initialize(groups=_groups(("p", 2), ("c", 2)))
    producer = RoutesSomewhere(remote_group="p")
    g = Coll(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="c")
    assert g.allreduce()() == 2.0
    t0 = time.monotonic()
    with pytest.raises(TypeError, match="cannot be rebuilt") as info:
        g.allreduce_items(producer.produce())()
    assert "an output of RoutesSomewhere.produce() on group 'p' cannot be unpickled" in str(
        info.value)
    assert "Coll.allreduce_items() on rank 1 of group 'c'" in "\n".join(info.value.__notes__)
    with pytest.raises(GangStuckError) as stuck:
        g.allreduce()()
    assert (stuck.value.rank, stuck.value.stuck) == (1, [0])
    assert time.monotonic() - t0 < LIMIT_S
    g.restart()
    assert g.allreduce()() == 2.0
    assert g.allreduce()() == 2.0


def test_a_producers_error_fails_every_consumer_rank_alike_before_any_runs(runtime):
    """A routed input's records reach every rank resolved by Ray, before the method
    (runtime.routed): a producer rank that raised fails every consumer rank alike, unrun. The
    error is the producer's, named as such; no rank is left in the all_reduce, so the next
    call runs at once, on the same gang (no GangStuckError, no rebuild)."""
    runtime.initialize(groups=_groups(("p", 2), ("c", 2)))
    producer = RoutesSomewhere(remote_group="p")
    g = Coll(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="c")
    pids = g.pid()()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="no items on rank 1") as info:
        g.allreduce_items(producer.raises_on(1))()
    notes = "\n".join(info.value.__notes__)
    assert "raised in RoutesSomewhere.raises_on() on rank 1 of group 'p'" in notes, notes
    assert "an input of Coll.allreduce_items() on group 'c'" in notes, notes
    assert "Coll.allreduce_items() on rank" not in notes, notes  # no consumer rank raised it
    assert g.allreduce()() == 2.0
    assert time.monotonic() - t0 < LIMIT_S
    assert g.pid()() == pids and g.topology()["restarts"] == 0


@pytest.mark.slow  # 7-20 s each (gang rebuilds); the quick tier keeps the stuck-rank path
def test_exception_in_collective_rebuilds_with_max_restarts(runtime):
    runtime.initialize(groups=_groups(("h", 2)))
    g = HealingColl(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="h")
    pids = set(g.pid()())
    t0 = time.monotonic()
    with pytest.raises(ValueError):
        g.fail_before_allreduce(0)()
    assert g.allreduce()() == 2.0  # runs on the rebuilt gang
    took = time.monotonic() - t0
    print(f"\nexception in collective, max_restarts: fault->next call answered {took:.2f}s")
    assert took < LIMIT_S + 30  # grace + a gang start-up on 2 busy cores
    assert not (set(g.pid()()) & pids)
    assert g.topology()["restarts"] == 1


@pytest.mark.slow  # 7-20 s each (gang rebuilds); the quick tier keeps the stuck-rank path
def test_exception_without_collective_keeps_the_gang(runtime):
    runtime.initialize(groups=_groups(("k", 2)))
    g = Coll(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="k")
    pids = g.pid()()
    with pytest.raises(TypeError):
        g.set_value("not an int")()  # every rank fails the same way: nobody is stuck
    time.sleep(3.5)  # past the grace period
    assert g.allreduce()() == 2.0
    assert g.pid()() == pids and g.topology()["restarts"] == 0


# ---------------------------------------------------------------------------- 3. lazy flows
@pytest.mark.slow  # 7-20 s each (gang rebuilds); the quick tier keeps the stuck-rank path
def test_producer_death_names_the_producer(runtime):
    runtime.initialize(groups=_groups(("p", 2), ("q", 2)))
    prod = Producer(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="p")
    cons = Consumer(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="q")
    pids = prod.pid()()
    assert cons.consume(prod.produce(2, 0.0))() == [0, 0, 1, 1]
    out = cons.consume(prod.produce(2, 30.0))  # the consumer call is made while producing
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as info:
        out.get()
    took = time.monotonic() - t0
    err = info.value
    print(f"\nproducer death -> consumer error: {took:.2f}s ({err})")
    assert (err.group, err.cls, err.rank) == ("p", "Producer", 1)
    assert took < LIMIT_S
    cons.consume([5, 6])()  # the consumer gang itself is fine (or rebuilt) afterwards


# ---------------------------------------------------------------------------- 4. NCCL
def test_nccl_env_from_dist_timeout():
    env = nccl_env(300)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "600"
    assert nccl_env(5)["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "60"


@remote_class()
class EnvReader:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="all", collect="none")
    def env(self, keys: list) -> dict:
        return {k: os.environ.get(k) for k in keys}


@pytest.mark.slow
def test_gpu_gang_workers_get_nccl_error_handling(runtime):
    runtime.initialize(groups=[DeviceGroup("gpu2", 2, "cuda")])  # virtual GPUs here: gloo
    g = EnvReader(remote_group="gpu2")
    keys = sorted(nccl_env(120))
    got = g.env(keys)()
    assert got == [nccl_env(120)] * 2  # the runtime's dist_timeout_s is 120 s


# ---------------------------------------------------------------------------- 5. state
def _values(g) -> list:
    return [v.numpy().tobytes() for v in g.get_value()()]


@pytest.mark.slow  # 7-20 s each (gang rebuilds); the quick tier keeps the stuck-rank path
def test_saved_state_is_restored_bit_equal_after_automatic_rebuild(runtime):
    runtime.initialize(groups=_groups(("s", 2)))
    g = HealingColl(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="s")
    g.set_value(7)()
    saved = _values(g)
    assert saved[0] != saved[1]
    g.save_state()
    assert g.topology()["saved_state"]
    g.set_value(99)()  # changes after the save are lost by a rebuild
    pids = g.pid()()
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # the next call after the death waits for the rebuild (and the restore)
        try:
            values = _values(g)
            break
        except WorkerDiedError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert values == saved  # bit-equal, rank by rank
    assert not (set(g.pid()()) & set(pids))


@pytest.mark.slow  # 7-20 s each (gang rebuilds); the quick tier keeps the stuck-rank path
def test_saved_state_on_disk_is_restored_by_manual_restart(runtime, tmp_path):
    runtime.initialize(groups=_groups(("d", 2)))
    g = Coll(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="d")
    g.set_value(3)()
    saved = _values(g)
    g.save_state(path=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["rank0.pt", "rank1.pt"]
    g.set_value(4)()
    g.restart()
    assert _values(g) == saved


@pytest.mark.slow  # 7-20 s each (gang rebuilds); the quick tier keeps the stuck-rank path
def test_save_state_without_state_dict_names_the_class(runtime):
    runtime.initialize(groups=_groups(("n", 2)))
    g = Consumer(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="n")
    with pytest.raises(TypeError, match=r"Consumer has no state_dict\(\)"):
        g.save_state()


# ---------------------------------------------------------------------------- 2. weight sync
def _sync_pair(runtime, fail_load_on=None):
    runtime.initialize(groups=_groups(("tr", 2), ("sa", 2)))
    trainer = SyncModel(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="tr")
    sampler = SyncModel(device_mesh=DeviceMesh.from_sizes(dp_size=2), fail_load_on=fail_load_on,
                        remote_group="sa")
    ws = WeightSync(trainer, sampler, timeout_s=120)
    return trainer, sampler, ws


@pytest.mark.slow  # 7-20 s each (gang rebuilds); the quick tier keeps the stuck-rank path
def test_sync_exception_on_sampler_ends_both_sides(runtime):
    trainer, sampler, ws = _sync_pair(runtime, fail_load_on=1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot load on rank 1") as info:
        ws.sync()
    took = time.monotonic() - t0
    assert "rank 1 of group 'sa'" in "\n".join(getattr(info.value, "__notes__", []))
    print(f"\nsync, exception on a sampler rank: error after {took:.2f}s")
    assert took < LIMIT_S
    assert trainer.weight_sum().get(timeout=LIMIT_S) is not None  # the trainer is usable


@pytest.mark.slow  # 7-20 s each (gang rebuilds); the quick tier keeps the stuck-rank path
def test_sampler_killed_during_sync_ends_both_sides_and_restart_syncs(runtime):
    trainer, sampler, ws = _sync_pair(runtime)
    ws.sync()  # channel set up and used once
    pids = sampler.pid()()
    killer = threading.Timer(0.05, os.kill, (pids[1], signal.SIGKILL))
    # One 64x64 sync is short: sync again and again until the kill lands in one.
    t0 = time.monotonic()
    killer.start()
    with pytest.raises(WorkerDiedError) as info:
        for _ in range(200):
            ws.sync()
    took = time.monotonic() - t0
    print(f"\nsampler killed during sync: error after {took:.2f}s ({type(info.value).__name__})")
    assert took < LIMIT_S + 5
    for g in (trainer, sampler):  # both sides are either idle or torn down: nothing blocked
        try:
            g.weight_sum().get(timeout=LIMIT_S)
        except WorkerDiedError:
            g.restart()
    stats = ws.sync()  # a fresh channel after the restart
    assert stats.receivers == 2
    assert sampler.weight_sum()() == trainer.weight_sum()()


@pytest.mark.slow
def test_async_sync_after_a_dispatcher_respawn_sets_up_a_fresh_channel(runtime):
    """A respawned dispatcher rebuilds its gang from generation 1 again, as the first one did:
    the sync must still see a new gang (with no channel), not the one it set up. Before, an
    async sync went out on the old channel: the sampler's new workers had none, and the
    trainer, left inside the broadcast, was torn down as stuck."""
    import ray

    from conftest import NAMESPACE
    from twinkle_ray import get

    runtime.initialize(groups=_groups(("tr", 2), ("sa", 2)))
    trainer = SyncModel(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="tr")
    sampler = HealingSyncModel(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="sa")
    ws = WeightSync(trainer, sampler, timeout_s=60)
    assert ws.sync().receivers == 2
    old = sampler.topology()
    ray.kill(ray.get_actor(old["label"], namespace=NAMESPACE), no_restart=True)
    with pytest.raises(WorkerDiedError, match="dispatcher"):
        sampler.pid()()
    sampler.pid()()  # the creator's proxy respawns the dispatcher and the gang
    new = sampler.topology()
    assert new["generation"] == old["generation"]  # what hid the rebuild from the sync
    trainer_pids = trainer.pid()()
    stats = get(ws.sync(wait=False), timeout=120)
    assert stats.receivers == 2
    assert sampler.weight_sum()() == trainer.weight_sum()()
    assert trainer.pid()() == trainer_pids  # the trainer was never torn down
