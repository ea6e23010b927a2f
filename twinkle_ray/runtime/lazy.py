"""LazyResult: what a remote_function call returns, and how it travels.

A call returns at once with a LazyResult holding a reference to the call's
*plan* (the per-rank output ObjectRefs the dispatcher submitted). Nothing is
fetched until someone needs the value:

    out = sampler.generate(prompts)      # LazyResult, returns immediately
    scores = out()                       # or out.get(), len(out), list(out)
    trainer.train_step(out)              # routed: never fetched by the driver

When a LazyResult is an argument of another gang's method, that gang's
dispatcher routes it: each consumer worker receives a ``Pieces`` marker
naming only the producer refs that cover its slice, and pulls them from the
producers' object stores itself (``resolve_routed`` in the worker).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    ObjectLostError,
    RayActorError,
    RayError,
    RaySystemError,
    RayTaskError,
)

from ..core.dispatch import batch_len, collect_sources, concat, span, take
from ..core.dispatch import collect as collect_results
from ..core.routing import length_record, locate, plain_length, tuple_arity
from .errors import CallTimeoutError, WorkerDiedError, death_cause

END_OF_ITERATION = "twinkle_ray:end-of-iteration"
DEATH_QUERY_TIMEOUT_S = 5.0
# An unreachable worker: how long a caller waits for its dispatcher's verdict (the dispatcher's
# OUTAGE_LIMIT_S, plus the time Ray takes to report a node dead).
OUTAGE_WAIT_S = 40.0
# After a failure, how long to look at the other ranks' outcomes before raising (a peer's death
# outranks a user error it caused). Stuck ranks are the dispatcher's business (GangStuckError).
ERROR_GRACE_S = 0.5


@dataclass
class CallOutput:
    """What the dispatcher returns for one call: the output ObjectRefs of its tasks, never
    payload."""

    refs: list  # output ObjectRef per executing worker
    metas: list  # each output's batch length (or None / END_OF_ITERATION), or an ObjectRef of it
    workers: list[int]  # gang rank of each executing worker
    ended: bool = False  # __next__ reported exhaustion


@dataclass(frozen=True)
class GangRef:
    """Enough about a gang to name it in errors, ask its dispatcher about deaths and find the
    dispatcher again by name after its creator respawned it.

    An immutable value: it travels with every LazyResult and proxy copy. A proxy whose
    dispatcher was replaced holds a new GangRef (``dataclasses.replace``); whether a call saw
    the dispatcher die is the proxy's to know (``death_error``'s ``on_lost``).
    """

    group: str
    cls_name: str
    dispatcher: Any = field(repr=False)
    mesh: Any = field(default=None, repr=False)
    gpus_per_worker: int = 1
    n_workers: int = 1
    dispatcher_node: tuple[str, str] | None = None  # (node id, ip) of the dispatcher, if known
    # the dispatcher's actor name and namespace: where a copy looks for a respawned dispatcher
    label: str | None = None
    namespace: str | None = None

    def death_error(self, exc: BaseException, rank: int | None,
                    on_lost: Callable[[GangRef], None] | None = None) -> WorkerDiedError:
        """The WorkerDiedError for a failed ref: the dispatcher's record of the first death.

        The dispatcher classifies by ``exc.actor_id`` (Ray's structured field) against its own
        table of workers; a death of another gang's worker (a producer whose output this gang's
        call took as an input, so Ray failed the call before it ran) is named as that worker's,
        not this gang's. An unreachable worker (ActorUnavailableError) is waited on until the
        dispatcher tells an outage from a lost node. A dead dispatcher is named as such, and
        ``on_lost(self)`` is told (the proxy that made the call may rebuild it).
        """
        wait = OUTAGE_WAIT_S if isinstance(exc, ActorUnavailableError) else 2.0
        actor_id = getattr(exc, "actor_id", None)
        if self.dispatcher is not None:
            try:
                death = ray.get(self.dispatcher.death_of.remote(actor_id, wait),
                                timeout=wait + DEATH_QUERY_TIMEOUT_S)
            except RayActorError as gone:  # the dispatcher died, or cannot be reached now
                # Only a death makes the creator's proxy respawn it (under the same name): an
                # unreachable dispatcher (ActorUnavailableError) may still be alive.
                if on_lost is not None and not isinstance(gone, ActorUnavailableError):
                    on_lost(self)
                node_id, ip = self.dispatcher_node or (None, None)
                return WorkerDiedError(self.group, self.cls_name, None, ip,
                                       death_cause(gone),
                                       node_id=node_id, kind="dispatcher")
            except Exception:  # busy or unreachable: describe what we saw
                death = None
            if death is not None:
                if (death.group, death.cls) != (self.group, self.cls_name):
                    death.add_note(f"it produced an input of a call on {self.cls_name} in group "
                                   f"'{self.group}'")
                return death
        return WorkerDiedError(self.group, self.cls_name, rank, None, death_cause(exc))


@dataclass
class Window:
    """How a consumer worker finds its own slice of a routed value, in the worker.

    The dispatcher never waits for the producers' length records: it passes
    them to the consumer's task as top-level arguments (Ray resolves them
    before the task runs) and the worker computes its window from them: part
    ``index`` of ``parts`` contiguous parts (its data rank of the data world
    size for ``slice_dp``, its position among the workers for ``slice``).
    """

    parts: int
    index: int
    where: str = ""  # "train_step() on group 'trainer'", for the short-batch error
    source: str = ""  # "Sampler.generate", likewise

    def pieces(self, lengths: list[int], element: tuple = ()) -> list[tuple[int, tuple[int, int] | None]]:
        total = sum(lengths)
        if total < self.parts:
            part = "".join(f"[{j}]" for j in element)
            what = f"element {part} of the tuple from {self.source}" if element else self.source
            raise ValueError(
                f"{self.where}: batch of {total} items (from {what}) is smaller than the "
                f"data-parallel size {self.parts}"
            )
        return locate(lengths, *span(total, self.parts, self.index))

    def apply(self, value: Any, records: list, element: tuple = ()) -> Any:
        """This window of a whole (joined) value: what slicing the fetched value gives.

        ``records``: the length records of the results joined into ``value``; when
        they are all a tuple's, ``value`` was joined element-wise and is sliced so.
        """
        arity = tuple_arity(records)
        if arity is not None and isinstance(value, tuple) and len(value) == arity:
            items = [self.apply(v, [r.items[j] for r in records], (*element, j))
                     for j, v in enumerate(value)]
            return _like(value, items)
        try:
            n = batch_len(value)
        except ValueError:  # a dict whose values differ in length: not one batch
            n = None
        if n is None:
            return value
        [(_, w)] = self.pieces([n], element)
        return value if w is None else take(value, *w)


def _like(value: tuple, items: list) -> tuple:
    """A tuple of ``items`` of ``value``'s type (a namedtuple keeps its type, as in collect)."""
    return type(value)(*items) if hasattr(type(value), "_fields") else tuple(items)


def _at(value: Any, element: tuple) -> Any:
    for j in element:
        value = value[j]
    return value


@dataclass
class Pieces:
    """A routed lazy value: producer outputs (or parts of them), joined in the consumer worker.

    The consumer gets what fetching the value (the producer's ``collect``:
    ``'flatten'``, ``'none'`` or ``'first'``) and slicing it by its ``window``
    gives. With a window, the worker picks the covering outputs itself from the
    producers' length records (the resolved values at positions ``length_slots``
    of its task's leading arguments): tuple results are joined element-wise, so
    each element is sliced by its own lengths. Only the covering producer refs
    are pulled.
    """

    refs: list | None  # None: see refs_ref
    as_list: bool = False  # items are whole per-rank results (collect='none'), not concatenated
    producer: GangRef | None = None
    method: str = ""
    ranks: list | None = None  # producer rank of each ref
    window: Window | None = None
    length_slots: tuple[int, int] | None = None
    collect: str = "flatten"  # the producer's collect mode: 'flatten', 'none' or 'first'
    # Aligned layouts (output k is this worker's own slice when lengths are even): output
    # ``aligned`` also travels as leading argument ``aligned_slot``, so Ray hands it over
    # with the task, as it does for raw Ray's direct ref passing.
    aligned: int | None = None
    aligned_slot: int | None = None
    # Aligned markers hold the producer refs as one object (``refs_ref``, ``n_refs`` refs; refs
    # is None) that the worker fetches only when uneven lengths need another rank's output:
    # each task then carries one nested ref instead of one per producer output. ``own`` is the
    # aligned output until the dispatcher moves it into the task's leading arguments.
    refs_ref: Any = None
    n_refs: int = 0
    own: Any = None

    def materialize(self, lengths: tuple = ()) -> Any:
        n = len(self.refs) if self.refs is not None else self.n_refs
        if self.window is None or self.length_slots is None:  # the whole value
            return collect_results(self.collect, self._fetch(list(range(n)), lengths))
        records = list(lengths[self.length_slots[0]:self.length_slots[1]])
        plan = self._plan(records, ())
        needed = sorted(_needed(plan))
        values = dict(zip(needed, self._fetch(needed, lengths), strict=True))
        return self._assemble(plan, values)

    def _plan(self, records: list, element: tuple) -> tuple:
        """Which outputs (and ranges) make up this worker's part, element by element."""
        arity = tuple_arity(records)
        if arity is not None:
            return ("tuple", element, [self._plan([r.items[j] for r in records], (*element, j))
                                       for j in range(arity)])
        lens = [1] * len(records) if self.as_list else [plain_length(r) for r in records]
        if all(isinstance(x, int) for x in lens):
            return ("pieces", element, self.window.pieces(lens, element))
        return ("whole", element, records)  # not one batch: joined whole, then sliced

    def _assemble(self, plan: tuple, values: dict) -> Any:
        kind, element, detail = plan
        if kind == "tuple":
            items = [self._assemble(sub, values) for sub in detail]
            return _like(_at(values[min(_needed(plan))], element), items)
        if kind == "whole":
            joined = collect_results(self.collect, [_at(values[k], element) for k in range(len(detail))])
            return self.window.apply(joined, detail, element)
        parts = [_at(values[k], element) for k, _ in detail]
        parts = [v if w is None else take(v, *w) for v, (_, w) in zip(parts, detail, strict=True)]
        if self.as_list:
            return parts
        return concat(parts) if self.collect == "flatten" else parts[0]

    def _fetch(self, ks: list[int], lengths: tuple) -> list:
        """The values of outputs ``ks`` (the aligned one from the task's leading values)."""
        fetch_ks = [k for k in ks if k != self.aligned or self.aligned_slot is None]
        if fetch_ks and self.refs is None:
            self.refs = ray.get(self.refs_ref)
        got = dict(zip(fetch_ks, pull([self.refs[k] for k in fetch_ks], self.producer, self.method,
                                      [self.ranks[k] if self.ranks else None for k in fetch_ks]),
                       strict=True))
        return [got[k] if k in got else lengths[self.aligned_slot] for k in ks]


def _needed(plan: tuple) -> set[int]:
    """The outputs a Pieces plan reads."""
    kind, _, detail = plan
    if kind == "tuple":
        return set().union(*(_needed(sub) for sub in detail))
    if kind == "whole":
        return set(range(len(detail)))
    return {k for k, _ in detail}


@dataclass
class Collected:
    """A whole lazy value collected in the consuming worker (mean, sum, last_pp, custom
    collects), then sliced by the consumer's ``window`` (element-wise for tuples), as slicing
    the fetched value would."""

    refs: list
    collect: Any
    workers: list[int]
    mesh: Any = None
    gpus_per_worker: int = 1
    producer: GangRef | None = None
    method: str = ""
    window: Window | None = None

    def materialize(self, lengths: tuple = ()) -> Any:
        # Only the outputs the collect reads are pulled ('last_pp': the last stage's, one per
        # data rank; 'last_pp_first': one).
        keep = collect_sources(self.collect, self.workers, device_mesh=self.mesh,
                               gpus_per_worker=self.gpus_per_worker)
        workers = [self.workers[k] for k in keep]
        results = pull([self.refs[k] for k in keep], self.producer, self.method, workers)
        value = collect_results(
            self.collect,
            results,
            device_mesh=self.mesh,
            gpus_per_worker=self.gpus_per_worker,
            worker_indices=workers,
        )
        if self.window is None:
            return value
        return self.window.apply(value, [length_record(r) for r in results])


def pull(refs: list, producer: GangRef | None, method: str, ranks: list) -> list:
    """The values of a producer's outputs in a consumer; a failed producer is named, not hidden.

    One ``ray.get`` of the refs. A producer worker that died makes this raise
    the producer gang's WorkerDiedError (group, class, rank); a producer's own
    exception is re-raised as itself with a note naming the producer.
    """
    try:
        return ray.get(refs)
    except RayError:
        if producer is None:
            raise
    for ref, rank in zip(refs, ranks, strict=True):
        try:
            ray.get(ref)
        except RayTaskError as e:
            raise _user_error(e, producer, method, rank) from None
        except RayError as e:
            err = producer.death_error(e, rank)
            err.add_note(f"while fetching the output of {producer.cls_name}.{method}() (rank {rank} "
                         f"of group '{producer.group}') as an input")
            raise err from None
    return ray.get(refs)


def resolve_routed(value: Any, lengths: tuple = ()) -> Any:
    """Materialise what the proxy or dispatcher put in place of an argument, in the worker.

    Routed markers are fetched from the producers (``lengths``: the task's
    resolved length records); an ObjectRef (a large value the proxy
    ``ray.put``, when Ray did not resolve it as a top-level argument) is
    fetched; other values pass through.
    """
    if isinstance(value, (Pieces, Collected)):
        return value.materialize(lengths)
    if isinstance(value, ray.ObjectRef):
        return ray.get(value)
    if isinstance(value, LazyResult):  # a LazyResult passed whole (e.g. in local use)
        return value.get()
    return value


def fetch(refs: list, workers: list[int], gang: GangRef, method: str, timeout: float | None,
          stated: float | None = None, on_lost: Callable[[GangRef], None] | None = None) -> list:
    """The values of a call's output refs, with our error contract: timeouts name ranks,
    deaths raise WorkerDiedError, a user exception is re-raised as itself with the
    group/rank/method noted (naming the rank that raised). ``on_lost``: see
    :meth:`GangRef.death_error`."""
    if timeout is not None:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
        if len(ready) < len(refs):
            done = {r.hex() for r in ready}
            late = [w for r, w in zip(refs, workers, strict=True) if r.hex() not in done]
            raise CallTimeoutError(
                f"{gang.cls_name}.{method}() on group '{gang.group}': rank(s) {late} did not "
                f"answer within {stated if stated is not None else timeout:g}s",
                late,
            )
    try:
        return ray.get(refs)
    except (RayTaskError, RayActorError, GetTimeoutError, ObjectLostError):
        pass
    # Something failed. Look at every rank (briefly): a dead worker explains its peers'
    # collective errors, so a death anywhere outranks a user exception.
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=ERROR_GRACE_S)
    done = set(ready)
    failures: list[tuple[int, BaseException]] = []
    for ref, rank in zip(refs, workers, strict=True):
        if ref in done:
            try:
                ray.get(ref)
            except (RayActorError, RayTaskError, ObjectLostError) as e:
                failures.append((rank, e))
    for rank, e in failures:
        # An output whose owner (the dispatcher) or whose node died is lost with it: a death too.
        if isinstance(e, RayActorError | ObjectLostError) or isinstance(getattr(e, "cause", None),
                                                                         RayActorError):
            raise gang.death_error(e, rank, on_lost) from None
    if failures:
        rank, e = failures[0]
        err = _user_error(e, gang, method, rank, on_lost)
        if pending and hasattr(err, "add_note"):
            late = [w for r, w in zip(refs, workers, strict=True) if r not in done]
            err.add_note(f"rank(s) {late} are still running; if they are blocked in a collective, "
                         f"the gang is torn down after its grace period (GangStuckError)")
        raise err from None
    return ray.get(refs)


def _read_quietly(refs: list) -> None:
    """Read the finished refs whose errors were already raised, so Ray does not log them as
    unhandled. Never waits: refs of ranks still running are left alone."""
    refs = [r for r in refs if isinstance(r, ray.ObjectRef)]
    if not refs:
        return
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception:  # expected: these hold the same error
            pass


def _user_error(e: RayTaskError, gang: GangRef, method: str, rank: int | None,
                on_lost: Callable[[GangRef], None] | None = None) -> BaseException:
    cause = getattr(e, "cause", None)
    if isinstance(cause, WorkerDiedError | CallTimeoutError):
        return cause
    if isinstance(cause, RayActorError):
        return gang.death_error(cause, rank, on_lost)
    if cause is None:
        return e
    where = f"rank {rank} of " if rank is not None else ""
    note = f"raised in {gang.cls_name}.{method}() on {where}group '{gang.group}'"
    tb = getattr(e, "traceback_str", "")
    if hasattr(cause, "add_note"):
        cause.add_note(note + (f"\nremote traceback:\n{tb}" if tb else ""))
    return cause


class LazyResult:
    """The per-rank outputs of one call, collected only when needed.

    Materialises on ``get()``, ``()``, ``len()`` and iteration; ``refs`` gives
    the per-rank ObjectRefs. Passed to another gang's method it is routed, not
    fetched: payload bytes go straight from producer to consumer workers.

    Example::

        out = model.forward(batch)        # LazyResult
        out.refs                          # [ObjectRef, ...] one per rank
        loss = out()                      # collected value
    """

    __slots__ = ("_plan_ref", "_out", "_value", "_has_value", "collect", "gang", "method", "timeout",
                 "_turn", "_sent", "_on_lost")

    def __init__(self, plan_ref, *, collect, gang: GangRef, method: str, timeout: float | None = None,
                 out: CallOutput | None = None, turn: tuple[str, int] | None = None,
                 on_lost: Callable[[GangRef], None] | None = None):
        self._plan_ref = plan_ref
        # told when this call finds its dispatcher dead (the proxy that made it); never pickled
        self._on_lost = on_lost
        self._turn = turn  # (caller id, number) of the call: its dispatcher knows the plan by it
        # (name, value) of the arguments sent to the dispatcher by value, kept by the proxy: never
        # the payload (that went to the object store), see proxy._inline
        self._sent: tuple = ()
        self._out = out
        self._value = None
        self._has_value = False
        self.collect = collect
        self.gang = gang
        self.method = method
        self.timeout = timeout

    # -- plan and refs -------------------------------------------------------------------------
    def plan(self, timeout: float | None = None) -> CallOutput:
        """The dispatcher's CallOutput (refs only). Raises the call's routing/death errors.

        The dispatcher hands the plan back as soon as it has submitted the
        call's tasks: past ``timeout`` seconds without it, CallTimeoutError says
        that no rank has started the call (it waits in the dispatcher, behind
        its caller's earlier call, a stuck check or the gang's rebuild).
        """
        if self._out is None:
            try:
                self._out = ray.get(self._plan_ref, timeout=timeout)
            except GetTimeoutError:
                where = f"{self.gang.cls_name}.{self.method}() on group '{self.gang.group}'"
                raise CallTimeoutError(
                    f"{where}: not started on any rank within {timeout:g}s (it waits in the "
                    f"dispatcher, behind its caller's earlier call, a stuck check or the gang's "
                    f"rebuild)", []) from None
            except RayTaskError as e:
                if isinstance(e, RaySystemError) or isinstance(e.cause, RaySystemError):
                    # Ray failed the call before it ran: its arguments did not unpickle there
                    raise _unloadable(self, e) from None
                raise _user_error(e, self.gang, self.method, None, self._on_lost) from None
            except RayActorError as e:
                raise self.gang.death_error(e, None, self._on_lost) from None
            except RaySystemError as e:
                raise _unloadable(self, e) from None
        return self._out

    @property
    def refs(self) -> list:
        """Per-rank payload ObjectRefs, in gang-rank order of the executing workers."""
        return list(self.plan().refs)

    @property
    def ranks(self) -> list[int]:
        """Gang ranks that produced each of ``refs``."""
        return list(self.plan().workers)

    # -- materialising -------------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> Any:
        """Fetch and collect the value (cached after the first call)."""
        if not self._has_value:
            t = timeout if timeout is not None else self.timeout
            start = time.monotonic()
            out = self.plan(t)
            left = None if t is None else max(0.0, t - (time.monotonic() - start))
            try:
                values = fetch(out.refs, out.workers, self.gang, self.method, left, t, self._on_lost)
            except Exception:
                _read_quietly(out.metas)  # their copy of the error is handled too: no log noise
                raise
            self._value = collect_results(
                self.collect,
                values,
                device_mesh=self.gang.mesh,
                gpus_per_worker=self.gang.gpus_per_worker,
                worker_indices=out.workers,
            )
            self._has_value = True
        return self._value

    def __call__(self) -> Any:
        return self.get()

    def __len__(self) -> int:
        return len(self.get())

    def __iter__(self):
        return iter(self.get())

    def __repr__(self) -> str:
        state = "collected" if self._has_value else "pending"
        return f"LazyResult({self.gang.cls_name}.{self.method} on '{self.gang.group}', {state})"

    def __reduce__(self):
        # Travels as refs + routing facts; never with a fetched value.
        return (
            _rebuild_lazy,
            (self._plan_ref, self.collect, self.gang, self.method, self.timeout, self._out, self._turn),
        )


def _unloadable(result: LazyResult, error: BaseException) -> BaseException:
    """The TypeError for a call whose arguments the dispatcher could not unpickle, naming the
    argument when a round trip here fails too (else Ray's error, as it came)."""
    import cloudpickle

    where = f"{result.gang.cls_name}.{result.method}() on group '{result.gang.group}'"
    for name, v in result._sent:
        try:
            cloudpickle.loads(cloudpickle.dumps(v))
        except Exception as e:
            return TypeError(f"{where}: {name} of type {type(v).__name__} cannot be unpickled "
                             f"({type(e).__name__}: {e}); the call did not run")
    first = str(error).strip().splitlines()
    return TypeError(f"{where}: its arguments could not be unpickled in the gang's dispatcher "
                     f"({first[-1][:300] if first else type(error).__name__}); the call did not run")


def _rebuild_lazy(plan_ref, collect, gang, method, timeout, out, turn=None):
    return LazyResult(plan_ref, collect=collect, gang=gang, method=method, timeout=timeout, out=out,
                      turn=turn)
