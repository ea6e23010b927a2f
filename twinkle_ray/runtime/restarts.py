"""One restart policy for a gang, and the metrics that make every rebuild visible.

A gang is rebuilt automatically at most ``max_restarts`` times within any
``window_s`` seconds (``None``: over its whole life); past that it stays
down with an error that says so. The dispatcher applies the policy to every
automatic rebuild; a Serve replica's gang uses the same policy (it sets the
replica's limits on its dispatcher) instead of keeping a second one.

The budget is one for the gang's whole life, dispatcher respawns included: a
respawn is a rebuild, and a respawned dispatcher starts with the history of
the rebuilds before it. The creator's proxy keeps that history
(:class:`RebuildLedger`): it respawns the dispatcher, so it is what survives
the dispatcher's death. It learns of each automatic rebuild from a *ticket*:
a call ``dispatcher.rebuilt(k)`` it made in advance, answered when the k-th
rebuild starts; the answer is held by the creator, so it outlives the
dispatcher. A respawn hands the whole history to the new dispatcher (in its
GangSpec).

Every rebuild is logged and counted in Ray's metrics system:

- ``twinkle_gang_restarts_total``: rebuilds started, tagged ``gang`` and
  ``reason`` (``died``, ``node lost``, ``preempted``, ``unreachable``, ``stuck``,
  ``dispatcher``, ``manual``);
- ``twinkle_gang_restart_failures_total``: rebuilds that failed (tag ``gang``);
- ``twinkle_gang_restarts_refused_total``: deaths left unrebuilt because the
  policy's budget was spent (tag ``gang``).

Example::

    policy = RestartPolicy(max_restarts=3, window_s=600)
    if policy.allow(now):        # records the restart when it allows it
        ...rebuild...
    policy.describe()            # 'max_restarts=3 within 600s'
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class RestartPolicy:
    """At most ``max_restarts`` automatic rebuilds within any ``window_s`` seconds (None: ever).

    >>> p = RestartPolicy(max_restarts=2, window_s=10.0)
    >>> [p.allow(t) for t in (0.0, 1.0, 2.0, 11.5)]
    [True, True, False, True]
    >>> p.describe()
    'max_restarts=2 within 10s'
    """

    max_restarts: int = 0
    window_s: float | None = None
    times: list[float] = field(default_factory=list)

    def __post_init__(self):
        if self.max_restarts < 0 or (self.window_s is not None and self.window_s <= 0):
            raise ValueError(f"restart policy: max_restarts must be >= 0 and window_s positive or "
                             f"None, got {self.max_restarts}, {self.window_s}")

    def room(self, now: float) -> bool:
        """Whether one more automatic rebuild may start at ``now``; records nothing."""
        if self.window_s is not None:
            self.times = [t for t in self.times if now - t < self.window_s]
        return len(self.times) < self.max_restarts

    def allow(self, now: float) -> bool:
        """Whether one more automatic rebuild may start at ``now``; records it if so."""
        if not self.room(now):
            return False
        self.times.append(now)
        return True

    def describe(self) -> str:
        within = f" within {self.window_s:g}s" if self.window_s is not None else ""
        return f"max_restarts={self.max_restarts}{within}"

    def limited(self, max_restarts: int, window_s: float | None = None) -> RestartPolicy:
        """New limits on the same history (rebuilds already made still count).

        >>> RestartPolicy(2, times=[5.0]).limited(1).allow(6.0)
        False
        """
        return RestartPolicy(max_restarts, window_s, list(self.times))


# Tickets a creator keeps waiting on one dispatcher at most (each a pending call on it, an
# awaited event in a concurrency group of its own: no CPU, and no slot a call needs).
TICKETS_MAX = 64


class RebuildLedger:
    """The creator's copy of its gang's one restart budget: the policy and its history, exact.

    The creator's proxy counts its own respawns of a dead dispatcher here
    (:meth:`allow_respawn`) and the dispatcher's automatic rebuilds as their tickets are
    answered (:meth:`catch_up`), and hands the history to each dispatcher it respawns. It
    keeps ``min(max_restarts, TICKETS_MAX)`` tickets waiting on the dispatcher, re-armed at
    every call it makes through the gang, and a followed dispatcher starts no rebuild without
    a ticket to answer. So every rebuild is counted: the count is exact. The one price: more
    than TICKETS_MAX rebuilds (with a window, or more allowed) between two of the creator's
    calls leave the gang down, GangRebuildError saying so, rather than rebuilt uncounted.

    Example::

        ledger = RebuildLedger(RestartPolicy(2))
        ledger.follow(dispatcher)                  # count the rebuilds this one starts
        if ledger.allow_respawn(time.time()):      # the dispatcher died
            spec = dataclasses.replace(spec, restart_times=ledger.history(), restarts=ledger.count)
    """

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.count = 0  # rebuilds so far: automatic ones and respawns
        self._dispatcher: Any = None
        self._tickets: list = []  # refs of dispatcher.rebuilt(k), k = _seen + 1, ... in order
        self._seen = 0  # rebuilds of the current dispatcher counted

    def follow(self, dispatcher: Any) -> None:
        """Count the automatic rebuilds of ``dispatcher`` (a new one: it has made none)."""
        self._dispatcher, self._tickets, self._seen = dispatcher, [], 0
        self._arm()

    def limit(self, max_restarts: int, window_s: float | None = None) -> None:
        """New limits, same history (``set_restart_policy``)."""
        self.catch_up()
        self.policy = self.policy.limited(max_restarts, window_s)
        self._arm()

    def history(self) -> tuple[float, ...]:
        """The times of the rebuilds the policy still counts, for a new dispatcher."""
        return tuple(self.policy.times)

    def catch_up(self) -> None:
        """Count the rebuilds whose tickets were answered, and wait on new tickets. Never
        waits: a ticket not answered yet is a rebuild not started yet."""
        import ray

        while self._tickets:
            ready, _ = ray.wait(self._tickets[:1], timeout=0)
            if not ready:
                break
            ticket = self._tickets.pop(0)
            try:
                at = ray.get(ticket)
            except Exception:  # the dispatcher died: no later ticket will be answered
                logger.debug("restart ticket ended with its dispatcher", exc_info=True)
                self._tickets.clear()
                self._dispatcher = None
                break
            self.policy.times.append(at)
            self.count += 1
            self._seen += 1
        self._arm()

    def allow_respawn(self, now: float) -> bool:
        """Whether the dead dispatcher may be respawned at ``now``; records it if so."""
        self.catch_up()
        if not self.policy.allow(now):
            return False
        self.count += 1
        return True

    def _arm(self) -> None:
        if self._dispatcher is None:
            return
        while len(self._tickets) < min(self.policy.max_restarts, TICKETS_MAX):
            k = self._seen + len(self._tickets) + 1
            self._tickets.append(self._dispatcher.rebuilt.remote(k))


class RestartMetrics:
    """A gang's restart counters (made in its dispatcher; each method never raises)."""

    def __init__(self, gang: str):
        from ray.util import metrics

        self.gang = gang
        self.restarts = metrics.Counter(
            "twinkle_gang_restarts_total", description="Rebuilds of a twinkle_ray gang, by reason.",
            tag_keys=("gang", "reason"))
        self.failures = metrics.Counter(
            "twinkle_gang_restart_failures_total",
            description="Rebuilds of a twinkle_ray gang that failed.", tag_keys=("gang",))
        self.refused = metrics.Counter(
            "twinkle_gang_restarts_refused_total",
            description="Deaths of a twinkle_ray gang left unrebuilt: its restart budget was spent.",
            tag_keys=("gang",))

    @classmethod
    def create(cls, gang: str, on: bool = True) -> RestartMetrics | None:
        if not on:
            return None
        try:
            return cls(gang)
        except Exception:  # metrics must never break a gang
            logger.warning("twinkle_ray restart metrics are off for gang %s", gang, exc_info=True)
            return None

    def _inc(self, counter, tags: dict) -> None:
        try:
            counter.inc(1, tags)
        except Exception:
            logger.debug("restart metric not recorded", exc_info=True)

    def restarted(self, reason: str) -> None:
        self._inc(self.restarts, {"gang": self.gang, "reason": reason})

    def failed(self) -> None:
        self._inc(self.failures, {"gang": self.gang})

    def refused_one(self) -> None:
        self._inc(self.refused, {"gang": self.gang})
