"""Total order: concurrent callers of one gang never mix their collectives.

Three callers share a 2-worker gloo gang at the same time -- two driver
threads (on one proxy) and a proxy pickled into another gang's worker -- and
each makes many lazy calls before collecting any. Every call all-reduces a
value that encodes (caller, call number). A call is unmixed when every rank
reduced exactly that call's value with the other rank (``2 * code``); if the
ranks ever took two calls in different orders, their all_reduce would pair
different calls and the sums would show it. Each worker also numbers the calls
it runs: both ranks must give a call the same number (one order for the whole
gang), every call runs exactly once, and each caller's calls run in the order
it made them.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinkle_ray import DeviceGroup, remote_class, remote_function

CALLS = 80  # per caller
DRIVER_THREADS = (1, 2)  # caller ids of the two driver threads
IN_WORKER = 3  # caller id of the proxy inside another gang's worker


def code(caller: int, n: int) -> int:
    return caller * 1000 + n


@remote_class()
class Reducer:
    """2 ranks, gloo: each call all-reduces its code and notes its place in this rank's order."""

    def __init__(self):
        self.seq = 0

    @remote_function(dispatch="all", collect="none")
    def reduce(self, value: int) -> dict:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t)
        seq, self.seq = self.seq, self.seq + 1
        return {"rank": dist.get_rank(), "seq": seq, "sum": int(t.item())}


# Its failed calls are checked for stuck peers after 0.5 s, not 3: every 5th call fails below.
QuickReducer = remote_class(stuck_grace_s=0.5)(type("QuickReducer", (Reducer,), {}))


@remote_class(distributed=False)
class Caller:
    """A worker of another gang that calls the Reducer gang through a pickled proxy."""

    @remote_function(dispatch="all", collect="first")
    def drive(self, gang, caller: int, calls: int) -> list:
        pending = [gang.reduce(code(caller, n)) for n in range(calls)]  # all in flight first
        return [p.get() for p in pending]


def _check(caller: int, results: list) -> list[int]:
    """Every call of ``caller`` unmixed; return its calls' positions in the gang's order."""
    assert len(results) == CALLS
    seqs = []
    for n, per_rank in enumerate(results):
        assert [r["rank"] for r in per_rank] == [0, 1], (caller, n, per_rank)
        assert [r["sum"] for r in per_rank] == [2 * code(caller, n)] * 2, (
            f"caller {caller} call {n} was mixed with another call: {per_rank}")
        rank_seqs = {r["seq"] for r in per_rank}
        assert len(rank_seqs) == 1, f"ranks ran caller {caller} call {n} at different places: {per_rank}"
        seqs.append(rank_seqs.pop())
    assert seqs == sorted(seqs), f"caller {caller}'s calls ran out of order: {seqs}"
    return seqs


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_concurrent_callers_get_one_total_order(runtime):
    runtime.initialize(groups=[DeviceGroup("ord", 2, "cpu"), DeviceGroup("ord_caller", 1, "cpu")])
    gang = Reducer(remote_group="ord")
    caller = Caller(remote_group="ord_caller")
    assert gang.reduce(0).get() == [{"rank": r, "seq": 0, "sum": 0} for r in (0, 1)]  # warm: gloo up, order starts at 1

    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(DRIVER_THREADS) + 1)

    def drive(cid: int) -> None:
        try:
            start.wait(timeout=60)
            pending = []
            for n in range(CALLS):
                pending.append(gang.reduce(code(cid, n)))
                time.sleep(0)  # let the other thread in between any two calls
            results[cid] = [p.get() for p in pending]
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(cid,)) for cid in DRIVER_THREADS]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often, also inside one call's submission
    try:
        for t in threads:
            t.start()
        inner = caller.drive(gang, IN_WORKER, CALLS)  # lazy: runs while the threads call
        start.wait(timeout=60)
        results[IN_WORKER] = inner.get()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(switch)
    assert not any(t.is_alive() for t in threads), "a driver thread did not finish"
    if errors:
        raise errors[0]

    seqs = [s for cid in (*DRIVER_THREADS, IN_WORKER) for s in _check(cid, results[cid])]
    total = CALLS * (len(DRIVER_THREADS) + 1)
    assert sorted(seqs) == list(range(1, total + 1)), "every call runs exactly once"
    gang.close()
    caller.close()


@remote_class()
class Noted:
    """2 ranks that note every call and every save in the order they run them."""

    def __init__(self):
        self.log: list = []

    @remote_function(dispatch="all", collect="first")
    def note(self, x: int, seconds: float = 0.0) -> list:
        time.sleep(seconds)
        self.log.append(x)
        return list(self.log)

    def state_dict(self) -> dict:
        self.log.append("saved")
        return {"log": list(self.log)}

    def load_state_dict(self, state: dict) -> None:
        self.log = list(state["log"])


@pytest.mark.slow
def test_save_state_takes_its_place_in_the_call_order(runtime):
    runtime.initialize(groups=[DeviceGroup("ord_save", 2, "cpu")])
    gang = Noted(remote_group="ord_save")
    gang.note(1, 0.3)  # still running when save_state is sent
    gang.save_state()
    assert gang.note(2)() == [1, "saved", 2]
    gang.close()


@pytest.fixture
def driver_only_class(tmp_path, monkeypatch):
    """A class importable in this process only (its module is on this process's sys.path, not
    the gang's): an argument of it pickles here by reference and fails to unpickle there."""
    (tmp_path / "driver_only_things.py").write_text(
        "class Thing:\n    def __init__(self, v):\n        self.v = v\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "driver_only_things", raising=False)
    import driver_only_things

    yield driver_only_things.Thing
    sys.modules.pop("driver_only_things", None)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_threads_sharing_a_proxy_keep_their_order_around_calls_that_fail_to_unpickle(
        runtime, driver_only_class):
    # Every 5th call of each thread has an argument the gang's workers cannot import. The
    # dispatcher never unpickles arguments, so the call takes its turn like any other and fails
    # in the ranks, naming the argument. The calls after it must neither stall nor overtake
    # the calls the same thread made before it (on the shared proxy those may still wait for
    # other threads' calls).
    runtime.initialize(groups=[DeviceGroup("ord_lost", 2, "cpu")])
    gang = QuickReducer(remote_group="ord_lost")
    assert gang.reduce(0).get()[0]["sum"] == 0
    threads_n, calls, rounds = 4, 25, 3
    errors: list[BaseException] = []
    for rnd in range(rounds):
        results: dict[int, list] = {}

        def drive(cid: int, rnd: int, results: dict) -> None:
            try:
                kept = []
                for n in range(calls):
                    c = code(cid, rnd * 100 + n)
                    if n % 5 == 2:  # fails in the ranks: fetched at once, as an eager call would be
                        with pytest.raises(TypeError, match=(
                                r"QuickReducer.reduce\(\) on rank \d of group 'ord_lost': argument 0 "
                                r"cannot be unpickled in this Ray worker \(.*driver_only_things.*"
                                r"\): driver_only_things is importable in the caller but not in "
                                r"the gang's Ray workers")):
                            gang.reduce(driver_only_class(c)).get(timeout=30)
                    elif n % 5 == 3:  # fetched at once (its next call says SETTLED)
                        kept.append((c, gang.reduce(c).get(timeout=30)))
                    else:  # in flight while the thread goes on
                        kept.append((c, gang.reduce(c)))
                results[cid] = [(c, r if isinstance(r, list) else r.get(timeout=60))
                                for c, r in kept]
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=drive, args=(cid, rnd, results))
                   for cid in range(1, threads_n + 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a driver thread did not finish"
        if errors:
            raise errors[0]
        for cid, got in results.items():
            seqs = []
            for c, per_rank in got:
                assert [r["sum"] for r in per_rank] == [2 * c] * 2, (cid, c, per_rank)
                assert len({r["seq"] for r in per_rank}) == 1, (cid, c, per_rank)
                seqs.append(per_rank[0]["seq"])
            assert seqs == sorted(seqs), f"round {rnd}: thread {cid}'s calls ran out of order: {seqs}"
    gang.close()


# --------------------------------------------------------------------------- generated schedules


@remote_class(distributed=False)
class Book:
    """2 ranks that note each call (caller, number) in the order they run them."""

    def __init__(self):
        self.log: list = []

    @remote_function(dispatch="slice_dp", collect="none")
    def note(self, caller: list, n: list, payload=None) -> int:
        self.log.append((caller[0], n[0]))  # (one of each per rank: the call is cut by rank)
        return len(self.log)

    @remote_function(dispatch="all", collect="none")
    def logs(self) -> list:
        return list(self.log)


@remote_class(distributed=False)
class Source:
    """A producer whose calls take a while: what a routed argument waits for."""

    @remote_function(dispatch="all", collect="flatten")
    def rows(self, n: int, seconds: float) -> list:
        time.sleep(seconds)
        return list(range(n))


@pytest.fixture(scope="module")
def books(ray_session, tmp_path_factory):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("order_book", 2, "cpu"),
                                   DeviceGroup("order_src", 2, "cpu")])
    yield Book(remote_group="order_book"), Source(remote_group="order_src")
    twinkle_ray.shutdown()


KINDS = ("plain", "slow-routed", "routed-in-dict", "unpicklable", "eager")


@pytest.mark.slow
@given(schedule=st.lists(st.lists(st.sampled_from(KINDS), min_size=2, max_size=6), min_size=1,
                         max_size=3))
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_schedules_keep_each_callers_order_on_every_rank(books, driver_only_class,
                                                                    schedule):
    """Several driver threads share one proxy; each makes its calls as the schedule says: plain,
    routed from a producer that takes a while (at the top, inside a dict), with an argument the
    ranks cannot unpickle (fails there, naming it), or eager. The oracle: on every rank, each
    caller's calls that ran appear in the order it made them, and every call that did not
    fail ran on both ranks exactly once."""
    book, source = books
    base = len(book.logs()()[0])
    errors: list[BaseException] = []
    expected: dict[int, list[int]] = {}

    def drive(cid: int, kinds: list[str]) -> None:
        try:
            pending, ran = [], []
            for n, kind in enumerate(kinds):
                if kind == "unpicklable":
                    with pytest.raises(TypeError, match="argument 2 cannot be unpickled"):
                        book.note([cid] * 2, [n] * 2, [driver_only_class(n)] * 2).get(timeout=60)
                    continue
                payload = None
                if kind == "slow-routed":
                    payload = source.rows(2, 0.3)
                elif kind == "routed-in-dict":
                    payload = {"rows": source.rows(4, 0.2), "k": [1, 2]}
                out = book.note([cid] * 2, [n] * 2, payload)
                if kind == "eager":
                    out.get(timeout=60)
                pending.append(out)
                ran.append(n)
            for p in pending:
                p.get(timeout=120)
            expected[cid] = ran
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(cid, kinds))
               for cid, kinds in enumerate(schedule)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a caller did not finish"
    if errors:
        raise errors[0]
    for rank_log in book.logs()():
        new = rank_log[base:]
        for cid, ran in expected.items():
            assert [n for c, n in new if c == cid] == ran, (cid, ran, new)
        assert len(new) == sum(map(len, expected.values()))


@remote_class(distributed=False, max_restarts=1)
class SlowToRebuild:
    """A producer whose rebuilt workers take a while to construct (a vLLM reload, say)."""

    def __init__(self, marker: str):
        import os

        if os.path.exists(marker):  # a rebuild: the first build left the marker
            time.sleep(4.0)
        with open(marker, "a"):
            pass

    @remote_function(dispatch="all", collect="flatten")
    def rows(self) -> list:
        return [1, 2]

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        import os

        return os.getpid()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_call_behind_one_routed_from_a_producer_being_rebuilt_waits(runtime, tmp_path):
    """Guards against: a call waiting more than 60 s for a routed producer being rebuilt was
    overtaken by its caller's next call. The call holds its turn while the producer's reply
    waits for the rebuild; the caller's next call runs after it, however long that takes."""
    import os
    import signal

    runtime.initialize(groups=[DeviceGroup("order_rb_src", 1, "cpu"),
                               DeviceGroup("order_rb_book", 2, "cpu")])
    source = SlowToRebuild(str(tmp_path / "built"), remote_group="order_rb_src")
    book = Book(remote_group="order_rb_book")
    os.kill(source.pid()(), signal.SIGKILL)  # the rebuild starts: 4 s of construction
    time.sleep(0.5)
    first = book.note([1, 1], [0, 0], source.rows())  # waits for the rebuilt producer's reply
    second = book.note([1, 1], [1, 1])  # must not run before it
    assert second.get(timeout=120) and first.get(timeout=120)
    for rank_log in book.logs()():
        assert rank_log == [(1, 0), (1, 1)], rank_log
