"""One restart policy for a gang, and the metrics that make every rebuild visible.

A gang is rebuilt automatically at most ``max_restarts`` times within any
``window_s`` seconds (``None``: over its whole life); past that it stays
down with an error that says so. The dispatcher applies the policy to every
automatic rebuild; a Serve replica's gang uses the same policy (it sets the
replica's limits on its dispatcher) instead of keeping a second one.

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

    def allow(self, now: float) -> bool:
        """Whether one more automatic rebuild may start at ``now``; records it if so."""
        if self.window_s is not None:
            self.times = [t for t in self.times if now - t < self.window_s]
        if len(self.times) >= self.max_restarts:
            return False
        self.times.append(now)
        return True

    def describe(self) -> str:
        within = f" within {self.window_s:g}s" if self.window_s is not None else ""
        return f"max_restarts={self.max_restarts}{within}"


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
