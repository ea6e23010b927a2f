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


class Progress:
    """When one long wait logs its progress lines: the first once it passes
    :func:`progress_after_s`, then one every ``PROGRESS_EVERY_S``.

    Example::

        progress = Progress(log=logger)        # or Progress(began=<time.monotonic() it began>)
        while not done():
            progress.note(lambda s: f"start-up of gangs a, b: still waiting after {s:.0f}s")
    """

    def __init__(self, began: float | None = None, log: logging.Logger = logger):
        self.began = time.monotonic() if began is None else began
        self._next = progress_after_s()
        self._log = log  # the waiting module's logger

    def elapsed(self) -> float:
        """Seconds since the wait began."""
        return time.monotonic() - self.began

    def note(self, line) -> None:
        """Log ``line(elapsed seconds)`` (WARNING) if a progress line is due now."""
        elapsed = self.elapsed()
        if elapsed >= self._next:
            self._log.warning("%s", line(elapsed))
            self._next += PROGRESS_EVERY_S


def wait_with_progress(ref, what: str, timeout_s: float | None, began: float | None = None) -> Any:
    """ray.get ``ref``, logging a progress line (WARNING) on a really long wait.

    The first line comes after :func:`progress_after_s` (15 s, or
    ``TWINKLE_PROGRESS_AFTER_S``), then one every ``PROGRESS_EVERY_S``. ``began``: when the
    wait began (``time.monotonic()``; default now), which both the lines and ``timeout_s``
    count from.

    Example::

        desc = wait_with_progress(dispatcher.start.remote(), "start-up of gang g/Model", 300)
    """
    progress = Progress(began)
    while True:
        elapsed = progress.elapsed()
        step = 1.0 if timeout_s is None else max(0.0, min(1.0, timeout_s - elapsed))
        ready, _ = ray.wait([ref], timeout=step)
        if ready:
            return ray.get(ref)
        if timeout_s is not None and progress.elapsed() >= timeout_s:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g}s")
        progress.note(lambda s: f"{what}: still waiting after {s:.0f}s")
