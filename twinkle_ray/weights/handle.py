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


def settle(channel: str, ends: list, wait_s: float | None, abort_late: bool = True) -> list[int]:
    """Wait for every end of a sync (a list of (gang, LazyResult)); the indices of the failed ends,
    first first. Past ``wait_s`` (None: no limit), ends still running are torn down
    (``abort_late``) or CallTimeoutError is raised."""
    import ray

    owner: dict = {}
    failed: list[int] = []
    asked = time.monotonic()
    for k, (_, lazy) in enumerate(ends):
        # A call waits in its dispatcher (a rebuild, a stuck check) before its reply comes back:
        # a caller's bound (abort_late False: get(timeout)) covers that wait too.
        bound = None if abort_late or wait_s is None else max(0.0, wait_s - (time.monotonic() - asked))
        try:
            owner.update({ref: k for ref in lazy.reply(bound).refs})
        except CallTimeoutError as e:
            if bound is None:
                failed.append(k)
                continue
            raise CallTimeoutError(f"weight sync {channel}: not finished within {wait_s:g}s ({e})", []) from None
        except Exception:  # the gang could not take the call (dead, stopped)
            failed.append(k)
    start = time.monotonic() if abort_late or wait_s is None else asked
    failed_at = start if failed else None
    pending = list(owner)
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1, fetch_local=False)
        for ref in ready:
            try:
                ray.get(ref)  # small: sync stats, or the error
            except Exception:
                if owner[ref] not in failed:
                    failed.append(owner[ref])
                failed_at = failed_at or time.monotonic()
        now = time.monotonic()
        if failed_at is not None and now - failed_at >= SYNC_GRACE_S:
            break
        if wait_s is not None and now - start >= wait_s:
            if not abort_late:
                late = sorted({owner[r] for r in pending})
                raise CallTimeoutError(f"weight sync {channel}: not finished within {wait_s:g}s "
                                       f"(still running on {[repr(ends[k][0]) for k in late]})",
                                       [])
            if owner[pending[0]] not in failed:
                failed.append(owner[pending[0]])
            break
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
    return failed


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
        order = settle(ws.channel, self._ends, bound, abort_late=timeout is None)
        errors: dict[int, BaseException] = {}
        values: dict[int, Any] = {}
        for k, (_, lazy) in enumerate(self._ends):  # every end has finished or been torn down by now
            try:
                values[k] = get(lazy, SETTLE_READ_S)
            except Exception as e:
                errors[k] = e
        self._settled = True
        if errors:
            ws.failed()  # set up again (and send everything) on the next sync
            first_stage = self._result if self._result is not None else len(self._ends)
            self._error = first_cause({k: root_error(e, self._ends[k][1]) for k, e in errors.items()},
                                      order, first_stage)
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


