"""``dispatch='balance'``, the pure part: chunks, who takes which, and input order (no Ray).

Over 400 lines, and owed a split: the chunk table, the position maths routing reads and the
bench's schedule models (``pull_schedule``, ``batch_sync_schedule``) are three jobs; the models
are to move out.

A balanced call cuts its batch of ``n`` items into chunks of ``chunk_size``
items (:func:`chunk_bounds`). Each worker of the gang loops, asking the
gang's dispatcher for its next chunk; a :class:`ChunkAssigner` answers: the
first peer of a data-parallel group to ask for its k-th chunk gets the next
unassigned one, and that group's other peers (tp/pp) asking for their k-th get
the same, so collectives inside the method stay safe. A worker returns its
chunks' results concatenated and a *positions record*: the input ranges
``[(start, stop), ...]`` they cover, in the order it ran them.
:func:`in_input_order` puts the outputs back in input order;
:func:`locate_positions` tells a consumer which outputs (and which parts of
them) cover a window of input positions.

Example: 10 items in chunks of 3 over 2 groups, group 1 faster::

    >>> chunk_bounds(10, 3)
    [(0, 3), (3, 6), (6, 9), (9, 10)]
    >>> a = ChunkAssigner(4, n_workers=2)
    >>> [a.ask(0, 0), a.ask(1, 0), a.ask(1, 1), a.ask(1, 2), a.ask(0, 1)]
    [0, 1, 2, 3, None]
    >>> in_input_order([[0, 1, 2], [3, 4, 5, 6, 7, 8, 9]], [[(0, 3)], [(3, 6), (6, 9), (9, 10)]])
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from .dispatch import batch_len, collect_sources, concat, take, worker_data_ranks

CHUNKS_PER_GROUP = 8  # chunk_size=None: about this many chunks per data-parallel group
DROPPED_KEPT = 1024  # how many ended calls a ChunkTable remembers (so a late ask is told "none")

Positions = list[tuple[int, int]]

class Completed(NamedTuple):
    """One item of a balanced call, as :meth:`LazyResult.as_completed` yields it.

    ``index``: its position in the call's input list; ``value``: the method's result for it;
    ``rank``: the data-parallel group that ran it; ``versions``: ``(first, last)``, the
    gang's weight version (syncs applied) when its chunk started and when it ended.
    """

    index: int
    value: Any
    rank: int
    versions: tuple[int, int]


def chunk_items(start: int, stop: int, value: Any, rank: int, versions: tuple[int, int]
                ) -> list[Completed]:
    """One finished chunk ``[start, stop)`` as one :class:`Completed` per item (a tuple
    result element-wise, as ``collect`` joins it).

    >>> chunk_items(4, 6, ([1, 2], "ab"), 0, (0, 1))[1]
    Completed(index=5, value=(2, 'b'), rank=0, versions=(0, 1))
    """
    return [Completed(i, _item(value, i - start), rank, versions) for i in range(start, stop)]


def _item(value: Any, i: int) -> Any:
    if isinstance(value, tuple):
        parts = [_item(v, i) for v in value]
        return type(value)(*parts) if hasattr(type(value), "_fields") else tuple(parts)
    return value[i]


def pick_chunk_size(n: int, groups: int, chunk_size: int | None = None) -> int:
    """The chunk size of a balanced call on ``n`` items over ``groups`` data-parallel groups.

    ``chunk_size`` if given; else ``ceil(n / (8 * groups))``: each group takes about 8
    chunks, so the last chunks even out a long tail while the cost per chunk (one small
    request to the dispatcher) stays a small fraction of the call.

    >>> pick_chunk_size(256, 4), pick_chunk_size(10, 4), pick_chunk_size(256, 4, 1)
    (8, 1, 1)
    """
    if chunk_size is not None:
        return int(chunk_size)
    return max(1, math.ceil(n / (CHUNKS_PER_GROUP * max(1, groups))))


def chunk_bounds(n: int, chunk_size: int) -> Positions:
    """``(start, stop)`` of each chunk of ``n`` items; the last one may be short.

    >>> chunk_bounds(7, 3)
    [(0, 3), (3, 6), (6, 7)]
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


def check_chunk_size(chunk_size: Any) -> None:
    """Raise ValueError unless ``chunk_size`` is None or a positive int.

    >>> check_chunk_size(4)
    >>> check_chunk_size(0)
    Traceback (most recent call last):
    ValueError: chunk_size must be None or a positive int, got 0
    """
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")


def check_result(result: Any, expected: int, where: str) -> int:
    """The batch length of one chunk's ``result``; ValueError naming ``where`` and both
    lengths unless it is ``expected`` (one result per item, as under ``slice_dp``). A tuple
    (several return values) is checked element by element, as ``collect`` joins it.

    >>> check_result([1, 2], 2, "M.f()"), check_result(([1, 2], ["a", "b"]), 2, "M.f()")
    (2, 2)
    >>> check_result([1], 2, "M.f()")
    Traceback (most recent call last):
    ValueError: M.f() (dispatch='balance'): returned 1 result(s) for a chunk of 2 item(s); it must return a list of the same length as its input
    """
    if isinstance(result, tuple):
        for element in result:
            check_result(element, expected, where)
        return expected
    try:
        got = batch_len(result)
    except (TypeError, ValueError):
        got = None
    if got != expected:
        shown = "a value without a length" if got is None else f"{got} result(s)"
        raise ValueError(f"{where} (dispatch='balance'): returned {shown} for a chunk of {expected} "
                         f"item(s); it must return a list of the same length as its input")
    return got


class ChunkAssigner:
    """Which chunk each data-parallel group runs as its k-th, for one balanced call.

    ``ask(group, k)``: the first peer of ``group`` to ask for its k-th chunk is
    given the next unassigned chunk (None once they run out); its peers asking
    for the same ``(group, k)`` get the same answer. ``done`` once the call's
    ``n_workers`` asking loops have each been told None (each has ended).

    Memory: with ``peers`` (the workers per group) known, an answer is kept only until
    every peer has had it, and a None is never kept (once the chunks have run out every
    later ask is None), so a call in flight holds the answers its slowest peers have yet
    to read, not one per chunk; ``peers`` 0 (unknown) keeps every answer.

    >>> a = ChunkAssigner(1, n_workers=2)
    >>> a.ask(0, 0), a.ask(0, 0), a.ask(0, 1), a.done, a.ask(0, 1), a.done
    (0, 0, None, False, None, True)
    >>> b = ChunkAssigner(3, n_workers=2, peers=2)
    >>> b.ask(0, 0), len(b.given), b.ask(0, 0), len(b.given)
    (0, 1, 0, 0)
    """

    def __init__(self, n_chunks: int, n_workers: int, peers: int = 0):
        self.n_chunks = n_chunks
        self.n_workers = n_workers
        self.peers = peers
        self.next = 0
        self.given: dict[tuple[int, int], list] = {}  # key -> [answer, peers yet to ask]
        self.ended = 0

    def ask(self, group: int, k: int) -> int | None:
        key = (group, k)
        kept = self.given.get(key)
        if kept is not None:
            index = kept[0]
            kept[1] -= 1
            if kept[1] == 0:
                del self.given[key]
        elif self.next < self.n_chunks:
            index = self.next
            self.next += 1
            if self.peers != 1:
                self.given[key] = [index, self.peers - 1 if self.peers else -1]
        else:
            index = None
            if not self.peers:
                self.given[key] = [None, -1]
        if index is None:
            self.ended += 1
        return index

    @property
    def done(self) -> bool:
        return self.ended >= self.n_workers


class ChunkTable:
    """One gang's balanced calls in flight (call number -> :class:`ChunkAssigner`).

    An entry is made by the first ask of a call and dropped when every worker's
    loop has ended, when the call fails (``drop``) or when the gang goes
    (``clear``); an ask for a dropped call is answered None, so no chunk ever
    runs twice. Memory: the calls in flight, plus the numbers of the last
    ``DROPPED_KEPT`` ended ones.

    >>> t = ChunkTable()
    >>> t.ask(7, 0, 0, n_chunks=2, n_workers=1), t.ask(7, 0, 1, 2, 1), t.ask(7, 0, 2, 2, 1)
    (0, 1, None)
    >>> len(t), t.ask(7, 0, 0, 2, 1)   # ended: never handed out again
    (0, None)
    """

    def __init__(self) -> None:
        self.calls: dict[int, ChunkAssigner] = {}
        self.ended: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.calls)

    @property
    def answers(self) -> int:
        """The answers kept for peers yet to read them, over every call in flight."""
        return sum(len(a.given) for a in self.calls.values())

    def ask(self, seq: int, group: int, k: int, n_chunks: int, n_workers: int,
            peers: int = 0) -> int | None:
        if seq in self.ended:
            return None
        a = self.calls.get(seq)
        if a is None:
            a = self.calls[seq] = ChunkAssigner(n_chunks, n_workers, peers)
        index = a.ask(group, k)
        if a.done:
            self.drop(seq)
        return index

    def ask_many(self, seq: int, group: int, ks: list[int], n_chunks: int, n_workers: int,
                 peers: int = 0) -> list[int | None]:
        """:meth:`ask` for each of ``ks`` in order (a group with several free slots asks for
        them in one request).

        >>> t = ChunkTable()
        >>> t.ask_many(3, 0, [0, 1, 2], n_chunks=2, n_workers=1), len(t)
        ([0, 1, None], 0)
        """
        return [self.ask(seq, group, k, n_chunks, n_workers, peers) for k in ks]

    def drop(self, seq: int) -> None:
        """The call ended (or failed): forget it; later asks for it get None."""
        self.calls.pop(seq, None)
        self.ended[seq] = None
        while len(self.ended) > DROPPED_KEPT:
            self.ended.popitem(last=False)

    def clear(self) -> None:
        """The gang went: every call in flight ends."""
        for seq in list(self.calls):
            self.drop(seq)


def take_items(value: Any, start: int, stop: int) -> Any:
    """Items ``[start, stop)`` of a balanced result (element-wise for a tuple).

    >>> take_items(([1, 2, 3], ["a", "b", "c"]), 1, 3)
    ([2, 3], ['b', 'c'])
    """
    if isinstance(value, tuple):
        parts = [take_items(v, start, stop) for v in value]
        return type(value)(*parts) if hasattr(type(value), "_fields") else tuple(parts)
    return take(value, start, stop)


def join_items(parts: list) -> Any:
    """Chunk results joined along their items (element-wise for tuples); one part as it is.

    >>> join_items([([1], [2]), ([3], [4])])
    ([1, 3], [2, 4])
    """
    if len(parts) == 1:
        return parts[0]
    if parts and isinstance(parts[0], tuple):
        joined = [join_items([p[k] for p in parts]) for k in range(len(parts[0]))]
        return type(parts[0])(*joined) if hasattr(type(parts[0]), "_fields") else tuple(joined)
    return concat(parts)


def _pieces(positions: list[Positions]) -> list[tuple[int, int, int, int]]:
    """(start, stop, output, offset in it) per chunk, by start; tp/pp peers' copies once."""
    seen: dict[int, tuple[int, int, int, int]] = {}
    for w, pos in enumerate(positions):
        off = 0
        for start, stop in pos or ():
            if start not in seen:
                seen[start] = (start, stop, w, off)
            off += stop - start
    pieces = [seen[s] for s in sorted(seen)]
    at = 0
    for start, stop, _, _ in pieces:
        if start != at:
            raise ValueError(f"balanced outputs do not cover input positions [{at}, {start})")
        at = stop
    return pieces


def total_items(positions: list[Positions]) -> int:
    """How many input items the outputs of a balanced call cover.

    >>> total_items([[(0, 2)], [(2, 3)], [(0, 2)]])
    3
    """
    return max((stop for pos in positions for _, stop in pos or ()), default=0)


def locate_positions(positions: list[Positions], start: int, stop: int
                     ) -> list[tuple[int, tuple[int, int]]]:
    """The outputs (and the ranges inside them) holding input items ``[start, stop)``, in
    input order: what a consumer's window of a balanced result needs.

    >>> locate_positions([[(0, 2), (4, 6)], [(2, 4)]], 1, 5)
    [(0, (1, 2)), (1, (0, 2)), (0, (2, 3))]
    """
    out = []
    for s, e, w, off in _pieces(positions):
        lo, hi = max(start, s), min(stop, e)
        if lo < hi:
            out.append((w, (off + lo - s, off + hi - s)))
    return out


def group_readers(n_workers: int, mesh: Any = None, gpus_per_worker: int = 1) -> dict[int, int]:
    """Data rank -> the worker whose results stand for that data-parallel group in a balanced
    call: its first worker on the last pipeline stage (what ``collect='last_pp'`` reads; the
    group's first worker without pp). Its tp/pp peers run the same chunks, but an earlier
    stage's results are not the group's.

    >>> from twinkle_ray.core.mesh import DeviceMesh
    >>> group_readers(4, DeviceMesh.from_sizes(dp_size=2, pp_size=2))
    {0: 2, 1: 3}
    >>> group_readers(4, DeviceMesh.from_sizes(dp_size=2, tp_size=2)), group_readers(2)
    ({0: 0, 1: 2}, {0: 0, 1: 1})
    """
    _, data_ranks = worker_data_ranks(n_workers, mesh, gpus_per_worker)
    picks = collect_sources("last_pp", list(range(n_workers)), device_mesh=mesh,
                            gpus_per_worker=gpus_per_worker)
    return {data_ranks[k]: k for k in picks}


def in_input_order(outputs: list, positions: list[Positions]) -> Any:
    """Join a balanced call's per-worker outputs in input order (item i at position i).

    ``outputs[w]`` is worker w's chunks' results concatenated, ``positions[w]``
    their input ranges; a worker that ran no chunk has ``[]`` positions (its
    output is ignored). tp/pp peers hold the same chunks: one copy is used.

    >>> in_input_order([[2, 3], None, [0, 1]], [[(2, 4)], [], [(0, 2)]])
    [0, 1, 2, 3]
    """
    return join_items([take_items(outputs[w], a, b) for w, (a, b) in
                       locate_positions(positions, 0, total_items(positions))])


def run_local(fn: Callable, args: tuple, kwargs: dict, chunk_size: int | None, where: str) -> Any:
    """A balanced method run in-process (local mode): chunk by chunk, in input order, with
    the same checks as in a gang of one data-parallel group. Top-level list arguments are
    chunked; other values go whole to every chunk.

    >>> run_local(lambda xs, k: [x * k for x in xs], ([1, 2, 3],), {"k": 10}, 2, "f()")
    [10, 20, 30]
    """
    n = list_length(args, kwargs, where)
    results = []
    for start, stop in chunk_bounds(n, pick_chunk_size(n, 1, chunk_size)):
        a = tuple(v[start:stop] if isinstance(v, list) else v for v in args)
        kw = {k: v[start:stop] if isinstance(v, list) else v for k, v in kwargs.items()}
        out = fn(*a, **kw)
        if inspect.isawaitable(out):  # an async def method: run here, one chunk at a time
            out = asyncio.run(_awaited(out))
        check_result(out, stop - start, where)
        results.append(out)
    return join_items(results)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def pull_schedule(lengths: list[float], slots: int) -> tuple[float, float]:
    """(makespan, first finish) of the zero-overhead pull: each request, in input order, to
    the first free of ``slots`` slots, at no cost per request (B11's yardstick).

    >>> pull_schedule([3, 1, 1, 1], 2)
    (3.0, 1.0)
    """
    import heapq

    free = [0.0] * slots
    first, end = math.inf, 0.0
    for length in lengths:
        start = heapq.heappop(free)
        done = start + length
        first, end = min(first, done), max(end, done)
        heapq.heappush(free, done)
    return end, first


def batch_sync_schedule(lengths: list[float], slots: int) -> float:
    """The makespan of the batch-synchronous loop: steps of ``slots`` requests in input
    order, each step waiting for its longest.

    >>> batch_sync_schedule([3, 1, 1, 1], 2)
    4
    """
    return sum(max(lengths[i:i + slots]) for i in range(0, len(lengths), slots))


def list_length(args: tuple, kwargs: dict, where: str) -> int:
    """The common length of the top-level list arguments of a balanced call; ValueError
    when there is none, they differ, or they are empty.

    >>> list_length(([1, 2], "x"), {"b": [3, 4]}, "f()")
    2
    """
    lengths = {p: len(v) for p, v in [*enumerate(args), *kwargs.items()] if isinstance(v, list)}
    if not lengths:
        raise ValueError(f"{where}: dispatch='balance' needs a list argument to cut into chunks")
    if len(set(lengths.values())) > 1:
        found = ", ".join(f"argument {p!r}: {n}" for p, n in lengths.items())
        raise ValueError(f"{where}: dispatch='balance' cuts every list argument the same way, but "
                         f"their lengths differ ({found})")
    n = next(iter(lengths.values()))
    if n == 0:
        raise ValueError(f"{where}: dispatch='balance' got an empty batch")
    return n
