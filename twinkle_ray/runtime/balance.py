"""``dispatch='balance'`` on a gang: chunks handed to whichever data-parallel group is free.

How a balanced call runs (the pure rules are in :mod:`twinkle_ray.core.balance`):

1. **The caller** (:func:`split`, in the proxy) replaces each top-level list
   argument by a :class:`Chunks` marker: its chunks inline when the list is
   small, else one ``ray.put`` per chunk (never the whole batch to every
   worker). Each data-parallel group gets a :class:`BalanceHead`: its group,
   the number of groups, the chunk size asked for, and where the LazyResult
   arguments are (those are routed whole to the worker and chunked there).
2. **The dispatcher** takes the call like any other: one place in the gang's
   order, one task per worker (``GangWorker.run``, the head in its task),
   submitted at once. It waits for nothing; while the call runs it answers the
   workers' ``next_chunk`` asks from its
   :class:`~twinkle_ray.core.balance.ChunkTable` (a method that never blocks).
3. **Each worker** (:func:`run_chunks`) loops inside its one task: ask for its
   k-th chunk, run the method on it, check one result per item; the first
   peer of a group to ask gets the next free chunk and its tp/pp peers the
   same one. No other call runs on a rank between a balanced call's chunks.
   It returns its results concatenated and, as its record, its positions
   record ``[(start, stop), ...]`` (:func:`~twinkle_ray.core.routing.record_balanced`).
4. **Join**: the results in input order
   (:func:`~twinkle_ray.core.balance.in_input_order`), by the one rule of
   :mod:`twinkle_ray.core.routing`, for ``get()`` and for a consumer gang
   alike (a consumer rank pulls only the outputs covering its part).

Faults are those of any call: a death fails the call with WorkerDiedError
(the gang's teardown ends the chunk table, so no chunk runs twice, and with
``max_restarts`` the call is not re-run); a raising chunk ends the call's
handing out (the other groups stop at their next ask) and the error is raised
with its type. Only the failed rank's tp/pp peers are checked for ranks stuck in
a collective (the gang's ``stuck_grace_s``): its data-parallel groups run their
own chunks and never share one, but a group's peers do.

Example::

    @remote_class()
    class Sampler:
        @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
        def generate(self, prompts: list) -> list:
            return [self.engine.generate(p) for p in prompts]

    texts = sampler.generate(prompts)()   # texts[i] answers prompts[i]
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import types
from dataclasses import dataclass
from typing import Any

import ray

from ..core.balance import (
    check_result,
    chunk_bounds,
    group_readers,
    join_items,
    list_length,
    pick_chunk_size,
)
from ..core.dispatch import worker_data_ranks
from ..core.functions import RemoteFunction
from ..core.routing import record_balanced
from .diagnose import GangRef
from .wire import PUT_BYTES, Pickler, Routable

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class BalanceHead:
    """The first argument of each worker's balanced task: what its chunk loop needs."""

    group: int  # this worker's data-parallel group (its data rank)
    groups: int  # the number of data-parallel groups
    chunk_size: int | None  # as asked (None: core.balance.pick_chunk_size decides)
    lazy: tuple = ()  # positions (int) / names (str) of the LazyResult arguments
    where: str = "?"  # 'Class.method()' for errors
    in_flight: int = 1  # chunks a group keeps running at once (an async def method)
    peers: int = 0  # the workers of this data-parallel group (0: not known)
    # the gang rank whose results stand for the group (its first on the last pp stage:
    # core.balance.group_readers); its peers return none (None: every worker its own)
    reader: int | None = None
    max_staleness: int | None = None  # versions an item may fall behind before it is re-run


@dataclass
class Chunks:
    """A list argument cut into chunks: ``pieces[j]`` is chunk j (its items, or an ObjectRef
    of them), covering ``bounds[j]`` of the input."""

    n: int
    bounds: list[tuple[int, int]]
    pieces: list

    def piece(self, j: int) -> Any:
        p = self.pieces[j]
        return ray.get(p) if isinstance(p, ray.ObjectRef) else p


def split(name: str, spec: RemoteFunction, gang: GangRef, execute: str, args: tuple,
          kwargs: dict) -> tuple[list[tuple[tuple, dict]], list[BalanceHead]]:
    """(each worker's (args, kwargs), each worker's head) of a balanced call, made by the
    caller (see step 1). ValueError for a gang whose class runs on its first worker only, for
    ``in_flight`` above 1 on a gang with tp/pp peers, and for list arguments of different
    lengths."""
    where = f"{gang.cls_name}.{name}()"
    if execute != "all":
        raise ValueError(f"{where} on group '{gang.group}': dispatch='balance' with "
                         f"execute={execute!r} (the gang's remote_class) is not supported: a "
                         f"balanced call runs on every data-parallel group")
    groups, data_ranks = worker_data_ranks(gang.n_workers, gang.mesh, gang.gpus_per_worker, name,
                                           gang.group)
    peers = max(data_ranks.count(d) for d in set(data_ranks))
    if spec.in_flight > 1 and peers > 1:
        raise ValueError(f"{where} on group '{gang.group}': in_flight={spec.in_flight} with "
                         f"{peers} workers per data-parallel group (tp/pp peers) is refused: "
                         f"each peer would start its chunks in its own order and their "
                         f"collectives would mismatch; use in_flight=1, or one worker per data "
                         f"rank (a tp engine is one worker with gpus_per_worker)")
    lazy = tuple(p for p, v in [*enumerate(args), *kwargs.items()] if isinstance(v, Routable))
    has_list = any(isinstance(v, list) for v in [*args, *kwargs.values()])
    if has_list or not lazy:
        n = list_length(args, kwargs, f"{where} on group '{gang.group}'")
        bounds = chunk_bounds(n, pick_chunk_size(n, groups, spec.chunk_size))
        cut = {}

        def chunked(v: Any) -> Any:
            if not isinstance(v, list):
                return v
            if id(v) not in cut:
                pieces = [v[s:e] for s, e in bounds]
                if _large(v):  # one put per chunk: never the whole batch to every worker
                    pieces = [ray.put(p) for p in pieces]
                cut[id(v)] = Chunks(n, bounds, pieces)
            return cut[id(v)]

        args = tuple(chunked(v) for v in args)
        kwargs = {k: chunked(v) for k, v in kwargs.items()}
    readers = group_readers(gang.n_workers, gang.mesh, gang.gpus_per_worker)
    heads = {d: BalanceHead(d, groups, spec.chunk_size, lazy, where, spec.in_flight,
                            data_ranks.count(d), reader=readers[d],
                            max_staleness=spec.max_staleness) for d in set(data_ranks)}
    return [(args, kwargs)] * len(data_ranks), [heads[d] for d in data_ranks]


def _large(value: list) -> bool:
    """Whether ``value`` pickles to PUT_BYTES or more (one holding refs: put, Ray counts them)."""
    try:
        return len(Pickler.dumps_plain(value)) >= PUT_BYTES
    except Pickler.HasRefs:
        return True


def run_chunks(worker: Any, task: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """A worker's loop over the chunks of one balanced call (see step 3): returns (its
    results concatenated in the order they finished, or None when it ran no chunk; its
    record: their positions, in the same order). An ``async def`` method runs on the
    worker's own event loop with ``in_flight`` chunks at once (:func:`_pump`); each finished
    chunk is also noted in the worker's stream book for ``LazyResult.as_completed``."""
    head: BalanceHead = task.balance
    fn = _raw_method(worker.instance, task.method)
    n, bounds = None, None
    for v in [*args, *kwargs.values()]:
        if isinstance(v, Chunks):
            n, bounds = v.n, v.bounds
    # routed values came whole: cut here, as the caller cuts a passed value (a list is cut
    # into the chunks, anything else goes whole to every chunk)
    routed = {key: args[key] if isinstance(key, int) else kwargs[key] for key in head.lazy}
    lists = {key for key, v in routed.items() if isinstance(v, list)}
    if bounds is None:
        n = list_length((), {repr(k): routed[k] for k in lists}, head.where)
        bounds = chunk_bounds(n, pick_chunk_size(n, head.groups, head.chunk_size))
    for key in lists:
        if len(routed[key]) != n:
            raise ValueError(f"{head.where} (dispatch='balance'): argument {key!r} has "
                             f"{len(routed[key])} items, the list arguments {n}")

    def cut_args(j: int, fetched: dict | None = None) -> tuple[tuple, dict]:
        """Chunk j's arguments (``fetched``: the values of put pieces, by argument)."""
        s, e = bounds[j]

        def cut(key, v):
            if isinstance(v, Chunks):
                return fetched[key] if fetched and key in fetched else v.piece(j)
            return v[s:e] if key in lists else v

        return (tuple(cut(i, v) for i, v in enumerate(args)),
                {q: cut(q, v) for q, v in kwargs.items()})

    loop = Loop(worker, task, head, bounds, cut_args)
    loop.args, loop.kwargs = args, kwargs
    entry = worker.streams.open(task.seq)
    running = worker.running  # what a weight sync runs beside (made by GangWorker.run)
    try:
        if inspect.iscoroutinefunction(fn):
            worker.loop.run(_pump(loop, fn, max(1, head.in_flight), entry))
        else:
            k = 0
            while True:
                j = ray.get(loop.ask(k))
                if j is None:
                    break
                if running is not None:
                    running.between_chunks()  # a weight sync issued meanwhile lands here
                a, kw = cut_args(j)
                first = worker.versions.value
                out = fn(*a, **kw)
                loop.finished(j, out, (first, worker.versions.value), entry)
                k += 1
    except BaseException:
        entry.end(failed=True)
        raise
    entry.end()
    if head.reader is not None and head.reader != worker.info.rank:
        return None, record_balanced(None, [])  # a peer of its group's reader: not read
    value = join_items(loop.results) if loop.results else None
    return value, record_balanced(value, loop.positions)


class Loop:
    """One worker's state in one balanced call: how it asks, and what it has finished."""

    def __init__(self, worker: Any, task: Any, head: BalanceHead, bounds: list, cut_args: Any):
        self.worker, self.task, self.head, self.bounds = worker, task, head, bounds
        self.cut_args = cut_args
        self.args: tuple = ()  # the call's arguments (Chunks in place of the list ones)
        self.kwargs: dict = {}
        self.results: list = []
        self.positions: list[tuple[int, int]] = []

    def ask(self, k: int) -> Any:
        """The ref of the dispatcher's answer to this group's k-th ask (a chunk, or None). Each
        of a worker's ``in_flight`` asking loops stops at its first None, so the call's table
        entry ends once every worker has been told None that many times. The group's peer
        count goes with it, so an answer is dropped once every peer has read it."""
        info = self.worker.info
        return info.dispatcher.next_chunk.remote(
            info.generation, self.task.seq, self.head.group, k, len(self.bounds),
            info.world_size * max(1, self.head.in_flight), self.head.peers)

    def ask_many(self, ks: list[int]) -> Any:
        """The ref of the dispatcher's answers to this group's asks ``ks`` (one request)."""
        info = self.worker.info
        return info.dispatcher.next_chunks.remote(
            info.generation, self.task.seq, self.head.group, ks, len(self.bounds),
            info.world_size * max(1, self.head.in_flight), self.head.peers)

    def finished(self, j: int, out: Any, versions: tuple[int, int], entry: Any) -> None:
        """Chunk j's result ``out``, checked, kept (in finish order) and noted for streams with
        its ``versions`` (the gang's weight version when it started and ended)."""
        s, e = self.bounds[j]
        check_result(out, e - s, self.head.where)
        self.results.append(out)
        self.positions.append((s, e))
        entry.add([(s, e, out, versions)])


async def _pump(loop: Loop, fn: Any, in_flight: int, entry: Any) -> None:
    """Up to ``in_flight`` requests at once on the worker's event loop: whenever slots are
    free, one ask for that many chunks (``next_chunks``; never one before a slot is free: no
    chunk waits here in reserve), each run as its own task, the next ask the moment one
    finishes (pull: least in flight). Each slot stops at its first None; a worker that ran
    out asks for the Nones its remaining slots are owed in one last request, so the call's
    table entry ends once every worker has had ``in_flight`` of them. The first error
    cancels the other requests (they belong to the failed call) and is raised.

    ``max_staleness`` s: a request whose first version falls more than s behind the gang's
    (a weight sync landed while it ran) is cancelled and run again at once under the new
    weights; one that ends past s is run again too: never delivered stale."""
    asks = itertools.count()
    running: set[asyncio.Future] = set()
    ended = 0  # slots told None
    versions, s = loop.worker.versions, loop.head.max_staleness
    watched: dict[asyncio.Future, int] = {}  # a running request's abort flag -> its first version
    aborted = 0

    def on_version(v: int) -> None:  # on the loop's thread, after each version change
        for flag, first in list(watched.items()):
            if v - first > s and not flag.done():
                flag.set_result(None)

    async def bounded(coro: Any, first: int) -> tuple[bool, Any]:
        """(True, its value), or (False, None) when it was aborted stale (cancelled)."""
        req = asyncio.ensure_future(coro)
        flag = asyncio.get_running_loop().create_future()
        watched[flag] = first
        try:
            if versions.value - first > s:  # a sync landed before the flag was watched
                flag.set_result(None)
            await asyncio.wait({req, flag}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            req.cancel()
            raise
        finally:
            watched.pop(flag, None)
        if req.done():
            return True, req.result()
        req.cancel()  # vLLM: cancelling AsyncLLM.generate's iteration aborts the request
        await asyncio.gather(req, return_exceptions=True)
        return False, None

    async def one(j: int) -> None:
        nonlocal aborted
        # put pieces awaited, never fetched with a blocking get on the loop other requests share
        puts = {key: v.pieces[j] for key, v in [*enumerate(loop.args), *loop.kwargs.items()]
                if isinstance(v, Chunks) and isinstance(v.pieces[j], ray.ObjectRef)}
        fetched = dict(zip(puts, await asyncio.gather(*puts.values()), strict=True)) if puts else None
        a, kw = loop.cut_args(j, fetched)
        while True:
            first = versions.value
            if s is None:
                out = await fn(*a, **kw)
            else:
                ok, out = await bounded(fn(*a, **kw), first)
            last = versions.value  # read once: what is checked is what is delivered
            if s is not None and (not ok or last - first > s):
                aborted += 1  # stale: run again under the new weights, never delivered
                continue
            loop.finished(j, out, (first, last), entry)
            return

    listener = loop.worker.loop.listener(on_version) if s is not None else None
    if listener is not None:
        versions.listen(listener)
    try:
        while True:
            free = in_flight - len(running) - ended
            if free > 0 and (ended == 0 or not running):
                # asking again after a None only once the last request is done: the Nones owed
                for j in await loop.ask_many([next(asks) for _ in range(free)]):
                    if j is None:
                        ended += 1
                    else:
                        running.add(asyncio.ensure_future(one(j)))
            if not running:
                if ended >= in_flight:
                    return
                continue
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
    finally:
        if listener is not None:
            versions.unlisten(listener)
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        if aborted:
            logger.info("%s (call %s): %d request(s) aborted stale (max_staleness=%s) and run "
                        "again under the new weights", loop.head.where, loop.task.seq, aborted, s)


def runs_async(instance: Any, method: str) -> bool:
    """Whether a balanced call of ``method`` runs on the worker's event loop (``async def``)."""
    attr = getattr(type(instance), method, None)
    return inspect.iscoroutinefunction(attr.fn if isinstance(attr, RemoteFunction) else attr)


def _raw_method(instance: Any, method: str) -> Any:
    """The method as written (``remote_function``'s local chunking is for callers outside a
    gang; here the method gets the chunks themselves)."""
    attr = getattr(type(instance), method, None)
    if isinstance(attr, RemoteFunction) and attr.fn is not None:
        return types.MethodType(attr.fn, instance)
    return getattr(instance, method)
