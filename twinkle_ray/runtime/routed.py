"""Routed arguments in the runtime: the dispatcher hands each rank the facts, the rank the value.

A LazyResult argument reaches a call's dispatcher as a slot (a
:class:`~twinkle_ray.runtime.wire.Route`). The dispatcher (:class:`Routes`) finds the
producer's :class:`~twinkle_ray.runtime.reply.Reply` (its own recent call's, the one the
sender had at hand, or the producer call's reply ref, which its dispatcher answered as
soon as it submitted the call: never a wait on the producer's *outputs*), and gives each
rank's task a :class:`RouteIn` per slot and the refs of the outputs' records.

The rank (:class:`Slots`) computes the value with the one rule,
:class:`~twinkle_ray.core.routing.Routed`: from the records, only the outputs its part is
made of are fetched, pulled from the producers' object stores, never through the driver
or a dispatcher.

**Records are top-level task arguments, outputs are not.** Every rank's task takes the
records of *every* output of every routed input as top-level arguments (``run(task, tops,
*records)``): Ray resolves them before the method starts, without a borrowed ref, an
owner round trip or a ``ray.get`` in the rank (a record is a few bytes, inlined in the
task). A record fails exactly when its output does (the producer's two returns), and every
rank waits for all of them, so a producer's error or death fails every rank of the call
alike, before any of them runs: none is left in a collective. The outputs travel nested
(the refs of those a rank most likely reads, and the reply they are all in): each rank
pulls only the outputs its part covers, inside its call, so an output one rank cannot
have (one it cannot unpickle) fails that rank like any call, seen by its dispatcher (its
stuck check) while its peers may be in a collective, and names the producer.

Example (in a rank)::

    slots = Slots(task.routes, task.split, "step", "trainer", records)
    args, kwargs = wire.decode(task, tops, slots.value)
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from collections import OrderedDict, deque
from typing import Any, NamedTuple

import numpy as np
import ray
from ray.exceptions import (
    ObjectFetchTimedOutError,
    ObjectLostError,
    RayActorError,
    RayError,
    RaySystemError,
)

from ..core.dispatch import Split, is_tensor, slice_length
from ..core.routing import Routed, Source, likely_needed
from .diagnose import OUTPUT_REFS, GangRef, fetch, fetch_timed_out
from .reply import Reply
from .wire import PUT_BYTES, Route, contiguous_format, partial_view

# The replies of this many recent calls are kept, each for RECENT_KEEP_S after it was
# submitted, so a call chained right after one of them finds its producer's refs here. A
# kept reply holds its outputs alive (this actor owns them), so it is kept only while such a
# chained call can be on its way: an idle gang pins nothing its callers dropped.
RECENT_REPLIES = 8
RECENT_KEEP_S = 2.0


# Collect modes whose join never reads the producer's mesh ('last_pp', 'last_pp_first' and
# callables do).
MESH_FREE = ("none", "flatten", "first", "mean", "sum")


class RouteIn(NamedTuple):
    """What a rank's task carries of one routed argument (see the module docstring)."""

    mode: Any  # the producer's collect mode; a callable pickled (bytes, or their ref when large)
    workers: list[int]  # producer gang rank of each output
    mesh: Any = None  # the producer's mesh ('last_pp')
    gpus_per_worker: int = 1
    balanced: bool = False
    # where the outputs' records start among the task's top-level records (one per output,
    # in output order); None: not kept
    records: int | None = None
    hints: dict[int, Any] = {}  # output -> its ref, for the outputs the rank likely reads
    reply_ref: Any = None  # the producer's reply: the refs of outputs not among the hints
    refs: list | None = None  # those refs themselves, when there is no reply ref to read
    producer: GangRef | None = None  # named in errors (no dispatcher handle: kept small)
    method: str = ""
    cut: bool = False
    location: str = "argument"


class Routes:
    """The dispatcher's side of routing (plain Python, owned by its dispatcher)."""

    def __init__(self, own: GangRef):
        self.own = own  # this gang, the producer of its own LazyResults
        # turn -> reply of a recent call of this gang (see RECENT_REPLIES)
        self.recent: OrderedDict[tuple[str, int], Reply] = OrderedDict()
        # (group, class) -> (dispatcher, the method last routed from it) of the gangs whose
        # outputs this gang took as inputs: a death of one of their workers can fail this gang's
        # calls, and they know which of theirs it was
        self.producers: dict[tuple[str, str], tuple[Any, str]] = {}
        # when each kept reply is dropped (loop time), oldest first: one timer at a time
        # sweeps them (a timer per call cost the chain ~3% of this actor's time)
        self._drop_at: deque[tuple[tuple[str, int], float]] = deque()
        self._sweeping = False
        # producer -> the GangRef a rank's task names it by (no handle): made once each
        self._named: dict[tuple, GangRef] = {}

    def remember(self, turn: tuple[str, int] | None, reply: Reply) -> None:
        """Keep a call's reply for calls chained right after it (a timer drops it)."""
        if turn is None:
            return
        loop = asyncio.get_running_loop()
        self.recent[turn] = reply
        self._drop_at.append((turn, loop.time() + RECENT_KEEP_S))
        if len(self.recent) > RECENT_REPLIES:
            self.recent.popitem(last=False)
        while len(self._drop_at) > RECENT_REPLIES:  # (dropped from ``recent`` already)
            self._drop_at.popleft()
        if not self._sweeping:
            self._sweeping = True
            loop.call_later(RECENT_KEEP_S, self._sweep)

    def _sweep(self) -> None:
        """Drop the kept replies whose time is up; come back for the next one, if any."""
        now = asyncio.get_running_loop().time()
        while self._drop_at and self._drop_at[0][1] <= now:
            self.recent.pop(self._drop_at.popleft()[0], None)
        self._sweeping = bool(self._drop_at)
        if self._sweeping:
            asyncio.get_running_loop().call_later(self._drop_at[0][1] - now, self._sweep)

    def named(self, producer: GangRef) -> GangRef:
        """``producer`` as a rank's task names it: without its dispatcher's handle (kept small)."""
        key = (producer.group, producer.cls_name, producer.label, producer.namespace)
        got = self._named.get(key)
        if got is None:
            if len(self._named) >= RECENT_REPLIES * 8:  # bounded (gangs made and gone)
                self._named.clear()
            got = self._named[key] = GangRef(producer.group, producer.cls_name, dispatcher=None,
                                             label=producer.label, namespace=producer.namespace)
        return got

    async def resolve(self, route: Route) -> tuple[Reply, GangRef]:
        """The producer's reply (refs at hand) and its GangRef. Lost with the producer's
        dispatcher: a WorkerDiedError naming it (never Ray's raw error, which would blame
        this gang's call)."""
        producer = route.gang if route.gang is not None else self.own
        if route.gang is not None and route.gang.dispatcher is not None:
            self.producers[(route.gang.group, route.gang.cls_name)] = (route.gang.dispatcher,
                                                                       route.method)
        reply = route.reply or (self.recent.get(route.turn) if route.gang is None else None)
        try:
            if reply is None:
                reply = await route.reply_ref
            if reply.bundle is not None:
                reply = reply.unpacked(await reply.bundle)
        except (RayActorError, ObjectLostError) as e:
            raise producer.reply_lost(e, route.method) from None
        return reply, producer

    def shared(self, resolved: list[tuple[Route, Reply, GangRef]]) -> tuple[list, list]:
        """What every rank's task of a call shares of its routed inputs, made once per call:
        (per slot: its RouteIn without hints, its Source, its output refs; the refs of every
        output's record, the tasks' top-level records)."""
        slots, records = [], []
        for route, reply, producer in resolved:
            source = Source(route.collect, None, reply.workers, producer.mesh,
                            producer.gpus_per_worker, reply.balanced)
            at = None
            if reply.records:
                at = len(records)
                records.extend(reply.records)
            # the mesh only where the join reads it: pickling one costs more than the rest of
            # a rank's task together (the dispatcher's time per call bounds a chain of calls)
            mesh = None if route.collect in MESH_FREE else producer.mesh
            base = RouteIn(
                route.collect, list(reply.workers), mesh, producer.gpus_per_worker,
                reply.balanced, at, reply_ref=route.reply_ref,
                producer=self.named(producer),
                method=route.method, cut=route.cut, location=route.location)
            slots.append((base, source, reply.refs))
        return slots, records

    @staticmethod
    def for_rank(slots: list, split: Split | None) -> tuple:
        """One rank's RouteIn per slot (``slots`` from :meth:`shared`): the shared part with
        the refs of the outputs this rank's part most likely covers."""
        return tuple(base._replace(hints={k: refs[k] for k in likely_needed(
            source, split if base.cut else None)}) for base, source, refs in slots)


class Slots:
    """A rank's routed arguments: ``value(j)`` is slot ``j``'s value (see the module docstring).

    ``records``: the task's top-level records (the values of the outputs' records, resolved
    by Ray before the call; see the module docstring).
    """

    def __init__(self, routes: tuple, split: Split | None, method: str, group: str,
                 records: tuple = ()):
        self.routes, self.split, self.records = routes, split, records
        self.method, self.group = method, group
        self._routed: dict[int, Routed] = {}
        self._given: set[int] = set()  # the slots whose value was given out once already
        self._slice_len: int | None = None

    def routed(self, j: int) -> Routed:
        r = self._routed.get(j)
        if r is None:
            rin: RouteIn = self.routes[j]
            mode = rin.mode
            if isinstance(mode, ray.ObjectRef):  # a large callable, put by the caller
                mode = ray.get(mode)
            mode = pickle.loads(mode) if isinstance(mode, bytes) else mode
            records = None if rin.records is None else list(
                self.records[rin.records:rin.records + len(rin.workers)])
            source = Source(mode, records, rin.workers, rin.mesh, rin.gpus_per_worker,
                            rin.balanced)
            r = self._routed[j] = Routed(source, lambda ks, rin=rin: self._fetch(rin, ks),
                                         windowed=as_concatenated)
        return r

    def value(self, j: int) -> Any:
        """Slot ``j``'s value, as the fetched value passed would arrive. Each argument the
        slot is in gets objects of its own (each passed argument is unpickled on its own):
        ``f(x, x)`` gets two values, never one object in both places; within one argument
        the slot is unpickled once (pickle's memo), as the passed value would be."""
        rin: RouteIn = self.routes[j]
        split = self.split if rin.cut else None
        if split is not None and split.mode == "slice":
            split = split._replace(slice_len=self._common_length())
        again = j in self._given
        self._given.add(j)
        return as_passed(self.routed(j).part(split, rin.location, again))

    def _common_length(self) -> int | None:
        """Under 'slice', every list cut has one length: the plain list arguments' (the
        caller's), and each routed value's (the rule cuts it as it would the fetched value)."""
        if self._slice_len is None:
            lengths = {} if self.split.slice_len is None else {
                "the list arguments": self.split.slice_len}
            for j, rin in enumerate(self.routes):
                if rin.cut:
                    lengths.update(self.routed(j).list_lengths(rin.location))
            self._slice_len = slice_length(lengths, self.method, self.group)
        return self._slice_len

    def _fetch(self, rin: RouteIn, ks: list[int]) -> list:
        """Outputs ``ks``, pulled from the producers' object stores in one ``ray.get``."""
        refs = rin.refs
        if refs is None and any(k not in rin.hints for k in ks):
            try:
                refs = ray.get(rin.reply_ref).unpacked().refs
            except ObjectFetchTimedOutError as e:  # Ray found no copy in time: not a death
                raise fetch_timed_out(e, rin.producer, rin.method, None, OUTPUT_REFS) from None
            except RayError as e:
                raise rin.producer.reply_lost(e, rin.method) from None
        return pull([rin.hints[k] if k in rin.hints else refs[k] for k in ks], rin.producer,
                    rin.method, [rin.workers[k] for k in ks])


def _asking(producer: GangRef) -> GangRef:
    """``producer`` with its dispatcher, found by name (a task carries no handle): on a
    death, the dispatcher names the gang's first one, not the rank whose output this rank
    happened to read (torn down after it)."""
    if producer.dispatcher is not None or producer.label is None:
        return producer
    try:
        handle = ray.get_actor(producer.label, namespace=producer.namespace)
    except ValueError:  # gone: named from what this rank saw
        return producer
    return dataclasses.replace(producer, dispatcher=handle)


def as_passed(value: Any) -> Any:
    """``value`` with each numpy array and tensor as the same value passed would arrive (the
    wire's rules, :mod:`~twinkle_ray.runtime.wire`):

    - an array of ``PUT_BYTES`` or more is put and fetched zero-copy: read-only;
    - a smaller one travels in the task's pickle (protocol 5, in band), which keeps its
      writeable flag: a window of a fetched output (read-only) stays read-only, a joined one
      (a new array) writable;
    - an array neither C- nor F-contiguous (or of objects) is pickled by value: a writable
      C-ordered copy, whatever its size;
    - a tensor that is a view of a larger storage is pickled as a contiguous copy of its
      own elements.

    Lists and dicts are the rank's own: changed in place.

    >>> a = np.zeros(3); a.flags.writeable = False
    >>> as_passed([a])[0].flags.writeable, as_passed([a[::2]])[0].flags.writeable
    (False, True)
    """
    if type(value) is np.ndarray:
        flags = value.flags
        if value.dtype.hasobject or not (flags.c_contiguous or flags.f_contiguous):
            if flags.writeable and (flags.c_contiguous or flags.f_contiguous):
                return value  # objects, contiguous and writable: as unpickled
            return np.array(value, order="C")  # numpy pickles it by value
        if value.nbytes >= PUT_BYTES and flags.writeable:
            value = value.view()
            value.flags.writeable = False
        return value
    if is_tensor(value):
        return _same_tensor(value)
    if isinstance(value, list):
        for i, v in enumerate(value):
            if type(v) not in _ATOMS and _carries_arrays(v):
                value[i] = as_passed(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            if type(v) not in _ATOMS and _carries_arrays(v):
                value[k] = as_passed(v)
    elif isinstance(value, tuple):
        items = [as_passed(v) for v in value]
        if any(x is not y for x, y in zip(items, value, strict=True)):
            return type(value)(*items) if hasattr(type(value), "_fields") else type(value)(items)
    return value


_ATOMS = frozenset({int, float, str, bool, bytes, type(None)})


def _carries_arrays(v: Any) -> bool:
    return isinstance(v, list | dict | tuple) or type(v) is np.ndarray or is_tensor(v)


def _same_tensor(t: Any) -> Any:
    """Tensor ``t`` as the wire delivers it: a view of a larger storage is sent as a contiguous
    copy of its own elements (``wire.Pickler``); any other keeps its strides."""
    if partial_view(t):
        return t.clone(memory_format=contiguous_format())
    return t


def as_concatenated(value: Any) -> Any:
    """A window of one output standing for the same window of a fresh concatenation (the real
    join's new array: C-ordered, writable; a join with a Fortran-ordered output is never
    windowed, :class:`~twinkle_ray.core.routing.Joined`), as :func:`as_passed` then treats it: an array
    copied only when passing would not give a read-only zero-copy view anyway; a tensor
    made contiguous."""
    if isinstance(value, np.ndarray):
        if value.flags.c_contiguous and value.nbytes >= PUT_BYTES and not value.dtype.hasobject:
            return value  # put when passed: read-only, C-ordered (as_passed)
        return np.array(value, order="C")
    if is_tensor(value):
        return value.contiguous()
    return value


def pull(refs: list, producer: GangRef, method: str, ranks: list) -> list:
    """The values of a producer's outputs in a consumer; a failed producer is named, not hidden.

    One ``ray.get``. On a failure, the caller's rules (:func:`~twinkle_ray.runtime.diagnose.fetch`):
    a producer worker that died anywhere makes this raise the producer gang's
    WorkerDiedError (group, class, rank), whatever another rank raised; else a producer's own
    exception is re-raised as itself with a note naming the producer; an output this worker
    cannot unpickle raises TypeError saying why (as an argument that cannot be unpickled).
    """
    try:
        return ray.get(refs)
    except RayError:
        pass
    where = f"an output of {producer.cls_name}.{method}() on group '{producer.group}'"
    try:
        return fetch(refs, ranks, _asking(producer), method, None)
    except RaySystemError as e:  # Ray's wrapper of an unpickling error
        why = e.client_exc if isinstance(e.client_exc, BaseException) else None
        raise TypeError(f"{where} cannot be unpickled in this Ray worker "
                        f"({f'{type(why).__name__}: {why}' if why else str(e).splitlines()[0]})"
                        f": the call did not run") from None
    except Exception as err:  # a death, the producer's own error
        err.add_note(f"while fetching {where} as an input")
        raise
