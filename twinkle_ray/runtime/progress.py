"""Progress lines on long waits: placement, a gang's start-up, a restart.

A wait that passes :func:`progress_after_s` logs one WARNING line on the ``twinkle_ray`` logger,
then one every ``PROGRESS_EVERY_S``: quiet by default, never silent on a stall.

Example::

    desc = wait_with_progress(dispatcher.start.remote(), "start-up of gang g/Model", 300)
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)

# Long waits (placement, gang start-up, a restart) log a progress line on the
# 'twinkle_ray' logger once they pass progress_after_s(), then every PROGRESS_EVERY_S.
PROGRESS_AFTER_S = 15.0
PROGRESS_EVERY_S = 10.0
PROGRESS_ENV = "TWINKLE_PROGRESS_AFTER_S"


def progress_after_s() -> float:
    """Seconds a wait runs before its first progress line.

    ``TWINKLE_PROGRESS_AFTER_S`` in the driver's environment when set (``0``
    logs every wait from the first second), else ``PROGRESS_AFTER_S`` (15 s).
    """
    raw = os.environ.get(PROGRESS_ENV, "").strip()
    if raw:
        try:
            return max(0.0, float(raw))
        except ValueError:
            logger.warning("ignoring %s=%r: not a number of seconds", PROGRESS_ENV, raw)
    return PROGRESS_AFTER_S


def wait_with_progress(ref, what: str, timeout_s: float | None) -> Any:
    """ray.get ``ref``, logging a progress line (WARNING) on a really long wait.

    The first line comes after :func:`progress_after_s` (15 s, or
    ``TWINKLE_PROGRESS_AFTER_S``), then one every ``PROGRESS_EVERY_S``.

    Example::

        desc = wait_with_progress(dispatcher.start.remote(), "start-up of gang g/Model", 300)
    """
    start = time.monotonic()
    next_note = progress_after_s()
    while True:
        elapsed = time.monotonic() - start
        step = 1.0 if timeout_s is None else max(0.0, min(1.0, timeout_s - elapsed))
        ready, _ = ray.wait([ref], timeout=step)
        if ready:
            return ray.get(ref)
        elapsed = time.monotonic() - start
        if timeout_s is not None and elapsed >= timeout_s:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g}s")
        if elapsed >= next_note:
            logger.warning("%s: still waiting after %.0fs", what, elapsed)
            next_note += PROGRESS_EVERY_S
