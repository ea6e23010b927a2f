"""Errors users of twinkle_ray catch.

Every error names what failed (group, class, rank, method) so a user reading
a traceback from a 64-worker job knows where to look.

Example::

    try:
        loss = trainer.train_step(batch)()
    except twinkle_ray.WorkerDiedError as e:
        print(e.group, e.rank, e.cause)
        trainer.restart()
"""

from __future__ import annotations

import copyreg
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass


class PlacementError(RuntimeError):
    """A DeviceGroup's placement group could not be reserved.

    Raised at once when the cluster can never hold the group (the message lists
    requested vs available resources), or after ``placement_timeout_s`` when the
    cluster is merely busy. Nothing stays reserved when it is raised.
    """


# what a death's message ends with unless it is told otherwise (``advice``)
TORN_DOWN = "The gang was torn down; call .restart() on it to rebuild."


class WorkerDiedError(RuntimeError):
    """A worker of a gang died; the gang was torn down whole.

    Attributes name the first worker that died: ``group``, ``cls`` (the user's
    class name), ``rank``, ``node`` (IP address), ``cause`` (what happened),
    ``node_id`` (Ray's node id, when known) and ``kind``: ``'died'`` (the
    process died), ``'node lost'`` (its node left the cluster),
    ``'preempted'`` (its node was pre-empted / drained), ``'unreachable'`` (it
    could not be reached for longer than an outage may last) or
    ``'dispatcher'`` (the gang's dispatcher died; ``rank`` is None). Call
    ``restart()`` on the gang to rebuild it. The message is ``headline`` (what
    died and why), then ``advice`` (what to do: by default ``TORN_DOWN``, that
    ``restart()``; the subclasses and a lost output say their own).

    >>> e = WorkerDiedError("g", "Model", 2, "10.0.0.2", "its node was lost", node_id="ab" * 28,
    ...                     kind="node lost")
    >>> str(e).split(":")[0]
    "worker rank 2 of Model in group 'g' died (node 10.0.0.2, id abababab, node lost)"
    >>> str(e) == f"{e.headline}. {TORN_DOWN}", e.advice == TORN_DOWN
    (True, True)
    >>> import pickle
    >>> lost = WorkerDiedError("g", "M", None, None, "its outputs are lost", kind="dispatcher",
    ...                        advice="Call M.f() again.")
    >>> str(pickle.loads(pickle.dumps(lost))).endswith("are lost. Call M.f() again.")
    True
    """

    def __init__(self, group: str, cls: str, rank: int | None, node: str | None, cause: str,
                 node_id: str | None = None, kind: str = "died", advice: str | None = None):
        self.group, self.cls, self.rank, self.node, self.cause = group, cls, rank, node, cause
        self.node_id, self.kind, self.advice = node_id, kind, advice or TORN_DOWN
        if kind == "dispatcher":
            who = "the dispatcher"
        else:
            who = f"worker rank {rank}" if rank is not None else "a worker"
        where = f"node {node or '?'}" + (f", id {node_id[:8]}" if node_id else "")
        if kind not in ("died", "dispatcher"):
            where += f", {kind}"
        # what died and why, without what to do about it (GangRebuildError quotes it)
        self.headline = f"{who} of {cls} in group '{group}' died ({where}): {cause.rstrip('.')}"
        super().__init__(f"{self.headline}. {self.advice}")

    def __reduce__(self):
        return (type(self), (self.group, self.cls, self.rank, self.node, self.cause, self.node_id,
                             self.kind, self.advice))


class GangRebuildError(WorkerDiedError):
    """A gang is down because its rebuild failed: ``death`` is the death the rebuild followed,
    ``reason`` why the rebuild failed (e.g. a PlacementError naming the missing resources, or a
    constructor that did not finish within ``start_timeout_s``), ``how`` which rebuild it was
    (``'automatic'`` or ``'restart()'``). A ``restart()`` of a gang that had not died has no
    death: ``gang`` = (group, class) names it, ``rank`` is None and ``kind`` is ``'rebuild'``.
    It is a :class:`WorkerDiedError`, so code that handles deaths handles it too.

    >>> d = WorkerDiedError("g", "Model", 1, "10.0.0.2", "its node was lost", kind="node lost")
    >>> e = GangRebuildError(d, "PlacementError: 2 x {CPU: 1} missing")
    >>> "rebuild failed: PlacementError" in str(e), e.rank
    (True, 1)
    >>> GangRebuildError(None, "rank 1 hung", "restart()", gang=("g", "Model")).kind
    'rebuild'
    >>> str(GangRebuildError(d, "it died.")).count("..")  # a reason's own period is not doubled
    0
    """

    def __init__(self, death: WorkerDiedError | None, reason: str, how: str = "automatic",
                 gang: tuple[str, str] | None = None):
        if death is not None:
            self.group, self.cls, self.rank, self.node = death.group, death.cls, death.rank, death.node
            self.cause, self.node_id, self.kind = death.cause, death.node_id, death.kind
        else:
            self.group, self.cls = gang or ("?", "?")
            self.rank, self.node, self.cause, self.node_id, self.kind = None, None, reason, None, "rebuild"
        self.death, self.reason, self.how = death, reason, how
        self.advice = "Call .restart() on it to try again once the cause is fixed."
        which = "its automatic rebuild" if how == "automatic" else f"its rebuild by {how}"
        self.headline = (f"gang of {self.cls} in group '{self.group}' is down: {which} failed: "
                         f"{reason.rstrip('.')}")
        after = "" if death is None else f" The rebuild followed this death: {death.headline}."
        RuntimeError.__init__(self, f"{self.headline}.{after} {self.advice}")

    def __reduce__(self):
        return (type(self), (self.death, self.reason, self.how, (self.group, self.cls)))


class GangStuckError(WorkerDiedError):
    """A rank failed while its peers sat in a collective; the gang was torn down whole.

    ``rank`` is the rank that failed first (``cause`` says how), ``stuck`` the
    ranks that had not finished the same call ``grace_s`` seconds later, which
    are presumed blocked in a collective that can no longer complete. It is a
    :class:`WorkerDiedError`, so code that handles deaths (``restart()``,
    ``max_restarts``) handles it too.

    >>> e = GangStuckError("g", "Model", 1, [0], "step", "KeyError: 'x'", 3.0)
    >>> e.stuck, isinstance(e, WorkerDiedError)
    ([0], True)
    """

    def __init__(self, group: str, cls: str, rank: int | None, stuck: list[int], method: str,
                 cause: str, grace_s: float):
        self.group, self.cls, self.rank, self.node, self.cause = group, cls, rank, None, cause
        self.node_id, self.kind = None, "stuck"
        self.stuck, self.method, self.grace_s = list(stuck), method, grace_s
        self.advice = ("The gang was torn down; call .restart() on it to rebuild (max_restarts "
                       "does it by itself).")
        who = f"rank {rank}" if rank is not None else "a rank"
        self.headline = (f"{who} of {cls} in group '{group}' failed in {method}() ({cause}); rank(s) "
                         f"{self.stuck} had not finished that call {grace_s:g}s later (blocked in a "
                         f"collective?)")
        RuntimeError.__init__(self, f"{self.headline}. {self.advice}")

    def __reduce__(self):
        return (type(self), (self.group, self.cls, self.rank, self.stuck, self.method, self.cause,
                             self.grace_s))


class GangRestartedError(RuntimeError):
    """A call was in flight when its caller restarted the gang (``restart()``): it was cut short
    and its results are gone. Nothing died, and the gang is already rebuilt: call it again.

    >>> print(GangRestartedError("g/Model", "Model.step()"))
    gang g/Model was restarted (restart()) while Model.step() was in flight: its results are gone; the gang is rebuilt: call it again
    """

    def __init__(self, label: str, call: str = "a call"):
        self.label, self.call = label, call
        super().__init__(f"gang {label} was restarted (restart()) while {call} was in flight: "
                         f"its results are gone; the gang is rebuilt: call it again")

    def for_call(self, call: str) -> GangRestartedError:
        """The same, naming ``call``."""
        return GangRestartedError(self.label, call)

    def __reduce__(self):
        return GangRestartedError, (self.label, self.call)


class GangClosedError(RuntimeError):
    """A call was in flight when its gang was closed (``close()``, ``shutdown()``): it was cut
    short and its results are gone. Nothing died; there is nothing to restart.

    >>> print(GangClosedError("g/Model", "closed", "Model.step()"))
    gang g/Model was closed (closed) while Model.step() was in flight: its results are gone; create the gang again to call it
    """

    def __init__(self, label: str, reason: str, call: str):
        self.label, self.reason, self.call = label, reason, call
        super().__init__(f"gang {label} was closed ({reason}) while {call} was in flight: its "
                         f"results are gone; create the gang again to call it")

    def __reduce__(self):
        return GangClosedError, (self.label, self.reason, self.call)


class TurnError(RuntimeError):
    """A call did not run: an earlier call of its caller never reached the gang's dispatcher,
    and calls never overtake each other, so this one cannot go before it."""


class CallTimeoutError(TimeoutError):
    """A remote_function call did not finish within its ``timeout``.

    ``ranks`` lists the gang ranks that had not answered.
    """

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self):
        return (type(self), (self.args[0], self.ranks))


# What became of an actor of ours, from Ray's structured exception fields (never its text).
DIED, NODE_LOST, PREEMPTED, OUTAGE = "died", "node lost", "preempted", "outage"


@dataclass(frozen=True)
class Death:
    """One actor's failure, classified: ``kind`` is DIED, NODE_LOST, PREEMPTED or OUTAGE (a
    temporary outage, not a death: Ray's ActorUnavailableError); ``rank`` and the node come from
    the dispatcher's own table of its workers."""

    kind: str
    rank: int
    actor_id: str
    node_id: str | None
    node_ip: str | None
    cause: str


def classify_death(exc: BaseException, table: Mapping[str, tuple[int, str | None, str | None]],
                   alive_nodes: Collection[str] | None = None) -> Death | None:
    """Classify a Ray actor error about one of our actors; None if it is not about one of them.

    ``table`` maps actor id (hex) -> (rank, node id, node ip): the dispatcher's record of its
    workers. ``alive_nodes`` (node ids Ray reports alive), when given, tells a lost node from a
    dead process. Only structured fields are read: ``RayActorError.actor_id``, ``.preempted``
    and the exception's type.

    >>> from ray.exceptions import ActorUnavailableError, RayActorError
    >>> table = {"a1": (0, "n1", "10.0.0.1"), "a2": (1, "n2", "10.0.0.2")}
    >>> classify_death(RayActorError("a2", "gone"), table, alive_nodes={"n1"}).kind
    'node lost'
    >>> classify_death(RayActorError("a1", "gone", preempted=True), table).kind
    'preempted'
    >>> classify_death(ActorUnavailableError("socket closed", None), table) is None
    True
    >>> classify_death(RayActorError("zz", "gone"), table) is None
    True
    """
    from ray.exceptions import ActorUnavailableError, RayActorError

    if not isinstance(exc, RayActorError):
        return None
    actor_id = exc.actor_id
    if actor_id not in table:
        return None
    rank, node_id, node_ip = table[actor_id]
    where = f"{node_ip or '?'} ({node_id[:8] if node_id else '?'})"
    if isinstance(exc, ActorUnavailableError):
        kind, cause = OUTAGE, "unreachable (ActorUnavailableError: a temporary outage or a lost node)"
    elif exc.preempted:
        kind, cause = PREEMPTED, f"its node {where} was pre-empted"
    elif alive_nodes is not None and node_id is not None and node_id not in alive_nodes:
        kind, cause = NODE_LOST, f"its node {where} left the cluster"
    else:
        kind, cause = DIED, death_cause(exc)
    return Death(kind, rank, actor_id, node_id, node_ip, cause)


def death_cause(exc: BaseException) -> str:
    """A short human account of an actor's death, for error messages only (never classified).
    The dead actor's pid, from the ``pid:`` line of Ray's own account above the cause, comes
    along: its log files in the session's ``logs/`` directory carry it in their names.

    >>> from ray.exceptions import RayActorError
    >>> death_cause(RayActorError("a1", "The actor died...\\n\\tpid: 7\\nThe actor is dead because "
    ...                              "it was killed by `ray.kill`."))
    'The actor is dead because it was killed by `ray.kill` (actor pid 7).'
    >>> death_cause(RayActorError("a1", "The actor is dead because its worker process has died."))
    'The actor is dead because its worker process has died.'
    """
    text = str(exc)
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    at = next((i for i, s in enumerate(lines)
               if "dead because" in s or "killed" in s or "exit" in s.lower()), None)
    cause = lines[at] if at is not None else lines[0] if lines else f"{type(exc).__name__}"
    for marker in (" Some common causes include", " If the process was killed"):
        cause = cause.split(marker)[0]
    # Ray's header lines ("class_name: ...", "pid: N", ...) come before the cause; a pid in a
    # traceback or message after it may be another process's.
    pids = [m.group(1) for s in lines[:at or 0] if (m := re.fullmatch(r"pid: (\d+)", s))]
    if pids and not re.search(r"\bpid\b", cause, re.IGNORECASE):
        cause = f"{cause[:380].removesuffix('.')} (actor pid {pids[0]}){'.' if cause.endswith('.') else ''}"
    return cause[:400]


def cause_text(e: BaseException) -> str:
    """One line saying why a start or rebuild failed: a task error's cause, an actor's death,
    or the exception's first line.

    >>> cause_text(ValueError("bad\\nmore"))
    'ValueError: bad'
    """
    from ray.exceptions import RayActorError

    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    if isinstance(e, RayActorError):
        return death_cause(e)
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def portable(e: BaseException) -> BaseException:
    """``e``, made to reach the caller as itself. An exception whose class cannot be rebuilt
    from its ``args`` (an ``__init__`` with other parameters) would arrive as Ray's
    UnserializableException, naming neither its type nor the rank: its class is registered
    to be pickled by its attributes instead (:func:`copyreg.pickle`), so its type and message
    are kept.

    >>> class Odd(Exception):
    ...     def __init__(self, a, b):
    ...         super().__init__(f"{a}/{b}")
    >>> import cloudpickle
    >>> back = cloudpickle.loads(cloudpickle.dumps(portable(Odd(1, 2))))
    >>> type(back).__name__, str(back)
    ('Odd', '1/2')
    """
    import cloudpickle

    try:
        cloudpickle.loads(cloudpickle.dumps(e))
    except Exception:
        copyreg.pickle(type(e), _reduce_exception)
    return e


def _reduce_exception(e: BaseException) -> tuple:
    return _rebuild_exception, (type(e), e.args, dict(e.__dict__))


def _rebuild_exception(cls: type, args: tuple, state: dict) -> BaseException:
    e = cls.__new__(cls, *args)
    e.args = args
    e.__dict__.update(state)
    return e
