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

import logging
import time
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

from ..core.dispatch import collect as collect_results
from ..core.dispatch import collect_sources, concat, span, take
from ..core.routing import locate
from .errors import CallTimeoutError, WorkerDiedError, death_cause
from .message import Inline, Raised

logger = logging.getLogger(__name__)

END_OF_ITERATION = "twinkle_ray:end-of-iteration"
DEATH_QUERY_TIMEOUT_S = 5.0
# An unreachable worker: how long a caller waits for its dispatcher's verdict (the dispatcher's
# OUTAGE_LIMIT_S, plus the time Ray takes to report a node dead).
OUTAGE_WAIT_S = 40.0
# After a failure, how long to look at the other ranks' outcomes before raising (a peer's death
# outranks a user error it caused). Stuck ranks are the dispatcher's business (GangStuckError).
ERROR_GRACE_S = 0.5
# A plan late with no rank running its call gets this much longer (it may have just ended)
# before CallTimeoutError says that it has not started.
PLAN_GRACE_S = 2.0


@dataclass
class CallOutput:
    """What the dispatcher returns for one call: refs (and small values), never payload.

    On the task path every output is an ObjectRef. Through a Compiled Graph an
    output is an ObjectRef (a large result, stored on its worker's node), an
    :class:`~twinkle_ray.runtime.message.Inline` small result, a
    :class:`~twinkle_ray.runtime.message.Raised` error, or None (not known:
    the call was answered early because another rank raised).
    """

    refs: list  # output per executing worker (see above)
    metas: list  # each output's batch length (or None / END_OF_ITERATION), or an ObjectRef of it
    workers: list[int]  # gang rank of each executing worker
    ended: bool = False  # __next__ reported exhaustion


@dataclass
class GangRef:
    """Enough about a gang to name it in errors and ask its dispatcher about deaths."""

    group: str
    cls_name: str
    dispatcher: Any = field(repr=False)
    mesh: Any = field(default=None, repr=False)
    gpus_per_worker: int = 1
    n_workers: int = 1
    dispatcher_node: tuple[str, str] | None = None  # (node id, ip) of the dispatcher, if known
    dispatcher_lost: bool = False  # a call saw the dispatcher dead (its creator may rebuild it)

    def death_error(self, exc: BaseException, rank: int | None) -> WorkerDiedError:
        """The WorkerDiedError for a failed ref: the dispatcher's record of the first death.

        The dispatcher classifies by ``exc.actor_id`` (Ray's structured field) against its own
        table of workers; a death of another gang's worker (a producer whose output this gang's
        call took as an input, so Ray failed the call before it ran) is named as that worker's,
        not this gang's. An unreachable worker (ActorUnavailableError) is waited on until the
        dispatcher tells an outage from a lost node. A dead dispatcher is named as such.
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
                self.dispatcher_lost = not isinstance(gone, ActorUnavailableError)
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

    def pieces(self, lengths: list[int]) -> list[tuple[int, tuple[int, int] | None]]:
        total = sum(lengths)
        if total < self.parts:
            raise ValueError(
                f"{self.where}: batch of {total} items (from {self.source}) is smaller than the "
                f"data-parallel size {self.parts}"
            )
        return locate(lengths, *span(total, self.parts, self.index))


@dataclass
class Pieces:
    """A routed lazy value: producer outputs (or parts of them), joined in the consumer worker.

    With a ``window``, the worker picks the covering outputs itself from their
    lengths: ``const_lengths`` or the resolved length records at positions
    ``length_slots`` of its task's leading arguments. Only the covering
    producer refs are pulled.
    """

    refs: list | None  # None: see refs_ref
    as_list: bool = False  # items are whole per-rank results (collect='none'), not concatenated
    producer: GangRef | None = None
    method: str = ""
    ranks: list | None = None  # producer rank of each ref
    window: Window | None = None
    length_slots: tuple[int, int] | None = None
    const_lengths: list | None = None
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
        picks: list = [(k, None) for k in range(len(self.refs) if self.refs is not None else self.n_refs)]
        if self.window is not None:
            lens = (self.const_lengths if self.const_lengths is not None
                    else list(lengths[self.length_slots[0]:self.length_slots[1]]))
            if all(isinstance(x, int) for x in lens):  # else not sliceable: take it whole
                picks = self.window.pieces(lens)
        fetch_ks = [k for k, _ in picks if k != self.aligned or self.aligned_slot is None]
        if fetch_ks and self.refs is None:
            self.refs = ray.get(self.refs_ref)
        got = dict(zip(fetch_ks, pull([self.refs[k] for k in fetch_ks], self.producer, self.method,
                                      [self.ranks[k] if self.ranks else None for k in fetch_ks]),
                       strict=True))
        values = [got[k] if k in got else lengths[self.aligned_slot] for k, _ in picks]
        parts = [v if w is None else take(v, *w) for v, (_, w) in zip(values, picks, strict=True)]
        if self.as_list:
            return parts
        return parts[0] if len(parts) == 1 else concat(parts)


@dataclass
class Collected:
    """A whole lazy value collected in the consuming worker (mean, sum, custom collects)."""

    refs: list
    collect: Any
    workers: list[int]
    mesh: Any = None
    gpus_per_worker: int = 1
    producer: GangRef | None = None
    method: str = ""

    def materialize(self, lengths: tuple = ()) -> Any:
        # Only the outputs the collect reads are pulled ('last_pp': the last stage's, one per
        # data rank; 'last_pp_first': one).
        keep = collect_sources(self.collect, self.workers, device_mesh=self.mesh,
                               gpus_per_worker=self.gpus_per_worker)
        workers = [self.workers[k] for k in keep]
        return collect_results(
            self.collect,
            pull([self.refs[k] for k in keep], self.producer, self.method, workers),
            device_mesh=self.mesh,
            gpus_per_worker=self.gpus_per_worker,
            worker_indices=workers,
        )


def pull(refs: list, producer: GangRef | None, method: str, ranks: list) -> list:
    """The values of a producer's outputs in a consumer; a failed producer is named, not hidden.

    ObjectRefs are fetched (one ``ray.get``), Inline values taken as they are.
    A producer worker that died makes this raise the producer gang's
    WorkerDiedError (group, class, rank); a producer's own exception is
    re-raised as itself with a note naming the producer.
    """
    for item, rank in zip(refs, ranks, strict=True):
        if isinstance(item, Raised) or item is None:
            raise _raised_error(item, producer, method, rank, []) from None
    obj = [r for r in refs if isinstance(r, ray.ObjectRef)]
    got = iter(_pull_refs(obj, producer, method,
                          [k for r, k in zip(refs, ranks, strict=True) if isinstance(r, ray.ObjectRef)])
               if obj else [])
    return [next(got) if isinstance(r, ray.ObjectRef) else r.value if isinstance(r, Inline) else r
            for r in refs]


def _pull_refs(refs: list, producer: GangRef | None, method: str, ranks: list) -> list:
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


def resolve_lead(lead: tuple) -> tuple:
    """A message's leading values, resolved: ObjectRefs fetched (one ``ray.get``; on the task
    path Ray has done it already), Inline values unwrapped; a Raised one raises its error."""
    if not lead:
        return lead
    for item in lead:
        if isinstance(item, Raised):
            raise item.error
    obj = [x for x in lead if isinstance(x, ray.ObjectRef)]
    got = iter(ray.get(obj) if obj else [])
    return tuple(next(got) if isinstance(x, ray.ObjectRef) else x.value if isinstance(x, Inline)
                 else x for x in lead)


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
          stated: float | None = None):
    """The values of a call's outputs (see CallOutput), with our error contract: timeouts name
    ranks, deaths raise WorkerDiedError, a user exception is re-raised as itself with the
    group/rank/method noted (once, naming the rank that raised)."""
    unknown = [w for r, w in zip(refs, workers, strict=True) if r is None]
    for item, rank in zip(refs, workers, strict=True):
        if isinstance(item, Raised):
            raise _raised_error(item, gang, method, rank, unknown) from None
    pos = [k for k, r in enumerate(refs) if isinstance(r, ray.ObjectRef)]
    if not pos:
        return [r.value if isinstance(r, Inline) else r for r in refs]
    got = _fetch_refs([refs[k] for k in pos], [workers[k] for k in pos], gang, method, timeout,
                      stated)
    values = [r.value if isinstance(r, Inline) else r for r in refs]
    for k, v in zip(pos, got, strict=True):
        values[k] = v
    return values


def _raised_error(item: Raised | None, gang: GangRef | None, method: str, rank: int | None,
                  running: list) -> BaseException:
    """The exception a Raised output stands for, noted with where it was raised (once)."""
    if item is None:
        return RuntimeError(f"{method}(): the output of rank {rank} is unknown (the call was "
                            f"answered early because another rank raised)")
    err = item.error
    if isinstance(err, WorkerDiedError | CallTimeoutError) or gang is None:
        return err
    rank = item.rank if item.rank is not None else rank
    where = f"rank {rank} of " if rank is not None else ""
    if hasattr(err, "add_note") and not getattr(err, "_twinkle_noted", False):
        err.add_note(f"raised in {gang.cls_name}.{method}() on {where}group '{gang.group}'"
                     + (f"\nremote traceback:\n{item.traceback}" if item.traceback else ""))
        if running:
            err.add_note(f"rank(s) {running} are still running; if they are blocked in a "
                         f"collective, the gang is torn down after its grace period "
                         f"(GangStuckError)")
        try:
            err._twinkle_noted = True
        except AttributeError:  # an exception type with __slots__: notes may repeat
            pass
    return err


def _fetch_refs(refs: list, workers: list[int], gang: GangRef, method: str, timeout: float | None,
                stated: float | None = None):
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
            raise gang.death_error(e, rank) from None
    if failures:
        rank, e = failures[0]
        err = _user_error(e, gang, method, rank)
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


def _user_error(e: RayTaskError, gang: GangRef, method: str, rank: int | None) -> BaseException:
    cause = getattr(e, "cause", None)
    if isinstance(cause, WorkerDiedError | CallTimeoutError):
        return cause
    if isinstance(cause, RayActorError):
        return gang.death_error(cause, rank)
    if cause is None:
        return e
    where = f"rank {rank} of " if rank is not None else ""
    note = f"raised in {gang.cls_name}.{method}() on {where}group '{gang.group}'"
    tb = getattr(e, "traceback_str", "")
    if hasattr(cause, "add_note"):
        cause.add_note(note + (f"\nremote traceback:\n{tb}" if tb else ""))
    return cause


class Pending:
    """Something :func:`twinkle_ray.get` materialises: a value still being computed.

    Subclasses implement ``get(timeout)`` and ``done()``; :class:`LazyResult` (one call) and
    the handle of a weight sync started with ``wait=False`` are the two.
    """

    __slots__ = ()

    def get(self, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def done(self) -> bool:
        """Whether it has finished (never waits)."""
        raise NotImplementedError


class LazyResult(Pending):
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
                 "_turn", "_args")

    def __init__(self, plan_ref, *, collect, gang: GangRef, method: str, timeout: float | None = None,
                 out: CallOutput | None = None, turn: tuple[str, int] | None = None):
        self._plan_ref = plan_ref
        self._turn = turn  # (caller id, number) of the call: its dispatcher knows the plan by it
        self._args: tuple | None = None  # the caller's (args, kwargs), kept by the proxy
        self._out = out
        self._value = None
        self._has_value = False
        self.collect = collect
        self.gang = gang
        self.method = method
        self.timeout = timeout

    # -- plan and refs -------------------------------------------------------------------------
    def plan(self, timeout: float | None = None, _stated: float | None = None) -> CallOutput:
        """The dispatcher's CallOutput (refs only). Raises the call's routing/death errors.

        Through a Compiled Graph the plan comes back when the call has run:
        past ``timeout`` seconds, CallTimeoutError names the ranks still running,
        or says that no rank has started it (it waits in the dispatcher behind
        earlier calls, for an in-flight slot, or for a rebuild of the gang).
        """
        if self._out is None:
            try:
                self._out = ray.get(self._plan_ref, timeout=timeout)
            except GetTimeoutError:
                late = self._late_ranks()
                where = f"{self.gang.cls_name}.{self.method}() on group '{self.gang.group}'"
                stated = timeout if _stated is None else _stated
                if late == [] and _stated is None:  # no rank runs it: it just ended, or it has
                    return self.plan(PLAN_GRACE_S, stated)  # not started: look once more
                if late == []:
                    raise CallTimeoutError(
                        f"{where}: not started on any rank within {stated:g}s (it waits in the "
                        f"dispatcher behind earlier calls, for an in-flight slot, or for the "
                        f"gang's rebuild)", []) from None
                raise CallTimeoutError(
                    f"{where}: rank(s) {late or []} did not answer within {stated:g}s",
                    late or []) from None
            except RayTaskError as e:
                if isinstance(e, RaySystemError) or isinstance(e.cause, RaySystemError):
                    # Ray failed the call before it ran: its arguments did not unpickle there
                    raise _unloadable(self, e) from None
                raise _user_error(e, self.gang, self.method, None) from None
            except RayActorError as e:
                raise self.gang.death_error(e, None) from None
            except RaySystemError as e:
                raise _unloadable(self, e) from None
        return self._out

    def _late_ranks(self) -> list[int] | None:
        """The ranks the dispatcher sees still running this call ([]: none; None: unknown)."""
        d = self.gang.dispatcher
        if d is None or self._turn is None:
            return None
        try:
            return ray.get(d.late_ranks.remote(self._turn), timeout=DEATH_QUERY_TIMEOUT_S)
        except Exception:  # the dispatcher is busy or gone: say what we know
            logger.debug("late_ranks query failed", exc_info=True)
            return None

    @property
    def refs(self) -> list:
        """Per-rank payload ObjectRefs, in gang-rank order of the executing workers.

        A small output that came back by value is put in the object store here
        (once); a failed call raises its error.
        """
        out = self.plan()
        if not all(isinstance(r, ray.ObjectRef) for r in out.refs):
            values = fetch(out.refs, out.workers, self.gang, self.method, None)
            out.refs = [r if isinstance(r, ray.ObjectRef) else ray.put(v)
                        for r, v in zip(out.refs, values, strict=True)]
        return list(out.refs)

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
                values = fetch(out.refs, out.workers, self.gang, self.method, left, t)
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

    def done(self) -> bool:
        """Whether every rank has finished this call (with a value or an error); never waits."""
        if self._has_value:
            return True
        if self._out is None:
            if not ray.wait([self._plan_ref], timeout=0)[0]:
                return False
            try:
                self.plan()
            except Exception:  # the call failed before it ran: finished
                return True
        refs = [r for r in self._out.refs if isinstance(r, ray.ObjectRef)]
        return len(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]) == len(refs)

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
    args, kwargs = result._args or ((), {})
    for name, v in [*((f"argument {i}", a) for i, a in enumerate(args)),
                    *((f"argument '{k}'", v) for k, v in kwargs.items())]:
        if isinstance(v, ray.ObjectRef | LazyResult):
            continue
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
