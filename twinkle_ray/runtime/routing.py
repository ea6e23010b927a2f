"""Call planning: which ranks run a call and what message each one gets.

The dispatcher takes a call's turn and checks the gang's health; then the
:class:`Router` turns the call into a :class:`CallPlan` (the ranks that run
it and, per rank, the leading values and arguments of its
:class:`~twinkle_ray.runtime.message.WorkerCall`), and the dispatcher submits
the plan (one actor task per rank). Planning
routes LazyResult arguments without waiting for their values: only for the
producer's plan (refs), which its dispatcher returns at once, or which this
gang keeps for its own recent calls.

Example (what the dispatcher does)::

    router = Router(spec, own_gang)
    plan = await router.plan("forward", per_worker, "slice_dp", "all", None, 4, collect="flatten")
    messages = plan.messages(seq)          # one WorkerCall per rank in plan.targets
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ObjectLostError, RayActorError

from ..core.dispatch import worker_data_ranks
from ..core.routing import peer_workers
from . import balance
from .lazy import CallOutput, GangRef, LazyResult
from .message import WorkerCall
from .routed import Collected, Pieces, Window

# Plans of at most this many recent calls are kept, each for RECENT_KEEP_S after it was
# submitted, so routing one of them into a call chained right after it needs no fetch of the
# plan from the caller (who owns it). A kept plan holds its outputs alive (this actor owns
# them), so it is kept only while such a chained call can be on its way: an idle gang pins
# nothing its callers dropped. A call routed later awaits the plan's ref it carries instead.
RECENT_PLANS = 8
RECENT_KEEP_S = 2.0


@dataclass
class CallPlan:
    """One call, planned: the ranks that run it and each one's message (without its number)."""

    method: str
    targets: list[int]  # gang ranks that run the call, in order
    lead: list[tuple]  # per target: leading values (length records, aligned producer outputs)
    args: list[tuple]  # per target: positional arguments (routed markers in place of LazyResults)
    kwargs: list[dict]  # per target: keyword arguments
    with_meta: bool  # the outputs need a length record (see needs_lengths)
    balanced: bool = False  # dispatch='balance': each rank loops over chunks (runtime.balance)

    @property
    def named(self) -> bool:
        """Whether the call travels without a head (see :mod:`~twinkle_ray.runtime.message`):
        no target has leading values to count, it is not balanced (chunk requests name the
        call by its number), and the method's name has no ``.`` (the worker reads the method
        after the task name's last ``.``).

        >>> CallPlan("step", [0, 1], [(), ()], [(1,), (2,)], [{}, {}], True).named
        True
        >>> CallPlan("step", [0, 1], [(), ("ref",)], [(1,), (2,)], [{}, {}], True).named
        False
        """
        return not self.balanced and "." not in self.method and not any(self.lead)

    def messages(self, seq: int) -> list[WorkerCall]:
        """Each target's WorkerCall for gang call number ``seq``."""
        return [WorkerCall(self.method, seq, lead, args, kwargs)
                for lead, args, kwargs in zip(self.lead, self.args, self.kwargs, strict=True)]


def call_targets(execute: str, caller: tuple[int, int] | None, n: int) -> list[int]:
    """The gang ranks that run a call with this ``execute`` mode.

    >>> call_targets("first", None, 4), call_targets("all", None, 2), call_targets("peer", (1, 2), 4)
    ([0], [0, 1], [2, 3])
    """
    if execute == "first":
        return [0]
    if execute == "peer" and caller is not None:
        return peer_workers(caller[0], caller[1], n)
    return list(range(n))


def needs_lengths(collect: str | None, n_outputs: int) -> bool:
    """Whether routing these outputs slices them by their length records (see ``Router._route_one``).

    'flatten', 'none' and 'first' outputs are: by their lengths, element by
    element for tuples (several 'none' outputs are whole items, but a tuple's
    record says that they are joined element-wise). 'mean'/'sum'/'last_pp'/custom
    collects are collected whole in the consumer, then sliced.

    >>> needs_lengths("flatten", 4), needs_lengths("none", 4), needs_lengths("mean", 1)
    (True, True, False)
    """
    if collect is None:  # unknown: keep the records
        return True
    return collect in ("flatten", "none", "first")


class Router:
    """Plans one gang's calls; keeps the plans of its recent calls for chaining."""

    def __init__(self, spec: Any, own: GangRef):
        self.spec = spec
        self.own = own  # this gang, as producer of its own inputs (see sending.strip_own_gang)
        # turn -> the call's output (its refs), for routing it into later calls here
        self.recent: OrderedDict[tuple[str, int], CallOutput] = OrderedDict()
        self._data_ranks: dict[int, tuple[int, list[int]]] = {}  # gang size -> slice_dp layout
        # dispatchers of the gangs whose outputs this gang took as inputs: a death of one of
        # their workers can fail this gang's calls, and they know which of theirs it was
        self.producers: dict[tuple[str, str], Any] = {}

    def remember(self, turn: tuple[str, int] | None, out: CallOutput) -> None:
        """Keep a call's output for routing it into calls chained right
        after it here: the last RECENT_PLANS calls, each for RECENT_KEEP_S (a timer of the
        actor's loop drops it: nothing polls)."""
        if turn is None:
            return
        self.recent[turn] = out
        if len(self.recent) > RECENT_PLANS:
            self.recent.popitem(last=False)
        asyncio.get_running_loop().call_later(RECENT_KEEP_S, self.recent.pop, turn, None)

    async def plan(
        self,
        method: str,
        per_worker: list[tuple[tuple, dict]],
        dispatch: Any,
        execute: str,
        caller: tuple[int, int] | None,
        n: int,
        *,
        wait_meta: bool = False,
        collect: str | None = None,
    ) -> CallPlan:
        """Plan a call on a gang of ``n`` running workers (see the module docstring)."""
        targets = call_targets(execute, caller, n)
        if execute == "first":  # one worker runs it: it gets the value whole, as plain arguments are
            dispatch = "all"
        routes: dict[int, list] = {}
        lengths: list = []  # producers' length records: leading values of every message
        leads, argss, kwargss = [], [], []
        for i in targets:
            args, kwargs = per_worker[i] if len(per_worker) > 1 else per_worker[0]
            lead: tuple = ()  # the first target routes every LazyResult: its lengths are complete
            if _has_lazy(args, kwargs):
                args, kwargs = await self._route(method, args, kwargs, i, n, dispatch, routes, lengths)
                extra, args, kwargs = _with_aligned_slots(len(lengths), args, kwargs)
                lead = (*lengths, *extra)
            leads.append(lead)
            argss.append(args)
            kwargss.append(kwargs)
        balanced = dispatch == "balance"  # its positions records ride as the meta output
        return CallPlan(method, targets, leads, argss, kwargss,
                        wait_meta or balanced or needs_lengths(collect, len(targets)), balanced)

    async def _route(self, method, args, kwargs, i, n, dispatch, routes, lengths):
        async def one(v):
            if not isinstance(v, LazyResult):
                return v
            key = id(v)
            if key not in routes:
                routes[key] = await self._route_one(method, v, n, dispatch, lengths)
            return routes[key][i]

        new_args = tuple([await one(a) for a in args])
        new_kwargs = {k: await one(v) for k, v in kwargs.items()}
        return new_args, new_kwargs

    async def _route_one(self, method: str, lazy: LazyResult, n: int, dispatch: Any,
                         lengths: list) -> list:
        """One routed marker per worker of this gang for the LazyResult ``lazy``.

        Waits for nothing but the producer's plan (its dispatcher returns that
        at once; this gang's own recent plans are at hand): when the consumer
        slices by length, the producer's length records are appended to
        ``lengths`` (the messages' leading values) and each worker computes its
        own window from them.
        """
        out = lazy._out or self.recent.get(lazy._turn)
        producer = lazy.gang if lazy.gang is not None else self.own  # see sending.strip_own_gang
        if out is None or out.bundle is not None:
            out = await _fetched_plan(lazy, out, producer)
        mode = lazy.collect
        if lazy.gang is not None and lazy.gang.dispatcher is not None:
            self.producers[(lazy.gang.group, lazy.gang.cls_name)] = lazy.gang.dispatcher
        if out.balanced:  # a balanced producer: windows over input positions (runtime.balance)
            return balance.route(lazy, out, method, n, dispatch, lengths, self.spec, producer)
        g = self.spec.group
        where, source = f"{method}() on group '{g.name}'", f"{producer.cls_name}.{lazy.method}"
        if dispatch == "slice_dp":
            dp = self._data_ranks.get(n)
            if dp is None:  # the mesh is fixed: computed once per gang size
                dp = self._data_ranks[n] = worker_data_ranks(n, self.spec.mesh, g.gpus_per_worker)
            parts, index = dp
        else:
            parts, index = n, list(range(n))
        sliced = dispatch in ("slice", "slice_dp")
        if mode not in ("flatten", "none", "first"):  # collected whole in the consumer, then sliced
            return [Collected(list(out.refs), mode, list(out.workers), producer.mesh,
                              producer.gpus_per_worker, producer, lazy.method,
                              window=Window(parts, index[i], where, source) if sliced else None)
                    for i in range(n)]
        k = 1 if mode == "first" else len(out.refs)
        refs, ranks = list(out.refs[:k]), list(out.workers[:k])
        as_list = mode == "none" and k > 1
        # Enough to name the producer on failure (its dispatcher is found by name then): keeps
        # the markers small, since every worker's message carries one.
        named = GangRef(producer.group, producer.cls_name, dispatcher=None)
        common = dict(as_list=as_list, producer=named, method=lazy.method, ranks=ranks,
                      collect=mode)
        if not sliced:
            return [Pieces(refs, **common)] * n
        # The length records (one per output; per element for a tuple) locate each worker's
        # window, in the worker: see Pieces.materialize.
        slots = (len(lengths), len(lengths) + k)
        lengths.extend(out.metas[:k])
        aligned = k == n == parts and not as_list  # output i is worker i's slice if lengths are even
        if aligned:  # the refs travel as one object, fetched only if lengths are uneven: the
            # producer's plan, which its caller owns (no put here)
            held = lazy._plan_ref
            return [
                Pieces(None, **common, length_slots=slots,
                       window=Window(parts, index[i], where, source), aligned=i,
                       refs_ref=held, n_refs=k, own=refs[i])
                for i in range(n)
            ]
        return [
            Pieces(refs, **common, length_slots=slots, window=Window(parts, index[i], where, source))
            for i in range(n)
        ]


async def _fetched_plan(lazy: LazyResult, out: CallOutput | None, producer: GangRef) -> CallOutput:
    """A producer's plan this gang does not have at hand: its dispatcher's reply and, from a
    large gang, the bundle of its refs. Lost with that dispatcher: a WorkerDiedError naming the
    producer's dispatcher (never Ray's raw error, which would blame this gang's call)."""
    try:
        if out is None:
            out = await lazy._plan_ref
        if out.bundle is not None:  # a large gang's reply: its refs travel as one object
            out = out.unpacked(await out.bundle)
        return out
    except (RayActorError, ObjectLostError) as e:
        raise producer.plan_lost(e, lazy.method) from None


def _with_aligned_slots(start: int, args: tuple, kwargs: dict) -> tuple[list, tuple, dict]:
    """Move the aligned producer outputs of one worker's routed markers into its leading values.

    Returns (the extra leading values, numbered from ``start``; the arguments with each such
    marker replaced by a copy that knows its slot). The markers themselves are not changed.
    """
    extra: list = []
    done: dict[int, Pieces] = {}

    def conv(v: Any) -> Any:
        if not isinstance(v, Pieces) or v.aligned is None:
            return v
        if id(v) in done:  # the same value twice: one leading value
            return done[id(v)]
        slot = start + len(extra)
        if v.refs is None:  # moved, so it does not travel nested in the marker too
            extra.append(v.own)
            new = dataclasses.replace(v, aligned_slot=slot, own=None)
        else:
            extra.append(v.refs[v.aligned])
            new = dataclasses.replace(v, aligned_slot=slot)
        done[id(v)] = new
        return new

    return extra, tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


def _has_lazy(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, LazyResult) for a in args) or any(
        isinstance(v, LazyResult) for v in kwargs.values()
    )
