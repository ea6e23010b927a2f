"""The error contract of a call: what a failed ref means, named.

A call's outputs are ObjectRefs; fetching them can fail in many ways Ray reports
differently. :func:`fetch` turns each into the one error a user should see:

- a rank's own exception, re-raised as itself with the group, rank and method noted;
- a rank that died (also one whose peers raised in a collective because of it): the gang's
  :class:`~twinkle_ray.runtime.errors.WorkerDiedError`, as its dispatcher recorded it
  (:meth:`GangRef.death_error`), a producer's when the call's input was lost with it;
- a dispatcher that died: named as such, and the proxy that made the call is told (it may
  rebuild it); the outputs it owned are lost with it (:meth:`GangRef.outputs_lost`);
- ``timeout=``: a CallTimeoutError naming the ranks that did not answer;
- no copy found in time (ObjectFetchTimedOutError): said so, not a death;
- a result that could not be pickled in its rank: a TypeError naming it.

:class:`GangRef` is what a call, a LazyResult and a proxy copy know of a gang to name it.

Example::

    values = fetch(refs, [0, 1], gang, "forward", timeout=30.0)
"""

from __future__ import annotations

import logging
import pickle
import re
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
    RayTaskError,
)

from .errors import (
    CallTimeoutError,
    GangClosedError,
    GangRestartedError,
    WorkerDiedError,
    death_cause,
)
from .reply import NotPicklable

logger = logging.getLogger(__name__)

DEATH_QUERY_TIMEOUT_S = 5.0
# An unreachable worker: how long a caller waits for its dispatcher's verdict (the dispatcher's
# OUTAGE_LIMIT_S, plus the time Ray takes to report a node dead).
OUTAGE_WAIT_S = 40.0
# After a failure, how long to look at the other ranks' outcomes before raising (a peer's death
# outranks a user error it caused). Stuck ranks are the dispatcher's business (GangStuckError).
ERROR_GRACE_S = 0.5


@dataclass(frozen=True)
class Caller:
    """The proxy that made a call, as its failure needs it: ``lost(gang)`` is told when the
    gang's dispatcher is found dead (it may rebuild it), ``closed()`` says why the gang was
    closed (None: it is open)."""

    lost: Callable[[GangRef], None]
    closed: Callable[[], str | None]


@dataclass(frozen=True)
class GangRef:
    """Enough about a gang to name it in errors, ask its dispatcher about deaths and find the
    dispatcher again by name after its creator respawned it.

    An immutable value: it travels with every LazyResult and proxy copy. A proxy whose
    dispatcher was replaced holds a new GangRef (``dataclasses.replace``); whether a call saw
    the dispatcher die is the proxy's to know (``death_error``'s ``caller``).
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

    def reply_lost(self, exc: BaseException, method: str) -> WorkerDiedError:
        """The error for a consumer that could not read this gang's reply to ``method`` (its
        outputs' refs, an input of the consumer's call): the producer's dispatcher, which held
        them, is gone. Named here, never as the consumer's own death (a consumer's dispatcher
        and a consumer rank both raise it)."""
        node_id, ip = self.dispatcher_node or (None, None)
        cause = (f"{death_cause(exc).rstrip('.')}; it held the outputs of "
                 f"{self.cls_name}.{method}(), an input of this call")
        return WorkerDiedError(self.group, self.cls_name, None, ip, cause, node_id=node_id,
                               kind="dispatcher")

    def death_error(self, exc: BaseException, rank: int | None, caller: Caller | None = None,
                    method: str = "") -> WorkerDiedError:
        """The WorkerDiedError for a failed ref: the dispatcher's record of the first death.

        The dispatcher classifies by ``exc.actor_id`` (Ray's structured field) against its own
        table of workers; a death of another gang's worker (a producer whose output this gang's
        call took as an input, so Ray failed the call before it ran) is named as that worker's,
        not this gang's. An unreachable worker (ActorUnavailableError) is waited on until the
        dispatcher tells an outage from a lost node. A dead dispatcher is named as such, and
        the ``caller`` (the proxy that made the call) is told: it may rebuild it; if the caller
        closed the gang, that is what happened (GangClosedError), not a death. So is the
        owner of an output a consumer could not read (Ray's OwnerDiedError, when this GangRef
        has no dispatcher to ask, as a routed input's has not, or its dispatcher knows of no
        death, as a respawned one does not): that output's ``method`` and its owner, the
        dispatcher that sent its task, which died (also when a new one has rebuilt the gang
        since). A gang's outputs are only ever owned by a dispatcher of it.
        """
        if self.dispatcher is None and isinstance(exc, OwnerDiedError):
            return self.outputs_lost(method)
        wait = OUTAGE_WAIT_S if isinstance(exc, ActorUnavailableError) else 2.0
        actor_id = getattr(exc, "actor_id", None)
        if self.dispatcher is not None:
            try:
                death = ray.get(self.dispatcher.death_of.remote(actor_id, wait),
                                timeout=wait + DEATH_QUERY_TIMEOUT_S)
            except RayActorError as gone:  # the dispatcher died, or cannot be reached now
                closed = caller.closed() if caller is not None else None
                if closed is not None:  # close() killed it: the call was cut short, nothing died
                    return GangClosedError(self.label or f"{self.group}/{self.cls_name}",
                                           closed, f"{self.cls_name}.{method}()")
                # Only a death makes the creator's proxy respawn it (under the same name): an
                # unreachable dispatcher (ActorUnavailableError) may still be alive.
                if caller is not None and not isinstance(gone, ActorUnavailableError):
                    caller.lost(self)
                node_id, ip = self.dispatcher_node or (None, None)
                return WorkerDiedError(self.group, self.cls_name, None, ip,
                                       death_cause(gone),
                                       node_id=node_id, kind="dispatcher")
            except Exception:  # busy or unreachable: describe what we saw
                death = None
            if isinstance(death, GangRestartedError):  # the caller's restart(), not a death
                return death.for_call(f"{self.cls_name}.{method}()")
            if death is not None:
                if (death.group, death.cls) != (self.group, self.cls_name):
                    death.add_note(f"it produced an input of a call on {self.cls_name} in group "
                                   f"'{self.group}'")
                return death
        if isinstance(exc, OwnerDiedError):  # no death known here: an earlier dispatcher's outputs
            return self.outputs_lost(method)
        return WorkerDiedError(self.group, self.cls_name, rank, None, death_cause(exc))

    def outputs_lost(self, method: str) -> WorkerDiedError:
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
          stated: float | None = None, caller: Caller | None = None) -> list:
    """The values of a call's output refs, with our error contract: timeouts name ranks,
    deaths raise WorkerDiedError, a user exception is re-raised as itself with the
    group/rank/method noted (naming the rank that raised). ``caller``: see
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
            raise gang.death_error(e, rank, caller, method) from None
    for rank, e in failures:  # an output of this call not found in time (a rank's own raise of
        # it, fetching its inputs, is that rank's error: below)
        if isinstance(e, ObjectFetchTimedOutError) and not isinstance(e, RayTaskError):
            raise fetch_timed_out(e, gang, method, rank) from None
    if failures:
        rank, e = failures[0]
        err = user_error(e, gang, method, rank, caller)
        if pending and hasattr(err, "add_note"):
            late = [w for r, w in zip(refs, workers, strict=True) if r not in done]
            err.add_note(f"rank(s) {late} are still running; if they are blocked in a collective, "
                         f"the gang is torn down after its grace period (GangStuckError)")
        raise err from None
    return ray.get(refs)


def read_quietly(refs: list) -> None:
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


def raised_note(call: str, traceback: str) -> str:
    """The note that names where an exception was raised: ``call`` is ``'Class.method() on
    rank r of group 'g''``. A rank adds it to its method's exception (it knows where it
    is); a caller adds it to one that has none (:func:`user_error`)."""
    return f"raised in {call}" + (f"\nremote traceback:\n{traceback}" if traceback else "")


def user_error(e: RayTaskError, gang: GangRef, method: str, rank: int | None,
               caller: Caller | None = None) -> BaseException:
    cause = getattr(e, "cause", None)
    if isinstance(cause, WorkerDiedError | CallTimeoutError):
        return cause
    if isinstance(cause, RayActorError):
        return gang.death_error(cause, rank, caller, method)
    if cause is None:
        return e
    where = f"rank {rank} of " if rank is not None else ""
    call = f"{gang.cls_name}.{method}() on {where}group '{gang.group}'"
    tb = _ANSI.sub("", getattr(e, "traceback_str", "") or "")
    if _result_not_picklable(cause, tb):
        return TypeError(f"{call} ran, but its result cannot be pickled to leave the worker "
                         f"({type(cause).__name__}: {cause}); return plain data, arrays or "
                         f"tensors, or keep the object in the worker")
    if not hasattr(cause, "add_note"):
        return cause
    raised = [n for n in getattr(cause, "__notes__", ()) if n.startswith("raised in ")]
    mine = f"raised in {gang.cls_name}.{method}() on "
    if not raised:  # named by its rank: not (an exception of Ray's, a mock)
        cause.add_note(raised_note(call, tb if not isinstance(cause, NotPicklable) else ""))
    elif not any(n.startswith(mine) and f"group '{gang.group}'" in n.splitlines()[0]
                 for n in raised):
        # another call's exception, not one of this call's ranks': Ray failed this call
        # with it before any rank ran (a routed input's record, runtime.routed)
        cause.add_note(f"it failed an input of {gang.cls_name}.{method}() on group "
                       f"'{gang.group}': no rank of that call ran")
    return cause


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _result_not_picklable(cause: BaseException, traceback: str) -> bool:
    """Ray could not pickle a rank's result after its method returned (a lazy call's result;
    an eager call's is pickled by the rank itself: NotPicklable)."""
    return (isinstance(cause, TypeError | pickle.PicklingError) and "in dumps" in traceback
            and "twinkle_ray/runtime/" not in traceback)
