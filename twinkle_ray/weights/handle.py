"""A weight sync under way: :class:`SyncHandle`, and how a failed sync ends on both sides.

Once one end of a sync has failed (a death, an exception on any rank, a timeout), the others cannot
complete: ranks still inside it ``SYNC_GRACE_S`` later are presumed stuck and their gangs torn down
(``GangStuckError``; rebuilt when ``max_restarts`` allows), so no rank stays blocked. The error a
failed sync raises is a death first, else the error of the end that failed first, passing over ends
that only echo another end's failure.

>>> # h = sync_weights(trainer, sampler, wait=False)   # returns at once
>>> # rollouts = sampler.generate(prompts)             # runs after the sync, on the new weights
>>> # stats = twinkle_ray.get(h)
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..runtime.errors import CallTimeoutError, GangStuckError, WorkerDiedError
from ..runtime.lazy import Pending
from .transport import PeerFailed, SetupRefused, SourceFailed

logger = logging.getLogger(__name__)

__all__ = ["SYNC_GRACE_S", "SyncHandle", "settle"]

SYNC_GRACE_S = 3.0  # after one end of a sync failed, how long the others get to finish
SETTLE_READ_S = 30.0  # reading the outcome of an end that has finished or was torn down


def settle(channel: str, ends: list, wait_s: float | None, abort_late: bool = True
           ) -> tuple[list[int], dict[int, BaseException]]:
    """Wait for every end of a sync (a list of (gang, LazyResult)), all of them at once: their
    dispatchers' replies and then their outputs are read together (``ray.wait``), so an end that
    failed is seen at once, wherever it is in the list; the others then get ``SYNC_GRACE_S``.
    Past ``wait_s`` (None: no limit), ends still running are torn down (``abort_late``) or
    CallTimeoutError is raised. Returns (the indices of the failed ends, first first; the errors
    of the ends whose call never started, their reply not come: each names its gang and the
    channel). The others have finished or were torn down."""
    import ray

    asking = {lazy.reply_ref: k for k, (_, lazy) in enumerate(ends)}  # replies not read yet
    owner: dict = {}  # output ref -> its end
    pending: set = set()
    failed: list[int] = []
    start = time.monotonic()
    failed_at = None

    def fail(k: int) -> None:
        nonlocal failed_at
        if k not in failed:
            failed.append(k)
        failed_at = failed_at or time.monotonic()

    while asking or pending:
        refs = [*asking, *pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.1, fetch_local=False)
        for ref in ready:
            k = asking.pop(ref, None)
            if k is None:  # an output: small (sync stats, or the error)
                pending.discard(ref)
                try:
                    ray.get(ref)
                except Exception:
                    fail(owner[ref])
                continue
            try:  # the reply is here: reading it waits only for a large reply's bundle
                outs = ends[k][1].reply(SETTLE_READ_S).refs
            except Exception:  # the gang could not take the call (dead, stopped)
                fail(k)
                continue
            owner.update(dict.fromkeys(outs, k))
            pending.update(outs)
        now = time.monotonic()
        if failed_at is not None and now - failed_at >= SYNC_GRACE_S:
            break
        if wait_s is not None and now - start >= wait_s:
            if not abort_late:
                running = sorted({owner[r] for r in pending})
                raise CallTimeoutError(
                    f"weight sync {channel}: not finished within {wait_s:g}s"
                    + (f" (still running on {[repr(ends[k][0]) for k in running]})" if running else "")
                    + (f" (not started on any rank of {[repr(ends[k][0]) for k in sorted(asking.values())]}:"
                       f" it waits in their dispatchers)" if asking else ""), [])
            late = sorted([*asking.values(), *{owner[r] for r in pending}])
            if late and late[0] not in failed:
                failed.append(late[0])
            break
    waited = time.monotonic() - start
    unstarted: dict[int, BaseException] = {}
    for k in sorted(asking.values()):  # never started: nothing to tear down (a pair's first wait
        gang, lazy = ends[k]  # is bounded by timeout_s once it starts: it fails on its own)
        unstarted[k] = CallTimeoutError(
            f"weight sync {channel}: {lazy.method}() on {gang!r} was not started on any rank within "
            f"{waited:.3g}s (it waits in the gang's dispatcher: behind earlier calls, a stuck check or a "
            f"rebuild, or the dispatcher does not answer)", [])
        if k not in failed:
            failed.append(k)
    stuck: dict[int, list[int]] = {}
    for ref in pending:
        k = owner[ref]
        stuck.setdefault(k, []).extend(
            r for r, x in zip(ends[k][1].ranks, ends[k][1].refs, strict=True) if x == ref)
    for gang in {id(ends[k][0]): ends[k][0] for k in stuck}.values():
        ranks = sorted({r for k, rs in stuck.items() if ends[k][0] is gang for r in rs})
        culprit = ends[failed[0]][0] if failed else gang
        logger.warning("weight sync %s: %r failed; tearing down %r, ranks %s still in the sync",
                       channel, culprit, gang, ranks)
        gang.abort(f"weight sync {channel} failed on {culprit!r}; ranks {ranks} were "
                    f"still inside it {SYNC_GRACE_S:g}s later", ranks)
    return failed, unstarted


class SyncHandle(Pending):
    """A weight sync under way (``sync_weights(..., wait=False)``).

    ``twinkle_ray.get(handle)`` (or ``handle.get()``) waits for both sides and gives the trainer's
    :class:`~twinkle_ray.weights.SyncStats`, or raises the sync's error: a worker's death first
    (``WorkerDiedError``), else the error of the end that failed first. ``done()`` never waits.

    >>> SyncHandle.finished(3).get()
    3
    """

    __slots__ = ("_ws", "_ends", "_result", "_bound", "_value", "_error", "_settled")

    def __init__(self, ws: Any, ends: list, result: int | None, bound: float | None):
        self._ws, self._ends, self._result, self._bound = ws, ends, result, bound
        self._value: Any = None
        self._error: BaseException | None = None
        self._settled = False

    @classmethod
    def finished(cls, value: Any) -> SyncHandle:
        """A handle of a sync that has already run (in-process objects)."""
        h = cls(None, [], None, None)
        h._value, h._settled = value, True
        return h

    def done(self) -> bool:
        """Whether every end of the sync has finished (never waits)."""
        return self._settled or all(lazy.done() for _, lazy in self._ends)

    def get(self, timeout: float | None = None) -> Any:
        """The trainer's SyncStats once both sides are done; raises the sync's error.

        ``timeout``: raise CallTimeoutError (naming the sync) if it has not finished by then; it
        bounds the whole get, the wait for a call that has not started on any rank yet included
        (the sync goes on).
        """
        if not self._settled:
            self._settle(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def _settle(self, timeout: float | None) -> None:
        from ..runtime.session import get

        ws = self._ws
        bound = self._bound if timeout is None else timeout
        order, unstarted = settle(ws.channel, self._ends, bound, abort_late=timeout is None)
        errors: dict[int, BaseException] = dict(unstarted)
        values: dict[int, Any] = {}
        for k, (_, lazy) in enumerate(self._ends):  # every end has finished or been torn down by now
            if k in errors:  # never started: its error says so
                continue
            try:
                values[k] = get(lazy, SETTLE_READ_S)
            except Exception as e:
                errors[k] = e
        self._settled = True
        if errors:
            ws.failed()  # set up again (and send everything) on the next sync
            first_stage = self._result if self._result is not None else len(self._ends)
            roots = {k: root_error(e, self._ends[k][1]) for k, e in errors.items()}
            self._error = first_cause(roots, waited_for(order, roots, unstarted), first_stage)
            return
        self._value = None if self._result is None else values[self._result][0]
        if self._value is not None:
            self._value.backend = ws.backend_used or self._value.backend
            self._value.receivers = sum(len(values[k]) for k in range(self._result + 1, len(self._ends)))
        self._ends = []  # the refs are read: let Ray free them


def is_echo(e: BaseException) -> bool:
    """An end's error that only repeats another end's failure."""
    return isinstance(e, SourceFailed | SetupRefused | PeerFailed)
def root_error(error: BaseException, lazy: Any) -> BaseException:
    """The error of one end (a call on every rank of a gang): ``error`` (its first rank's), or,
    when that one only echoes another end's failure, another rank's own error (noted where)."""
    import ray

    if not is_echo(error):
        return error
    try:
        pairs = list(zip(lazy.ranks, lazy.refs, strict=True))
    except Exception:
        return error
    for rank, ref in pairs:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if cause is not None and not is_echo(cause):
                cause.add_note(f"raised in {lazy.gang.cls_name}.{lazy.method}() on rank {rank} of group "
                               f"'{lazy.gang.group}'")
                return cause
        except Exception:  # not finished, or not an exception of the call: keep the first
            continue
    return error


def waited_for(order: list[int], errors: dict[int, BaseException], unstarted: dict) -> list[int]:
    """``order`` with the ends that never started (``unstarted``) moved before the first end that
    timed out: those timed out waiting for them.

    >>> waited_for([0, 2, 1], {0: ValueError(), 2: TimeoutError(), 1: TimeoutError()}, {1: None})
    [0, 1, 2]
    """
    timed_out = [k for k in order if isinstance(errors.get(k), TimeoutError) and k not in unstarted]
    if not unstarted or not timed_out:
        return order
    rest = [k for k in order if k not in unstarted]
    at = rest.index(timed_out[0])
    return rest[:at] + [k for k in order if k in unstarted] + rest[at:]


def first_cause(errors: dict[int, BaseException], order: list[int], first_stage: int) -> BaseException:
    """The error a failed sync raises: a death (it explains its peers' errors); else, from the
    set-up calls if one failed (ends before ``first_stage``: later ones failed because of it),
    the end that failed first, passing over ends that only echo another end's failure."""
    deaths = [e for e in errors.values() if isinstance(e, WorkerDiedError) and not isinstance(e, GangStuckError)]
    if deaths:
        return deaths[0]
    ranked = [k for k in order if k in errors] + [k for k in errors if k not in order]
    early = [k for k in ranked if k < first_stage]
    ranked = early or ranked
    causes = [k for k in ranked if not is_echo(errors[k])]
    return errors[(causes or ranked)[0]]


