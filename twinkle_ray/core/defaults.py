"""Default settings of the runtime, written once.

Every signature and dataclass that takes one of these settings uses the constant
from here, so a default is changed in one place. Pure: no imports.

Example::

    >>> from twinkle_ray.core import defaults
    >>> defaults.SEED, defaults.PLACEMENT_TIMEOUT_S
    (42, 60.0)
"""

from __future__ import annotations

__all__ = [
    "DIST_TIMEOUT_S",
    "LAZY_COLLECT",
    "PLACEMENT_TIMEOUT_S",
    "SEED",
    "START_TIMEOUT_S",
    "STUCK_GRACE_S",
]

#: Seed for ``random``, numpy and torch in every worker (``initialize(seed=...)``; None: no seeding).
SEED: int = 42
#: Results stay in the workers until needed (``initialize(lazy_collect=...)``).
LAZY_COLLECT: bool = True
#: Seconds ``initialize`` waits for every group's placement group to be ready.
PLACEMENT_TIMEOUT_S: float = 60.0
#: Seconds a gang may take to start (workers up, torch.distributed joined, instance built);
#: None waits forever.
START_TIMEOUT_S: float | None = 600.0
#: torch.distributed timeout of a gang (rendezvous and collectives), in seconds.
DIST_TIMEOUT_S: float = 120.0
#: After a call raised on some ranks, seconds until ranks still running it are presumed stuck
#: in a collective (``remote_class(stuck_grace_s=...)``; None: never).
STUCK_GRACE_S: float | None = 3.0
