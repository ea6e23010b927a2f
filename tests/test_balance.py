"""``dispatch='balance'``: chunks go to whichever data-parallel group is free.

Each test uses a small gang (2-4 workers, no torch.distributed unless needed).
What is checked: results in input order for every chunk size (a short last
chunk included); a slow chunk does not hold the others up (its group runs only
it); tp peers get the same chunks; a balanced result routed into a dp=2
consumer gives each rank exactly what fetching and slicing it would; a LazyResult
as a balanced call's input; the length check; refused settings; a death
mid-call; the call order around a balanced call; timeout; local mode.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from twinkle_ray import (
    CallTimeoutError,
    DeviceGroup,
    DeviceMesh,
    GangStuckError,
    WorkerDiedError,
    get_rank,
    remote_class,
    remote_function,
)
from twinkle_ray.core.balance import (
    ChunkTable,
    chunk_bounds,
    in_input_order,
    locate_positions,
    pick_chunk_size,
)
from twinkle_ray.core.dispatch import span

N = 10


def _wait_for(path: str, count: int, timeout_s: float = 60.0) -> None:
    """Block until ``count`` marker files exist under ``path`` (no result depends on timing)."""
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(path)) < count and time.monotonic() < deadline:
        time.sleep(0.01)


@remote_class(distributed=False)
class Squarer:
    """Records the chunks this rank ran; item ``slow`` (when given) waits until every other
    item has run, so the group that took it runs nothing else."""

    def __init__(self, device_mesh=None):
        self.seen: list[list[int]] = []

    def _square(self, xs: list, marks: str | None = None, slow: int | None = None) -> list:
        self.seen.append(list(xs))
        for x in xs:
            if x == slow:
                _wait_for(marks, N - 1)
            elif marks is not None:
                open(os.path.join(marks, str(x)), "w").close()
        return [x * x for x in xs]

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
    def square1(self, xs, marks=None, slow=None):
        return self._square(xs, marks, slow)

    @remote_function(dispatch="balance", collect="flatten", chunk_size=3)
    def square3(self, xs, marks=None, slow=None):
        return self._square(xs, marks, slow)

    @remote_function(dispatch="balance", collect="flatten", chunk_size=4)
    def square4(self, xs, marks=None, slow=None):
        return self._square(xs, marks, slow)

    @remote_function(dispatch="balance", collect="flatten")
    def square_auto(self, xs, marks=None, slow=None):
        return self._square(xs, marks, slow)

    @remote_function(dispatch="balance", collect="flatten", chunk_size=2)
    def short_by_one(self, xs):
        return xs[:-1]

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
    def tag(self, xs: list) -> list:
        self.seen.append(list(xs))
        return [{"x": x, "rank": get_rank()} for x in xs]

    @remote_function(dispatch="balance", collect="flatten", chunk_size=2)
    def pair(self, xs: list) -> tuple:
        return [x * x for x in xs], [-x for x in xs]

    @remote_function(dispatch="all", collect="none")
    def chunks_seen(self) -> list:
        return self.seen

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, timeout=1.0)
    def slow_items(self, xs: list) -> list:
        time.sleep(0.4)
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
    def sleepy(self, xs: list, marks: str) -> list:
        for x in xs:
            open(os.path.join(marks, f"{x}-{os.getpid()}"), "w").close()
            time.sleep(0.3)
        return xs

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


@remote_class(distributed=False)
class Consumer:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="slice_dp", collect="none")
    def take(self, batch):
        return batch

    @remote_function(dispatch="all", collect="none")
    def whole(self, batch):
        return batch

    @remote_function(dispatch="slice_dp", collect="flatten")
    def emit(self, xs: list) -> list:
        return xs


# ---------------------------------------------------------------------------- pure rules
def test_chunk_rules():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]  # a short last chunk
    assert pick_chunk_size(256, 4) == 8 and pick_chunk_size(3, 4) == 1 and pick_chunk_size(9, 1, 5) == 5
    table = ChunkTable()
    # group 0 has two peers (tp): both get chunk 0 as their first, then chunk 2
    got = [table.ask(1, 0, 0, 3, 3), table.ask(1, 1, 0, 3, 3), table.ask(1, 0, 0, 3, 3),
           table.ask(1, 0, 1, 3, 3), table.ask(1, 0, 1, 3, 3)]
    assert got == [0, 1, 0, 2, 2]
    assert [table.ask(1, 1, 1, 3, 3), table.ask(1, 0, 2, 3, 3), table.ask(1, 0, 2, 3, 3)] == [None] * 3
    assert len(table) == 0 and table.ask(1, 1, 0, 3, 3) is None  # ended: nothing runs twice
    outputs, positions = [[4, 5, 0, 1], [2, 3]], [[(4, 6), (0, 2)], [(2, 4)]]
    assert in_input_order(outputs, positions) == [0, 1, 2, 3, 4, 5]
    assert locate_positions(positions, 1, 5) == [(0, (3, 4)), (1, (0, 2)), (0, (0, 1))]


def test_local_mode_same_semantics():
    import twinkle_ray

    twinkle_ray.initialize("local", groups=[DeviceGroup("loc", 2, "cpu")])
    try:
        s = Squarer(remote_group="loc")  # built in-process
        assert s.square4(list(range(N))) == [x * x for x in range(N)]
        assert s.seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        with pytest.raises(ValueError, match=r"Squarer.short_by_one\(\) \(dispatch='balance'\): returned "
                                             r"1 result\(s\) for a chunk of 2 item\(s\)"):
            s.short_by_one([1, 2, 3])
    finally:
        twinkle_ray.shutdown()


# ---------------------------------------------------------------------------- on a gang
@pytest.mark.parametrize("method, size", [("square1", 1), ("square3", 3), ("square4", 4),
                                          ("square_auto", None)])
@pytest.mark.slow
def test_input_order_and_the_slow_group_runs_only_its_chunk(runtime, tmp_path, method, size):
    runtime.initialize(groups=[DeviceGroup("bal", 3, "cpu")])
    s = Squarer(remote_group="bal")
    marks = str(tmp_path)
    slow = {1: 0, 3: 5, 4: 3, None: 0}[size]  # the last item of its chunk
    out = getattr(s, method)(list(range(N)), marks, slow)()
    assert out == [x * x for x in range(N)]
    seen = s.chunks_seen()()
    chunks = sorted(c for per_rank in seen for c in per_rank)
    bounds = chunk_bounds(N, pick_chunk_size(N, 3, size))
    assert chunks == [list(range(a, b)) for a, b in bounds]  # each chunk exactly once
    # the slow chunk waits until every other item has run: its rank ran nothing after it
    holder = next(per_rank for per_rank in seen if any(slow in c for c in per_rank))
    assert slow in holder[-1], seen


@pytest.mark.slow
def test_tp_peers_get_the_same_chunks(runtime):
    runtime.initialize(groups=[DeviceGroup("tp", 4, "cpu")])
    s = Squarer(device_mesh=DeviceMesh.from_sizes(dp_size=2, tp_size=2, device_type="cpu"),
                remote_group="tp")
    out = s.tag(list(range(12)))()
    assert [o["x"] for o in out] == list(range(12))
    seen = s.chunks_seen()()  # per rank, in the order it ran them; ranks 0,1: group 0; 2,3: group 1
    assert seen[0] == seen[1] and seen[2] == seen[3], seen
    assert sorted(seen[0] + seen[2]) == [[x] for x in range(12)]
    # each item's result comes from a rank of the group that ran it
    for o in out:
        assert [o["x"]] in seen[o["rank"]]


@pytest.mark.slow
def test_balanced_result_routes_into_a_dp2_consumer(runtime, tmp_path):
    runtime.initialize(groups=[DeviceGroup("prod", 3, "cpu"), DeviceGroup("cons", 2, "cpu")])
    p = Squarer(remote_group="prod")
    c = Consumer(device_mesh=DeviceMesh.from_sizes(dp_size=2, device_type="cpu"), remote_group="cons")
    lazy = p.square1(list(range(N)), str(tmp_path), 0)  # the slow item: outputs far from even
    got = c.take(lazy)()  # per consumer rank
    value = lazy()
    assert got == [value[slice(*span(N, 2, r))] for r in range(2)]  # exactly fetch-then-slice
    assert c.whole(lazy)() == [value, value]
    tagged = p.tag(list(range(7)))  # dicts: sliced and joined per item
    assert c.take(tagged)() == [tagged()[:4], tagged()[4:]]
    pair = p.pair(list(range(5)))  # several return values: element-wise, as collect joins them
    assert pair() == ([0, 1, 4, 9, 16], [0, -1, -2, -3, -4])
    # cut as the fetched tuple, passed: along its own length (one element per data rank)
    assert c.take(pair)() == c.take(pair())()


@pytest.mark.slow
def test_lazy_input_to_a_balanced_call(runtime):
    runtime.initialize(groups=[DeviceGroup("src", 2, "cpu"), DeviceGroup("bal", 2, "cpu")])
    src = Consumer(device_mesh=DeviceMesh.from_sizes(dp_size=2, device_type="cpu"), remote_group="src")
    s = Squarer(remote_group="bal")
    items = src.emit(list(range(N)))  # a LazyResult, chunked in the balanced call's workers
    assert s.square3(items)() == [x * x for x in range(N)]
    assert sorted(c for per_rank in s.chunks_seen() for c in per_rank) == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert s.square1(s.square1(list(range(5))))() == [x ** 4 for x in range(5)]  # balanced -> balanced


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_length_mismatch_names_method_and_lengths(runtime):
    runtime.initialize(groups=[DeviceGroup("bal", 2, "cpu")])
    s = Squarer(remote_group="bal")
    with pytest.raises(ValueError, match=r"Squarer.short_by_one\(\) \(dispatch='balance'\): returned 1 "
                                         r"result\(s\) for a chunk of 2 item\(s\)"):
        s.short_by_one([1, 2, 3, 4])()
    assert s.square1([1, 2, 3])() == [1, 4, 9]  # a user error: the gang lives on
    with pytest.raises(ValueError, match=r"lengths differ \(argument 0: 2, argument 1: 3\)"):
        s.square1([1, 2], [1, 2, 3])


def test_refused_settings():
    for execute in ("first", "peer"):
        with pytest.raises(ValueError, match=f"dispatch='balance' with execute='{execute}' is not supported"):
            remote_function(dispatch="balance", execute=execute)
    with pytest.raises(ValueError, match="dispatch='balance' with collect='mean' is not supported"):
        remote_function(dispatch="balance", collect="mean")
    with pytest.raises(ValueError, match="chunk_size must be None or a positive int, got 0"):
        remote_function(dispatch="balance", chunk_size=0)
    with pytest.raises(ValueError, match=r"chunk_size=2 needs dispatch='balance'"):
        remote_function(dispatch="slice_dp", chunk_size=2)


@remote_class(execute="first", distributed=False)
class OneWorker:
    @remote_function(dispatch="balance", collect="flatten")
    def f(self, xs: list) -> list:
        return xs


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_balance_on_an_execute_first_gang_is_refused(runtime):
    runtime.initialize(groups=[DeviceGroup("one", 2, "cpu")])
    g = OneWorker(remote_group="one")
    with pytest.raises(ValueError, match=r"OneWorker.f\(\) on group 'one': dispatch='balance' with "
                                         r"execute='first' \(the gang's remote_class\) is not supported"):
        g.f([1, 2])


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_a_call_after_a_balanced_call_sees_every_chunk(runtime):
    runtime.initialize(groups=[DeviceGroup("bal", 2, "cpu")])
    s = Squarer(remote_group="bal")
    first = s.square1(list(range(N)))
    seen = s.chunks_seen()  # made at once, before anything is fetched
    assert sorted(c for per_rank in seen() for c in per_rank) == [[x] for x in range(N)]
    assert first() == [x * x for x in range(N)]


@pytest.mark.slow
def test_timeout_bounds_the_whole_call(runtime):
    runtime.initialize(groups=[DeviceGroup("bal", 2, "cpu")])
    s = Squarer(remote_group="bal")
    with pytest.raises(CallTimeoutError, match=r"slow_items\(\) on group 'bal': rank\(s\) \[0, 1\] did not "
                                               r"answer within 1s"):
        s.slow_items(list(range(8)))()  # 4 items of 0.4 s per rank


@remote_class(distributed=False, max_restarts=1)
class Healing(Squarer):
    pass


@pytest.mark.slow
def test_worker_killed_mid_call_raises_and_is_not_rerun(runtime, tmp_path):
    runtime.initialize(groups=[DeviceGroup("heal", 2, "cpu")])
    s = Healing(remote_group="heal")
    pids = s.pid()()
    marks = str(tmp_path)
    pending = s.sleepy(list(range(20)), marks)
    _wait_for(marks, 2)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=r"rank 1 of Healing in group 'heal'"):
        pending.get()
    new = s.pid()()  # waits for the automatic rebuild
    assert not set(new) & set(pids)
    time.sleep(1.0)
    ran_after = [m for m in os.listdir(marks) if int(m.split("-")[1]) in new]
    assert ran_after == []  # the balanced call was not re-run on the rebuilt gang
    assert s.square1([1, 2, 3])() == [1, 4, 9]


@remote_class(stuck_grace_s=0.5)  # torch.distributed up: the stuck check would apply
class Picky:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
    def run(self, items: list) -> list:
        if items[0] == "bad":
            raise ValueError("a bad item")
        time.sleep(2.0)  # another group still runs its chunk when the bad one raises
        return items

    @remote_function(dispatch="all", collect="none")
    def ok(self) -> int:
        return get_rank()


@pytest.mark.slow
def test_a_raising_chunk_fails_the_call_and_leaves_the_gang_up(runtime):
    """Guards against: a raising chunk tore the whole gang down: the stuck check took the other
    data-parallel group, running its own chunk, for a rank stuck in a collective. A balanced
    call's groups share no collective: no stuck check, the error raised with its type, the
    gang goes on."""
    runtime.initialize(groups=[DeviceGroup("bal_picky", 2, "cpu")])
    gang = Picky(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="bal_picky")
    with pytest.raises(ValueError, match="a bad item"):
        gang.run(["bad", "slow", "slow"])()
    time.sleep(1.5)  # past the grace a stuck check would have waited
    assert gang.ok()() == [0, 1]  # not GangStuckError: the gang was never torn down
    assert gang.topology()["generation"] == 1
    gang.close()


@remote_class(stuck_grace_s=0.5)
class TpPeers:
    """Two data-parallel groups of two tp peers (ranks 0, 1 and 2, 3); a chunk ends in an
    all_reduce between the group's peers."""

    def __init__(self, device_mesh=None):
        import torch.distributed as dist

        self.tp = None
        for ranks in ([0, 1], [2, 3]):
            group = dist.new_group(ranks)
            if get_rank() in ranks:
                self.tp = group

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
    def reduce(self, items: list, marks: str | None = None) -> list:
        import torch
        import torch.distributed as dist

        if items[0] == "slow":  # the other group: its own chunk, still running past the grace
            open(os.path.join(marks, f"slow-{get_rank()}"), "w").close()
            time.sleep(2.0)
        if items[0] == "bad" and get_rank() % 2 == 1:
            _wait_for(marks, 2)  # once the other group runs its chunk
            raise ValueError(f"a bad item on rank {get_rank()}")
        t = torch.ones(1)
        dist.all_reduce(t, group=self.tp)  # the raising rank's peer waits here for good
        return [float(t)] * len(items)

    @remote_function(dispatch="all", collect="none")
    def ok(self) -> int:
        return get_rank()


@pytest.mark.slow  # a gloo gang of 4: seconds
def test_a_raising_tp_peer_in_a_balanced_call_never_leaves_its_peer_stuck(runtime, tmp_path):
    """Guards against: a balanced call had no stuck check, also where a data-parallel group has
    tp peers that share collectives. A rank raised before the all_reduce its peer sat in: the
    call, and every call after it, waited on that peer forever. Now the failed rank's peers
    (only them: the other group runs its own chunk past the grace, and is not stuck) are
    checked: the call fails with its error (or the gang's), the next one GangStuckError naming
    group, rank, the stuck peer and the method."""
    limit_s = 30.0  # a bound for the test only: before the fix these calls never ended
    runtime.initialize(groups=[DeviceGroup("bal_tp", 4, "cpu", cpus_per_worker=0.5)])
    gang = TpPeers(device_mesh=DeviceMesh.from_sizes(dp_size=2, tp_size=2, device_type="cpu"),
                   remote_group="bal_tp")
    assert gang.reduce(["x", "y"]).get(timeout=limit_s) == [2.0, 2.0]
    # the call raises its error, or the gang's once the stuck peer was torn down (a death
    # outranks a user exception): either names the rank's error
    with pytest.raises((ValueError, GangStuckError), match=r"a bad item on rank [13]"):
        gang.reduce(["bad", "slow"], str(tmp_path)).get(timeout=limit_s)
    with pytest.raises(GangStuckError) as stuck:
        gang.ok().get(timeout=limit_s)  # not queued behind the peer's stuck all_reduce
    err = stuck.value
    assert (err.group, err.cls, err.method) == ("bal_tp", "TpPeers", "reduce")
    assert err.rank in (1, 3) and err.stuck == [err.rank - 1], err  # not the other group's ranks
    assert f"ValueError: a bad item on rank {err.rank}" in str(err)


@remote_class(distributed=False)
class Stages:
    """Two pipeline stages of one data-parallel group: only the last stage holds the results (the
    first answers placeholders, as a pipeline-parallel engine's first stage has no logits)."""

    def __init__(self, device_mesh=None):
        self.last = device_mesh.is_pp_last_rank(get_rank())

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
    def generate(self, xs: list) -> list:
        return [x * 10 if self.last else None for x in xs]


@pytest.mark.slow  # a gang of 2 without torch.distributed: seconds
def test_a_pp_group_answers_with_its_last_stage(runtime):
    """Guards against: get() and as_completed() of a balanced call on a pipeline-parallel gang read
    each group's first worker, stage 0 (its placeholders), not the last stage (collect='last_pp'
    semantics)."""
    runtime.initialize(groups=[DeviceGroup("bal_pp", 2, "cpu")])
    gang = Stages(device_mesh=DeviceMesh.from_sizes(dp_size=1, pp_size=2, device_type="cpu"),
                  remote_group="bal_pp")
    lazy = gang.generate(list(range(5)))
    got = sorted((c.index, c.value) for c in lazy.as_completed(timeout=60))
    assert got == [(i, i * 10) for i in range(5)]
    assert lazy.get(timeout=60) == [i * 10 for i in range(5)]
    assert gang.generate([7, 8])() == [70, 80]
