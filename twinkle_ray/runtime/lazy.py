"""LazyResult: what a remote_function call returns, and how it travels.

A call returns at once with a LazyResult holding a reference to the call's
*plan* (the per-rank output ObjectRefs the dispatcher submitted). Nothing is
fetched until someone needs the value:

    out = sampler.generate(prompts)      # LazyResult, returns immediately
    scores = out()                       # or out.get(), len(out), list(out)
    trainer.train_step(out)              # routed: never fetched by the driver

When a LazyResult is an argument of another gang's method, that gang's
dispatcher routes it: each consumer worker receives a
:class:`~twinkle_ray.runtime.routed.Pieces` marker naming only the producer
refs that cover its slice, and pulls them from the producers' object stores
itself (``routed.resolve_routed`` in the worker).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    ObjectFetchTimedOutError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    RaySystemError,
    RayTaskError,
)

from ..core.balance import in_input_order
from ..core.dispatch import collect as collect_results
from .errors import CallTimeoutError, WorkerDiedError, death_cause
from .inline import unhold

logger = logging.getLogger(__name__)

END_OF_ITERATION = "twinkle_ray:end-of-iteration"
DEATH_QUERY_TIMEOUT_S = 5.0
# An unreachable worker: how long a caller waits for its dispatcher's verdict (the dispatcher's
# OUTAGE_LIMIT_S, plus the time Ray takes to report a node dead).
OUTAGE_WAIT_S = 40.0
# After a failure, how long to look at the other ranks' outcomes before raising (a peer's death
# outranks a user error it caused). Stuck ranks are the dispatcher's business (GangStuckError).
ERROR_GRACE_S = 0.5
# A reply to a lazy call that would carry more ObjectRefs than this carries one instead: a ref
# nested in a reply costs the caller's process CPU (borrowing it) when the reply arrives, so a
# lazy call's cost to its caller would grow with the gang's size (DESIGN 7: it must not).
PACK_REFS_OVER = 16


@dataclass
class CallOutput:
    """What the dispatcher returns for one call: the output ObjectRefs of its tasks, never
    payload."""

    refs: list  # output ObjectRef per executing worker
    metas: list  # each output's batch length (or None / END_OF_ITERATION), or an ObjectRef of it
    workers: list[int]  # gang rank of each executing worker
    ended: bool = False  # __next__ reported exhaustion
    # dispatch='balance': metas are positions records (see runtime.balance), not lengths
    balanced: bool = False
    # an eager call's values, in place of its refs (see runtime.inline); None: refs
    values: list | None = None
    # (refs, metas) as one ObjectRef its dispatcher owns, in place of both (see ``packed``)
    bundle: Any = None

    def _large(self) -> bool:
        return len(self.refs) + len(self.metas) > PACK_REFS_OVER

    def packed(self) -> CallOutput:
        """This output as the reply to its caller: with more than PACK_REFS_OVER refs, they
        travel as one object (a ``ray.put`` here, in the dispatcher) that the caller fetches
        only when it needs them (``unpacked``), so the reply it receives with every lazy call
        costs the same whatever the gang's size."""
        if not self._large():
            return self
        return dataclasses.replace(self, refs=[], metas=[], bundle=ray.put((self.refs, self.metas)))

    def unpacked(self, got: tuple[list, list] | None = None,
                 timeout: float | None = None) -> CallOutput:
        """The output with its refs at hand: fetches a packed reply's bundle (or takes ``got``,
        the bundle's value awaited by an async caller)."""
        if self.bundle is None:
            return self
        refs, metas = got if got is not None else ray.get(self.bundle, timeout=timeout)
        return dataclasses.replace(self, refs=list(refs), metas=list(metas), bundle=None)


def traveling(out: CallOutput | None) -> CallOutput | None:
    """What a LazyResult sent to another process carries of its output ``out``: ``out``, or
    None when its refs are many (the receiver reads the call's reply instead, which carries
    them as one object): a LazyResult a caller has collected stays cheap to pass on."""
    return None if out is None or out._large() else out


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

    def plan_lost(self, exc: BaseException, method: str) -> WorkerDiedError:
        """The error for a consumer that could not read this gang's plan of ``method`` (its
        outputs' refs, an input of the consumer's call): the producer's dispatcher, which held
        them, is gone. Named here, never as the consumer's own death (the router and a consumer
        worker both raise it)."""
        node_id, ip = self.dispatcher_node or (None, None)
        cause = (f"{death_cause(exc).rstrip('.')}; it held the outputs of "
                 f"{self.cls_name}.{method}(), an input of this call")
        return WorkerDiedError(self.group, self.cls_name, None, ip, cause, node_id=node_id,
                               kind="dispatcher")

    def death_error(self, exc: BaseException, rank: int | None,
                    on_lost: Callable[[GangRef], None] | None = None,
                    method: str = "") -> WorkerDiedError:
        """The WorkerDiedError for a failed ref: the dispatcher's record of the first death.

        The dispatcher classifies by ``exc.actor_id`` (Ray's structured field) against its own
        table of workers; a death of another gang's worker (a producer whose output this gang's
        call took as an input, so Ray failed the call before it ran) is named as that worker's,
        not this gang's. An unreachable worker (ActorUnavailableError) is waited on until the
        dispatcher tells an outage from a lost node. A dead dispatcher is named as such, and
        ``on_lost(self)`` is told (the proxy that made the call may rebuild it). So is the
        owner of an output a consumer could not read (Ray's OwnerDiedError, when this GangRef
        has no dispatcher to ask, as a routed input's has not, or its dispatcher knows of no
        death, as a respawned one does not): that output's ``method`` and its owner, the
        dispatcher that sent its task, which died (also when a new one has rebuilt the gang
        since). A gang's outputs are only ever owned by a dispatcher of it.
        """
        if self.dispatcher is None and isinstance(exc, OwnerDiedError):
            return self._outputs_lost(method)
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
        if isinstance(exc, OwnerDiedError):  # no death known here: an earlier dispatcher's outputs
            return self._outputs_lost(method)
        return WorkerDiedError(self.group, self.cls_name, rank, None, death_cause(exc))

    def _outputs_lost(self, method: str) -> WorkerDiedError:
        """The outputs of ``method`` are lost with the dispatcher that owned them. No rank died,
        and the gang may well be up again by now: a restart() would lose its state for
        nothing, so the advice is to call the method again."""
        call = f"{self.cls_name}.{method}()" if method else f"the {self.cls_name} method"
        return WorkerDiedError(self.group, self.cls_name, None, None,
                               f"the outputs of {call} were owned by it and are lost with it "
                               f"(Ray: the object's owner has exited)", kind="dispatcher",
                               advice=f"Call {call} again for new ones; rebuild its gang first "
                                      f"only if it is still down (a restart() of a gang rebuilt "
                                      f"since would lose its state).")


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
        if isinstance(e, ObjectFetchTimedOutError):  # Ray found no copy in time: not a death
            continue
        if isinstance(getattr(e, "cause", None), WorkerDiedError):  # raised by the rank: a death
            raise e.cause from None  # it saw (a producer's), named there
        # An output whose owner (the dispatcher) or whose node died is lost with it: a death too.
        if isinstance(e, RayActorError | ObjectLostError) or isinstance(getattr(e, "cause", None),
                                                                         RayActorError):
            raise gang.death_error(e, rank, on_lost, method) from None
    for rank, e in failures:  # an output of this call not found in time (a rank's own raise of
        # it, fetching its inputs, is that rank's error: below)
        if isinstance(e, ObjectFetchTimedOutError) and not isinstance(e, RayTaskError):
            raise fetch_timed_out(e, gang, method, rank) from None
    if failures:
        rank, e = failures[0]
        err = user_error(e, gang, method, rank, on_lost)
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


# what fetch_timed_out names when it was a call's output refs (held by its dispatcher) not found
OUTPUT_REFS = "the refs of the outputs"


def fetch_timed_out(e: ObjectFetchTimedOutError, gang: GangRef, method: str,
                    rank: int | None, what: str = "the output") -> ObjectFetchTimedOutError:
    """Ray's ObjectFetchTimedOutError for an output of ``gang``'s ``method`` (no copy found within
    Ray's ``fetch_fail_timeout_milliseconds``), or for the refs of its outputs (``what``), with a
    note naming it. Not a WorkerDiedError: no death is known, and the gang is not torn down for
    it."""
    where = f"rank {rank} of " if rank is not None else ""
    e.add_note(f"while fetching {what} of {gang.cls_name}.{method}() on {where}group "
               f"'{gang.group}': Ray found no copy of it in time (no worker death is known)")
    return e


def user_error(e: RayTaskError, gang: GangRef, method: str, rank: int | None,
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
                 "_turn", "_sent", "_on_lost", "_replied")

    def __init__(self, plan_ref, *, collect, gang: GangRef, method: str, timeout: float | None = None,
                 out: CallOutput | None = None, turn: tuple[str, int] | None = None,
                 on_lost: Callable[[GangRef], None] | None = None, replied: Any = None):
        self._plan_ref = plan_ref
        # told when this call finds its dispatcher dead (the proxy that made it); never pickled
        self._on_lost = on_lost
        # the proxy's record of this call (proxy._Previous): its ``replied`` is set once the
        # dispatcher's reply is here, so the proxy's next call need not wait on it; never pickled
        self._replied = replied
        self._turn = turn  # (caller id, number) of the call: its dispatcher knows the plan by it
        # (name, value) of the arguments sent to the dispatcher by value, kept by the proxy: never
        # the payload (that went to the object store), see sending.sent_by_value
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
            where = f"{self.gang.cls_name}.{self.method}() on group '{self.gang.group}'"
            start = time.monotonic()
            try:
                reply = ray.get(self._plan_ref, timeout=timeout)
            except GetTimeoutError:
                raise CallTimeoutError(
                    f"{where}: not started on any rank within {timeout:g}s (it waits in the "
                    f"dispatcher, behind its caller's earlier call, a stuck check or the gang's "
                    f"rebuild)", []) from None
            except RayTaskError as e:
                if isinstance(e, RaySystemError) or isinstance(e.cause, RaySystemError):
                    # Ray failed the call before it ran: its arguments did not unpickle there
                    raise self._never_arrived(e) from None
                raise user_error(e, self.gang, self.method, None, self._on_lost) from None
            except RayActorError as e:
                raise self.gang.death_error(e, None, self._on_lost) from None
            except RaySystemError as e:
                raise self._never_arrived(e) from None
            except ObjectFetchTimedOutError as e:  # Ray found no copy in time: not a death
                raise fetch_timed_out(e, self.gang, self.method, None, "the reply") from None
            if self._replied is not None:
                self._replied.replied_now()
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            try:
                self._out = reply.unpacked(timeout=left)
            except GetTimeoutError:
                raise CallTimeoutError(
                    f"{where}: submitted, but the refs of its outputs (held by the gang's "
                    f"dispatcher) did not arrive within {timeout:g}s", []) from None
            except ObjectFetchTimedOutError as e:  # Ray found no copy in time: not a death
                raise fetch_timed_out(e, self.gang, self.method, None, OUTPUT_REFS) from None
            except ObjectLostError as e:  # its dispatcher (the bundle's owner) died
                raise self.gang.death_error(e, None, self._on_lost) from None
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
            def fetch_held(refs: list, at: list[int]) -> list:  # results left in a worker's store
                return fetch(refs, [out.workers[i] for i in at], self.gang, self.method, None, None,
                             self._on_lost)

            if out.values is not None:  # an eager call answered with its values
                values = unhold(out.values, fetch_held)
            else:
                try:
                    values = unhold(fetch(out.refs, out.workers, self.gang, self.method, left, t,
                                          self._on_lost), fetch_held)
                except Exception:
                    _read_quietly(out.metas)  # their copy of the error is handled too: no log noise
                    raise
            if out.balanced:  # dispatch='balance': one list, in input order
                positions = fetch(out.metas, out.workers, self.gang, self.method, None)
                self._value = in_input_order(values, positions)
                self._has_value = True
                return self._value
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
                reply = ray.get(self._plan_ref)  # here already: no wait
                # a large gang's refs travel as a bundle: not fetched here until it is local
                if reply.bundle is not None and not ray.wait([reply.bundle], timeout=0)[0]:
                    return False
                self.plan()
            except Exception:  # the call failed before it ran: finished
                return True
        refs = [r for r in self._out.refs if isinstance(r, ray.ObjectRef)]
        if not refs:  # an eager call's values came back with its reply
            return True
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

    def _never_arrived(self, error: BaseException) -> BaseException:
        """The call failed before it reached its dispatcher (its arguments did not unpickle
        there): tell the dispatcher, so this caller's later calls, which may have arrived
        already, do not wait for its turn; and return the TypeError that names the argument."""
        if self._turn is not None:
            try:
                self.gang.dispatcher.skip_turn.remote(*self._turn[:2])
            except Exception:  # a dead dispatcher: nothing waits there
                logger.debug("could not tell the dispatcher of a lost call", exc_info=True)
        settled = getattr(self._replied, "settled", None)
        if settled is not None:  # failed with the plan: seen here, so Ray does not log it unseen
            _read_quietly([settled])
        return _unloadable(self, error)

    def __reduce__(self):
        # Travels as refs + routing facts; never with a fetched value.
        return (
            _rebuild_lazy,
            (self._plan_ref, self.collect, self.gang, self.method, self.timeout,
             traveling(self._out), self._turn),
        )


def _unloadable(result: LazyResult, error: BaseException) -> BaseException:
    """The TypeError for a call whose arguments the dispatcher could not unpickle, naming the
    argument when a round trip here fails too, or when the error names a module or class that
    one of them uses (importable here, not in the gang's processes); else Ray's error, as it came."""
    import cloudpickle

    where = f"{result.gang.cls_name}.{result.method}() on group '{result.gang.group}'"
    for name, v in result._sent:
        try:
            cloudpickle.loads(cloudpickle.dumps(v))
        except Exception as e:
            return TypeError(f"{where}: {name} of type {type(v).__name__} cannot be unpickled "
                             f"({type(e).__name__}: {e}); the call did not run")
    lines = str(error).strip().splitlines()
    why = lines[-1][:300] if lines else type(error).__name__
    missing = _missing_import(str(error))
    for name, v in result._sent if missing else ():
        t = next((t for t in _types_in(v) if _defined_in(t, *missing)), None)
        if t is not None:
            return TypeError(f"{where}: {name} of type {type(v).__name__} cannot be unpickled in "
                             f"the gang's dispatcher ({why}): {t.__module__}.{t.__qualname__} is "
                             f"importable here but not in the gang's Ray workers (ship its module "
                             f"with runtime_env py_modules or working_dir); the call did not run")
    return TypeError(f"{where}: its arguments could not be unpickled in the gang's dispatcher "
                     f"({why}); the call did not run")


def _missing_import(error: str) -> tuple[str, str | None] | None:
    """(module, class or None) that an unpickling error says it could not import."""
    m = re.search(r"No module named '([\w.]+)'", error)
    if m:
        return m.group(1), None
    m = re.search(r"Can't get attribute '([\w.]+)' on <module '([\w.]+)'", error)
    return (m.group(2), m.group(1)) if m else None


def _defined_in(t: type, module: str, name: str | None) -> bool:
    mod = getattr(t, "__module__", None) or ""
    if name is not None:
        return mod == module and t.__qualname__ == name
    return mod == module or mod.startswith(module + ".")


def _types_in(value: Any, depth: int = 2, limit: int = 64) -> list[type]:
    """The type of ``value`` and of what it holds, two levels down (containers only, their
    first ``limit`` items): where an unpicklable class may sit in a call's argument."""
    found = [type(value)]
    if depth > 0:
        if isinstance(value, dict):
            items = [x for kv in list(value.items())[:limit] for x in kv]
        elif isinstance(value, list | tuple | set | frozenset):
            items = list(value)[:limit]
        else:
            items = list(getattr(value, "__dict__", {}).values())[:limit]
        for x in items:
            found += _types_in(x, depth - 1, limit)
    return found


def _rebuild_lazy(plan_ref, collect, gang, method, timeout, out, turn=None):
    return LazyResult(plan_ref, collect=collect, gang=gang, method=method, timeout=timeout, out=out,
                      turn=turn)
