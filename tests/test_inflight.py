"""Requests in flight (``in_flight=k``) and ``LazyResult.as_completed``.

One module-scoped gang of sleep engines (2 data-parallel groups, no torch.distributed)
serves most cases; the fault cases build their own. What is checked: every index exactly
once and get() in input order under generated lengths and k (hypothesis); k requests
running at once per group; items streamed while the call still runs; tp peers get the same
chunks; versions; errors (a raising request, a timeout, a worker killed mid-stream); every
bad input (decoration, as_completed on other calls); the worker's stream book bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinkle_ray import (
    CallTimeoutError,
    Completed,
    DeviceGroup,
    DeviceMesh,
    WorkerDiedError,
    get_rank,
    remote_class,
    remote_function,
)
from twinkle_ray.core.balance import WEIGHT_VERSION_ATTR
from twinkle_ray.runtime.inflight import STREAMS_KEPT, StreamBook

KS = (1, 2, 3, 5)


def _sleeper(k: int):
    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=k)
    async def gen(self, xs: list) -> list:
        return [await self._one(x) for x in xs]

    gen.__name__ = gen.fn.__name__ = f"gen{k}"
    return gen


async def _until(path: str, count: int, timeout_s: float = 60.0) -> None:
    """Await until ``count`` marker files exist under ``path`` (nothing depends on timing)."""
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(path)) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


@remote_class(distributed=False)
class Engine:
    """A sleep engine: each request awaits its length; counts requests running at once."""

    def __init__(self, device_mesh=None):
        self.running = 0
        self.peak = 0
        self.seen: list = []

    async def _one(self, x: float) -> float:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(x)
        finally:
            self.running -= 1
        return x

    gen1, gen2, gen3, gen5 = (_sleeper(k) for k in KS)

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=4)
    async def full(self, xs: list, k: int = 4) -> list:
        """Each request waits until k run at once on this rank (or 30 s): the peak is k."""
        self.running += 1
        self.peak = max(self.peak, self.running)
        deadline = time.monotonic() + 30
        while self.peak < k and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self.running -= 1
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=3)
    async def held(self, xs: list, marks: str, hold: int) -> list:
        """Item ``hold`` waits for the marker file 'go' (the test writes it once it has read
        every other item); the others finish at once."""
        if xs[0] == hold:
            await _until(marks, 1)
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=2, in_flight=3)
    async def pairs(self, xs: list) -> tuple:
        await asyncio.sleep(0.001 * len(xs))
        return [x * 2 for x in xs], [get_rank()] * len(xs)

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=3)
    async def versioned(self, xs: list) -> list:
        await asyncio.sleep(0.001)
        setattr(self, WEIGHT_VERSION_ATTR, getattr(self, WEIGHT_VERSION_ATTR, 0) + 1)
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=2)
    async def flaky(self, xs: list) -> list:
        if xs[0] == "bad":
            raise KeyError("a bad request")
        await asyncio.sleep(0.05)
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=2,
                     timeout=0.5)
    async def too_slow(self, xs: list) -> list:
        await asyncio.sleep(3.0)
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=2, in_flight=2)
    async def sizes(self, blobs: list, tag: str) -> list:
        await asyncio.sleep(0.001)
        return [f"{tag}{len(b)}" for b in blobs]

    @remote_function(dispatch="balance", collect="flatten", chunk_size=2)
    def plain(self, xs: list) -> list:
        return [x + 1 for x in xs]

    @remote_function(dispatch="slice_dp", collect="flatten")
    def sliced(self, xs: list) -> list:
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
    def plain_held(self, xs: list, marks: str, hold: int) -> list:
        """A plain method: item ``hold`` writes the marker 'reached' and waits for 'go'."""
        if xs[0] == hold:
            open(os.path.join(marks, "reached"), "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(marks, "go")) and time.monotonic() < deadline:
                time.sleep(0.01)
        return xs

    @remote_function(dispatch="all", collect="none")
    def peak_and_reset(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


@pytest.fixture(scope="module")
def engines(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("engines", 2, "cpu")])
    gang = Engine(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="engines")
    yield gang
    twinkle_ray.shutdown()


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("k", [0, -1, 1.5, True, "2", None])
def test_in_flight_not_a_positive_int_is_refused(k):
    with pytest.raises(ValueError, match="in_flight must be a positive int"):
        remote_function(dispatch="balance", chunk_size=1, in_flight=k)


def test_in_flight_on_a_plain_method_names_it():
    with pytest.raises(ValueError, match=r"Plain\.step: in_flight=2 needs an 'async def' method"):
        class Plain:
            @remote_function(dispatch="balance", chunk_size=1, in_flight=2)
            def step(self, xs):
                return xs


def test_in_flight_without_balance_is_refused():
    with pytest.raises(ValueError, match="in_flight=3 needs dispatch='balance'"):
        remote_function(dispatch="slice_dp", in_flight=3)


def test_local_mode_runs_an_async_balanced_method():
    class Local:
        @remote_function(dispatch="balance", collect="flatten", chunk_size=2, in_flight=4)
        async def twice(self, xs):
            await asyncio.sleep(0)
            return [2 * x for x in xs]

    assert Local().twice([1, 2, 3]) == [2, 4, 6]


def test_as_completed_on_a_call_that_is_not_balanced(engines):
    with pytest.raises(TypeError, match=r"as_completed\(\) needs a dispatch='balance' call"):
        engines.sliced([1, 2]).as_completed()
    with pytest.raises(TypeError, match=r"Engine\.peak_and_reset\(\) on group 'engines'"):
        engines.peak_and_reset().as_completed()


# ---------------------------------------------------------------------------- the promise
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=40), k=st.sampled_from(KS))
def test_every_index_exactly_once_and_get_in_input_order(engines, lengths, k):
    xs = [t / 1000 for t in lengths]
    lazy = getattr(engines, f"gen{k}")(xs)
    got = list(lazy.as_completed(timeout=120))
    assert sorted(c.index for c in got) == list(range(len(xs)))
    assert all(isinstance(c, Completed) and c.value == xs[c.index] for c in got)
    assert {c.rank for c in got} <= {0, 1}
    assert lazy.get() == xs  # input order afterwards
    assert getattr(engines, f"gen{k}")(xs)() == xs  # and without as_completed


def test_each_group_runs_k_requests_at_once(engines):
    engines.peak_and_reset()()
    assert engines.full(list(range(16)), 4)() == list(range(16))
    assert engines.peak_and_reset()() == [4, 4]


def test_items_stream_while_the_call_runs(engines, tmp_path):
    """The held item finishes only after the test has read every other one: they came while
    the call was still running, in completion order (the held one last)."""
    n, hold = 12, 3
    lazy = engines.held(list(range(n)), str(tmp_path), hold)
    stream = lazy.as_completed(timeout=60)
    first = [next(stream) for _ in range(n - 1)]
    assert hold not in {c.index for c in first}
    assert not lazy.done()
    open(os.path.join(tmp_path, "go"), "w").close()
    last = list(stream)
    assert [c.index for c in last] == [hold]
    assert lazy.get() == list(range(n))


def test_tuple_results_and_routing_after_streaming(engines):
    xs = list(range(9))
    lazy = engines.pairs(xs)
    got = {c.index: c.value for c in lazy.as_completed(timeout=60)}
    assert sorted(got) == xs and all(got[i][0] == 2 * i for i in xs)
    doubled, ranks = lazy.get()
    assert doubled == [2 * x for x in xs] and all(got[i][1] == ranks[i] for i in xs)
    assert engines.sliced(lazy)() == engines.sliced((doubled, ranks))()  # routed = passed


def test_a_streamed_result_still_routes(engines):
    xs = [0.001] * 6
    lazy = engines.gen3(xs)
    assert len(list(lazy.as_completed(timeout=60))) == 6
    assert engines.sliced(lazy)() == xs


def test_versions_are_read_at_chunk_start_and_end(engines):
    got = list(engines.versioned(list(range(8))).as_completed(timeout=60))
    for c in got:
        first, last = c.versions
        assert last >= first + 1  # this chunk bumped the counter while it ran
    plain = list(engines.plain([1, 2, 3]).as_completed(timeout=60))  # a plain balanced method
    assert sorted((c.index, c.value) for c in plain) == [(0, 2), (1, 3), (2, 4)]
    assert all(len(c.versions) == 2 for c in plain)


def test_a_large_batch_travels_as_put_chunks(engines):
    blobs = [b"x" * (50_000 + i) for i in range(10)]  # over PUT_BYTES: one put per chunk
    lazy = engines.sizes(blobs, tag="n=")
    got = {c.index: c.value for c in lazy.as_completed(timeout=60)}
    assert got == {i: f"n={50_000 + i}" for i in range(10)}
    assert lazy.get() == [f"n={50_000 + i}" for i in range(10)]


# ---------------------------------------------------------------------------- errors
def test_a_raising_request_ends_the_call_with_its_type(engines):
    items = ["ok"] * 6 + ["bad"] + ["ok"] * 6
    with pytest.raises(KeyError, match="a bad request") as info:
        list(engines.flaky(items).as_completed(timeout=60))
    assert "rank" in " ".join(getattr(info.value, "__notes__", [])) + str(info.value)
    with pytest.raises(KeyError):
        engines.flaky(items).get()
    assert engines.gen2([0.001, 0.001])() == [0.001, 0.001]  # the gang goes on


def test_a_timeout_raises_call_timeout_error(engines):
    with pytest.raises(CallTimeoutError, match="as_completed"):
        list(engines.too_slow([1, 2, 3, 4]).as_completed())
    assert engines.gen1([0.0])() == [0.0]


def test_the_dispatcher_keeps_no_chunk_table_after_streamed_calls(engines):
    for k in KS:
        assert len(list(getattr(engines, f"gen{k}")([0.0] * 20).as_completed(timeout=60))) == 20
    with pytest.raises(KeyError):
        engines.flaky(["bad", "ok", "ok"]).get()
    import ray

    label = engines.topology()["label"]
    stats = ray.get(ray.get_actor(label, namespace=ray.get_runtime_context().namespace).stats.remote())
    assert stats["balanced_calls"] == 0


def test_a_plain_balanced_call_keeps_no_answers_while_it_runs(engines, tmp_path):
    """Defect: a plain method's asks (``next_chunk``) did not say the group's peers, so the
    dispatcher kept every answer for the call's life (memory growing with its chunks)."""
    import ray

    n = 40
    lazy = engines.plain_held(list(range(n)), str(tmp_path), n - 1)
    deadline = time.monotonic() + 60
    while not (tmp_path / "reached").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (tmp_path / "reached").exists()  # chunk n - 1, the last, is handed out and running
    label = engines.topology()["label"]
    stats = ray.get(ray.get_actor(label, namespace=ray.get_runtime_context().namespace).stats.remote())
    (tmp_path / "go").touch()
    assert lazy.get() == list(range(n))
    assert stats["balanced_calls"] == 1 and stats["balanced_answers"] == 0


# ---------------------------------------------------------------------------- own gangs
# (after every test of the module's gang: the runtime fixture shuts it down)
@remote_class(distributed=False, max_restarts=1)
class Mortal:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=2)
    async def gen(self, xs: list) -> list:
        await asyncio.sleep(xs[0])
        return xs

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


@remote_class(distributed=False)
class Peer:
    def __init__(self, device_mesh=None):
        self.seen: list = []

    @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=3)
    async def gen(self, xs: list) -> list:
        self.seen.append(xs[0])
        await asyncio.sleep(0.001 * (xs[0] % 5))
        return xs

    @remote_function(dispatch="balance", collect="flatten", chunk_size=2, in_flight=1)
    async def one_at_a_time(self, xs: list) -> list:
        self.seen.append(tuple(xs))
        await asyncio.sleep(0.001)
        return xs

    @remote_function(dispatch="all", collect="none")
    def take_seen(self) -> list:
        seen, self.seen = self.seen, []
        return seen


@pytest.mark.slow
def test_tp_peers_get_the_same_chunks(runtime):
    runtime.initialize(groups=[DeviceGroup("peers", 4, "cpu")])
    gang = Peer(device_mesh=DeviceMesh.from_sizes(dp_size=2, tp_size=2), remote_group="peers")
    xs = list(range(24))
    # k > 1 with peers: each peer would start its chunks in its own order (collectives
    # mismatched), so the call is refused before any worker runs
    with pytest.raises(ValueError, match=r"Peer\.gen\(\) on group 'peers': in_flight=3 with 2 "
                                         r"workers per data-parallel group \(tp/pp peers\) is refused"):
        gang.gen(xs)
    assert gang.take_seen()() == [[], [], [], []]
    lazy = gang.one_at_a_time(xs)  # one in flight: the same chunks in the same order
    got = list(lazy.as_completed(timeout=60))
    assert sorted(c.index for c in got) == xs and lazy.get() == xs
    seen = gang.take_seen()()  # ranks 0, 1: data group 0; ranks 2, 3: data group 1
    assert seen[0] == seen[1] and seen[2] == seen[3]
    assert sorted(x for pair in seen[0] + seen[2] for x in pair) == xs
    gang.close()


@pytest.mark.slow
def test_a_worker_killed_mid_stream_raises_worker_died(runtime):
    runtime.initialize(groups=[DeviceGroup("mortal", 2, "cpu")])
    gang = Mortal(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="mortal")
    pids = gang.pid()()
    lazy = gang.gen([0.01] * 4 + [0.3] * 40)
    stream = lazy.as_completed(timeout=120)
    delivered = [next(stream) for _ in range(4)]
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 of Mortal in group 'mortal'"):
        for c in stream:
            delivered.append(c)
    assert time.monotonic() - killed < 60  # bounded (the figure is in the report, not here)
    assert len({c.index for c in delivered}) == len(delivered)  # none twice
    # rebuilt (max_restarts=1); the call is not re-run there, and the next one streams
    again = list(gang.gen([0.01] * 6).as_completed(timeout=120))
    assert sorted(c.index for c in again) == list(range(6))
    assert not set(gang.pid()()) & set(pids)  # new workers
    gang.close()


# ---------------------------------------------------------------------------- the table
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_peers_of_a_group_get_the_same_chunks_under_any_interleaving(data):
    """Generated: G groups of P peers, each peer with K asking slots (an ask per free slot,
    each slot ending at its first None), asks interleaved at random: every chunk runs in
    exactly one group, a group's peers get the same chunk for the same ask, the call's entry
    ends, and no answer is kept once every peer has read it."""
    from twinkle_ray.core.balance import ChunkTable

    groups, peers, k = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    n_chunks = data.draw(st.integers(0, 20))
    table = ChunkTable()
    workers = [(g, p) for g in range(groups) for p in range(peers)]
    asked = {w: 0 for w in workers}
    alive = {w: k for w in workers}  # slots still asking
    got: dict = {}
    while any(alive.values()):
        w = data.draw(st.sampled_from([w for w in workers if alive[w]]))
        j = table.ask(7, w[0], asked[w], n_chunks, len(workers) * k, peers)
        got.setdefault((w[0], asked[w]), set()).add(j)
        asked[w] += 1
        if j is None:
            alive[w] -= 1
    assert all(len(v) == 1 for v in got.values())  # peers: one answer per (group, ask)
    chunks = sorted(j for v in got.values() for j in v if j is not None)
    assert chunks == list(range(n_chunks))  # each chunk in exactly one group
    assert len(table) == 0 and table.ask(7, 0, 0, n_chunks, 1, peers) is None


# ---------------------------------------------------------------------------- the book
def test_stream_book_forgets_a_read_entry_and_bounds_the_unread():
    book = StreamBook()
    e = book.open(1)
    e.add([(0, 1, ["a"], (0, 0))])
    e.end()
    assert list(book.read(1, ended=lambda: 1)) == [[(0, 1, ["a"], (0, 0))]]
    assert len(book) == 0 and list(book.read(1, ended=lambda: 1)) == []
    for seq in range(2, 2 + STREAMS_KEPT + 3):
        book.open(seq).end()
    assert len(book) <= STREAMS_KEPT + 1
    assert list(book.read(2, ended=lambda: 99)) == []  # forgotten: ends at once
    assert list(book.read(500, ended=lambda: 600)) == []  # never ran here: ends at once
