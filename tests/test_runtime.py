"""Ray mode end to end: pinning, gang env, torch.distributed, routing, lazy flow, collect modes.

One runtime for the module (gang start-up costs seconds on 2 cores): group
'a' (4 virtual GPUs, dp=4) and group 'b' (4 virtual GPUs, dp=2 x tp=2).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import ray

from conftest import leftovers, live_actors
from twinkle_ray import (
    DeviceGroup,
    DeviceMesh,
    LazyResult,
    get,
    get_device_placement,
    get_rank,
    remote_class,
    remote_function,
)


def record_unpickle(value, where: str):
    """Unpickling a Payload calls this: it notes the pid of the process that unpickled it."""
    with open(os.path.join(where, str(os.getpid())), "a") as f:
        f.write(f"{value}\n")
    return Payload(value, where)


class Payload:
    """A payload item that records, on disk, every process that deserialises it."""

    def __init__(self, value: int, where: str, pad: int = 0):
        self.value, self.where = value, where
        self.pad = b"x" * pad

    def __reduce__(self):
        return (record_unpickle, (self.value, self.where))


def by_data_rank(xs, mesh):
    return xs


@remote_class()
class Probe:
    def __init__(self, device_mesh: DeviceMesh):
        import torch

        torch.set_grad_enabled(False)  # thread-local: calls must run under it too
        self.mesh = device_mesh

    @remote_function(dispatch="all", collect="none")
    def grad_enabled(self) -> bool:
        import torch

        return torch.is_grad_enabled()

    @remote_function(dispatch="all", collect="none")
    def env(self) -> dict:
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "TWINKLE_GROUP", "TWINKLE_WORKER"]
        return {k: os.environ.get(k) for k in keys} | {"pid": os.getpid(), "get_rank": get_rank()}

    @remote_function(dispatch="all", collect="first")
    def allreduce(self) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    @remote_function(dispatch="all", collect="none")
    def torch_groups(self) -> dict:
        import torch.distributed as dist

        tm = self.mesh.to_torch()
        return {d: dist.get_process_group_ranks(tm.get_group(d)) for d in self.mesh.mesh_dim_names}

    @remote_function(dispatch="slice_dp", collect="none")
    def received(self, batch):
        if isinstance(batch, dict):
            return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in batch.items()}
        return batch.tolist() if hasattr(batch, "tolist") else list(batch)

    @remote_function(dispatch="slice_dp", collect="flatten")
    def produce(self, ids: list, where: str, pad: int = 0) -> list:
        return [Payload(i, where, pad) for i in ids]

    @remote_function(dispatch="slice_dp", collect="none")
    def consume(self, items: list) -> list:
        return [p.value for p in items]

    @remote_function(dispatch="slice_dp", collect="flatten")
    def double(self, xs):
        return [2 * x for x in xs]

    @remote_function(dispatch="slice_dp", collect="flatten")
    def grow(self, xs):
        return list(xs) * (get_rank() + 1)  # uneven lengths across ranks

    @remote_function(dispatch="slice_dp", collect="flatten")
    def add(self, xs, ys):
        return [x + y for x, y in zip(xs, ys, strict=True)]

    @remote_function(dispatch="all", collect="mean")
    def metric(self, scale: float = 1.0) -> dict:
        r = get_rank()
        return {"loss": scale * r, "acc": np.array([r, 2 * r], dtype=float)}

    @remote_function(dispatch="all", collect="sum")
    def count(self) -> int:
        return get_rank() + 1

    @remote_function(dispatch="all", collect="first")
    def rank_first(self) -> int:
        return get_rank()

    @remote_function(dispatch="all", collect=lambda results, mesh: sorted(results, reverse=True))
    def custom(self) -> int:
        return get_rank()

    @remote_function(dispatch="all", collect="none")
    def pair(self) -> tuple:
        return get_rank(), [get_rank()]

    @remote_function(dispatch="all", collect="flatten")
    def pairs(self) -> tuple:
        return [get_rank()], get_rank() * 10

    @remote_function(dispatch="all", execute="first", collect="none")
    def only_first(self) -> int:
        return get_rank()

    @remote_function(dispatch="all", collect="none", execute="peer")
    def whoami(self) -> int:
        return get_rank()

    @remote_function(dispatch="all", collect="none")
    def ask_peer(self, other) -> list:
        return get(other.whoami())

    @remote_function(dispatch="slice", collect="flatten", execute="peer")
    def echo_slice(self, xs: list) -> list:
        return list(xs)

    @remote_function(dispatch="slice_dp", collect="flatten", execute="peer")
    def echo_slice_dp(self, xs: list) -> list:
        return list(xs)

    @remote_function(dispatch="all", collect="none")
    def ask_peer_items(self, other, mode: str) -> list:
        mine = [get_rank() * 10 + k for k in range(4)]
        return get(getattr(other, f"echo_{mode}")(mine))

    @remote_function(dispatch="all", collect="first", sync=True)
    def sync_rank(self) -> int:
        return get_rank()

    @remote_function(dispatch="all", collect="first", lazy_collect=False)
    def eager_rank(self) -> int:
        return get_rank()

    @remote_function(dispatch=lambda n, i, args, kwargs, mesh: ((args[0][i::n],), {}), collect="none")
    def strided(self, xs):
        return list(xs)


@remote_class(execute="first")
class Loader:
    def __init__(self, n: int, batch: int):
        self.n, self.batch, self.pos = n, batch, 0

    def __iter__(self):
        self.pos = 0
        return self

    def __next__(self):
        if self.pos >= self.n:
            raise StopIteration
        out = list(range(self.pos, min(self.n, self.pos + self.batch)))
        self.pos += self.batch
        return out


@pytest.fixture(scope="module")
def gangs(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("a", 4, "cuda"), DeviceGroup("b", 4, "cuda")])
    with twinkle_ray.start_together():  # both gangs start up at once: the module's set-up is shorter
        a = Probe(device_mesh=DeviceMesh.from_sizes(dp_size=4), remote_group="a")
        b = Probe(device_mesh=DeviceMesh.from_sizes(dp_size=2, tp_size=2), remote_group="b")
    yield a, b
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


@pytest.mark.slow
def test_pinning_distinct_devices_and_disjoint_groups(gangs):
    a, b = gangs
    env_a, env_b = a.env()(), b.env()()
    devs_a = [e["CUDA_VISIBLE_DEVICES"] for e in env_a]
    devs_b = [e["CUDA_VISIBLE_DEVICES"] for e in env_b]
    for d in devs_a + devs_b:
        assert d is not None and "," not in d  # one device each
    assert len(set(devs_a + devs_b)) == 8  # all distinct, so the groups are disjoint
    # ranks follow device order on one node
    assert [int(d) for d in devs_a] == sorted(int(d) for d in devs_a)


def test_gang_environment(gangs):
    a, _ = gangs
    env = a.env()()
    assert [e["RANK"] for e in env] == ["0", "1", "2", "3"]
    assert [e["get_rank"] for e in env] == [0, 1, 2, 3]
    assert {e["WORLD_SIZE"] for e in env} == {"4"}
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1", "2", "3"]
    assert {e["LOCAL_WORLD_SIZE"] for e in env} == {"4"} and {e["NODE_RANK"] for e in env} == {"0"}
    assert {e["MASTER_ADDR"] for e in env} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in env}) == 1 and env[0]["MASTER_PORT"].isdigit()
    assert [e["TWINKLE_WORKER"] for e in env] == [f"a/Probe/{r}" for r in range(4)]
    assert len({e["pid"] for e in env}) == 4


def test_actor_names_read_well_in_dashboard(gangs):
    names = {a["name"] for a in live_actors()}
    assert {"a/Probe", "b/Probe", "a/Probe/0", "a/Probe/3", "b/Probe/2"} <= names


def test_lookup_by_name_from_anywhere(gangs):
    from conftest import NAMESPACE
    from twinkle_ray.runtime.proxy import GangProxy

    found = GangProxy.lookup("b/Probe", namespace=NAMESPACE)
    assert found.received([1, 2])() == [[1]] * 2 + [[2]] * 2  # same mesh routing as the original


def test_gloo_all_reduce(gangs):
    a, b = gangs
    assert a.allreduce()() == 1 + 2 + 3 + 4
    assert b.allreduce()() == 10


def test_to_torch_groups_match_mesh(gangs):
    _, b = gangs
    groups = b.torch_groups()()
    # from_sizes(dp=2, tp=2): dims (dp, tp), mesh [[0, 1], [2, 3]]
    assert [g["dp"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["tp"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_slice_dp_routing_by_data_rank(gangs):
    _, b = gangs
    assert b.received(list(range(10)))() == [[0, 1, 2, 3, 4]] * 2 + [[5, 6, 7, 8, 9]] * 2
    arr = b.received(np.arange(6))()
    assert arr == [[0, 1, 2]] * 2 + [[3, 4, 5]] * 2
    import torch

    assert b.received(torch.arange(4))() == [[0, 1]] * 2 + [[2, 3]] * 2
    d = b.received({"x": list(range(4)), "scale": 3})()
    assert d == [{"x": [0, 1], "scale": 3}] * 2 + [{"x": [2, 3], "scale": 3}] * 2


def test_large_batch_is_split_not_replicated(gangs):
    a, _ = gangs
    big = np.arange(400_000)  # 3.2 MB: put once, each worker gets its quarter
    parts = a.received(big)()
    assert [len(p) for p in parts] == [100_000] * 4
    assert parts[3][-1] == 399_999


def test_group_to_group_flow_never_unpickles_in_driver_or_dispatcher(gangs, tmp_path):
    a, b = gangs
    where = str(tmp_path)
    produced = a.produce(list(range(12)), where, pad=40_000)  # 4 x 3 items, ~120 KB per rank
    assert isinstance(produced, LazyResult)
    got = b.consume(produced)()
    assert got == [[0, 1, 2, 3, 4, 5]] * 2 + [[6, 7, 8, 9, 10, 11]] * 2
    pids = {int(p) for p in os.listdir(where)}
    dispatchers = {a_["pid"] for a_ in live_actors() if a_.get("name") in ("a/Probe", "b/Probe")}
    consumers = {e["pid"] for e in b.env()()}
    assert len(dispatchers) == 2
    assert os.getpid() not in pids
    assert not (pids & dispatchers)
    assert pids <= consumers


def test_lazy_chain_same_and_other_gang(gangs):
    a, b = gangs
    x = a.double(list(range(8)))
    for _ in range(3):
        x = a.double(x)
    assert x() == [16 * i for i in range(8)]
    # flatten keeps worker order; tp peers (ranks 0,1 and 2,3) both answer
    assert b.double(a.double([1, 2, 3, 4]))() == [4, 8, 4, 8, 12, 16, 12, 16]


def test_aligned_chain_with_uneven_lengths_pulls_other_ranks(gangs):
    a, _ = gangs
    # rank i returns [i] * (i + 1): 10 items, so the next call's windows are 3, 3, 2, 2 and
    # cross ranks (the routed marker's refs are fetched in the worker only in this case)
    assert a.double(a.grow([0, 1, 2, 3]))() == [0, 2, 2, 4, 4, 4, 6, 6, 6, 6]


def test_same_lazy_value_twice_in_one_call(gangs):
    a, _ = gangs
    x = a.double(list(range(8)))
    assert a.add(x, x)() == [4 * i for i in range(8)]
    assert a.add(x, ys=x)() == [4 * i for i in range(8)]


def test_chained_value_older_than_the_dispatchers_recent_plans(gangs):
    a, b = gangs
    x = a.double(list(range(8)))
    for _ in range(12):  # more calls than the dispatcher keeps plans of
        a.count()
    assert a.double(x)() == [4 * i for i in range(8)]
    lo, hi = [4 * i for i in range(4)], [4 * i for i in range(4, 8)]
    assert b.double(x)() == lo + lo + hi + hi  # another gang (tp peers both answer)


def test_lazy_result_protocol(gangs):
    a, _ = gangs
    out = a.double([1, 2, 3, 4])
    assert isinstance(out, LazyResult)
    assert len(out.refs) == 4 and out.ranks == [0, 1, 2, 3]
    assert all(isinstance(r, ray.ObjectRef) for r in out.refs) and ray.get(out.refs) == [[2], [4], [6], [8]]
    assert len(out) == 4 and list(out) == [2, 4, 6, 8] and out.get() == out()
    assert get(out) == [2, 4, 6, 8] and get(5) == 5
    assert "double" in repr(out)


def test_collect_modes_on_a_real_gang(gangs):
    a, _ = gangs
    m = a.metric(2.0)()
    assert m["loss"] == pytest.approx(2.0 * 1.5)
    assert m["acc"].tolist() == [1.5, 3.0]
    assert a.count()() == 10
    assert a.rank_first()() == 0
    assert a.custom()() == [3, 2, 1, 0]
    # tuples are collected element-wise, for 'none' too
    assert a.pair()() == ([0, 1, 2, 3], [[0], [1], [2], [3]])
    assert a.pairs()() == ([0, 1, 2, 3], [0, 10, 20, 30])  # tuples collected element-wise
    assert a.double([1, 2, 3, 4, 5])() == [2, 4, 6, 8, 10]  # flatten


def test_execute_first_and_sync_flags(gangs):
    a, _ = gangs
    assert a.only_first()() == 0
    assert a.sync_rank() == 0  # sync=True returns the value
    assert a.eager_rank() == 0  # lazy_collect=False too


def test_callable_dispatch(gangs):
    a, _ = gangs
    assert a.strided(list(range(8)))() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_callable_dispatch_of_a_routed_value_sees_the_value(gangs):
    """A dispatch function gets what fetching and passing the LazyResult would give it: each
    rank applies it to the value (in the caller it would see the LazyResult)."""
    a, _ = gangs
    out = a.double(list(range(8)))
    assert a.strided(out)() == a.strided(out())() == [[0, 8], [2, 10], [4, 12], [6, 14]]


def test_execute_peer_from_another_gang(gangs):
    a, b = gangs
    # worker r of gang a (dp=4) calls gang b (dp=2 x tp=2) with execute='peer': the peers are
    # whole data-parallel groups of b, so both tp peers of one data rank answer each caller
    # (callers 0, 1 -> b's data rank 0 = ranks 0, 1; callers 2, 3 -> ranks 2, 3): a tp group
    # never runs two callers' calls (before: caller r got b's rank r alone)
    assert a.ask_peer(b)() == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert b.ask_peer(a)() == [0, 1, 2, 3]  # a has no tp: b's rank r gets a's rank r


@pytest.mark.parametrize("mode", ["slice", "slice_dp"])
def test_execute_peer_runs_every_item_of_its_caller(gangs, mode):
    """A peer call cuts the caller's items over its peer workers only, so
    every item runs exactly once (before: cut over the whole gang, 3 of 4 items, under
    'slice', or half of them under 'slice_dp' on b's dp=2 x tp=2, were never run)."""
    a, b = gangs
    mine = [[r * 10 + k for k in range(4)] for r in range(4)]
    # a's worker r runs on one tp group of b: 'slice' cuts its items over the group's two
    # workers, 'slice_dp' gives both (tp peers of one data rank) all of them, and flatten keeps
    # both peers' answers, as for a call from the driver
    assert a.ask_peer_items(b, mode)() == (mine if mode == "slice" else [m + m for m in mine])
    assert b.ask_peer_items(a, mode)() == mine


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_remote_iterator_feeds_another_gang(gangs):
    _, b = gangs
    loader = Loader(10, 4, remote_group="a")  # one worker on group a's first device
    seen = []
    for batch in loader:
        assert isinstance(batch, LazyResult)
        seen.append(b.received(batch)())
    assert seen[0] == [[0, 1]] * 2 + [[2, 3]] * 2
    assert seen[2] == [[8]] * 2 + [[9]] * 2
    assert len(seen) == 3
    assert [len(b_) for b_ in loader] == [4, 4, 2]  # iterates again from the start
    loader.close()


def test_topology_picture(gangs):
    text = get_device_placement()
    assert "group 'a': 4 worker(s), gpu" in text and "gang b/Probe: 4 worker(s), backend gloo" in text
    assert text.count("node 127.0.0.1") == 8
    # topology() names the dispatcher's own process: alive, and neither a worker nor this one
    topo = gangs[0].topology()
    pid = topo["dispatcher_pid"]
    assert pid not in [r["pid"] for r in topo["ranks"]] + [os.getpid()]
    os.kill(pid, 0)  # raises if no such process


def test_calls_run_under_the_thread_state_init_left(gangs):
    assert gangs[0].grad_enabled()() == [False] * 4


def test_batch_too_small_raises_before_running(gangs):
    _, b = gangs
    with pytest.raises(ValueError, match=r"received\(\) on group 'b'.*1 items.*data-parallel size 2"):
        b.received([1])
    with pytest.raises(ValueError, match="data-parallel size 2"):
        b.received(np.arange(1))


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_lazy_batch_too_small_raises_on_get(gangs):
    a, b = gangs
    loader = Loader(1, 1, remote_group="a")
    one = next(iter(loader))
    t = time.monotonic()
    with pytest.raises(ValueError, match=r"received\(\) on group 'b': batch of 1 items .*size 2"):
        b.received(one)()
    assert time.monotonic() - t < 30
    loader.close()
