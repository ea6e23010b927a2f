"""start_together(): the gangs made in one block start up at the same time.

Making a gang (``Cls(..., remote_group='g')``) waits until it is up:
torch.distributed joined and the constructor run on every rank, so a
constructor's error is raised right there. A job with several gangs (a
sampler, a trainer, a reference model) then pays for their start-ups one
after another, though each mostly waits on its own workers. Inside
``with start_together():`` making a gang returns at once, its start-up runs
in the background, and the block's end waits for all of them: after the
block every gang is up, as after plain construction.

- Anything that needs a gang made in the block (a call, ``topology()``,
  pickling it into another gang) first waits for that gang's start-up.
- A start-up that fails: the block's end closes every gang made in the
  block (nothing half-started is left, their devices go back to their
  groups) and raises that error, the first to happen.
- A block that raises: the gangs made in it are closed, and its error goes on.

Example::

    with twinkle.start_together():
        trainer = Trainer(device_mesh=mesh, remote_group="trainer")   # returns at once
        sampler = Sampler(remote_group="sampler")
    # both are up here
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator
from typing import Any

# Ray is imported where it is used: ``import twinkle_ray`` (which exports start_together) must
# not import it, so the pure core stays importable without it.
logger = logging.getLogger(__name__)


class _Block:
    """The gangs made in one start_together() block, while it is open. (A task created in the
    block copies the context, so it can outlive the block and still see it: it must find it
    closed.)"""

    def __init__(self):
        self.made: list = []
        self.open = True


# The innermost start_together() block of this context (None: none).
_BLOCK: contextvars.ContextVar[_Block | None] = contextvars.ContextVar("twinkle_start_together",
                                                                      default=None)


class StartFailed(Exception):
    """Pickling a gang whose start-up failed raises this, carrying that error (``error``), so
    code that names what cannot be pickled (``wire.unpicklable``) raises the error itself."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class Start:
    """One gang's start-up under way: its dispatcher's ``start()`` ref, since when, and its
    ``start_timeout_s`` (None: no bound).

    ``finish`` turns the ref's value, or its error, into the gang's description
    or the error the user sees (the gang's creator knows how); it runs once.
    """

    def __init__(self, ref: Any, what: str, timeout_s: float | None, finish: Any):
        self.ref, self.what, self.timeout_s = ref, what, timeout_s
        self.began = time.monotonic()
        self._finish = finish

    def late(self) -> bool:
        """Whether its ``start_timeout_s`` has passed."""
        return self.timeout_s is not None and time.monotonic() - self.began >= self.timeout_s

    def result(self) -> dict:
        """Wait for the start-up (a progress line on a long wait) and return the gang's
        description, or raise its error (TimeoutError once ``start_timeout_s`` has passed)."""
        from .progress import wait_with_progress

        return self._finish(lambda: wait_with_progress(self.ref, self.what, self.timeout_s,
                                                       began=self.began))


@contextlib.contextmanager
def start_together() -> Iterator[None]:
    """Start every gang made inside the block at the same time; the block's end waits for
    them all (see the module docstring).

    Example::

        with twinkle.start_together():
            trainer = Trainer(remote_group="trainer")
            sampler = Sampler(remote_group="sampler")
        out = sampler.generate(prompts)   # both are up
    """
    block = _Block()
    token = _BLOCK.set(block)
    try:
        yield
    except BaseException:
        _close(block.made, "its start_together() block raised")
        raise
    finally:
        block.open = False
        _BLOCK.reset(token)
    _wait_all(block.made)


def join_or_wait(proxy: Any) -> None:
    """A gang just made: left to start in the open start_together() block, if any, else
    waited for now (a failed start-up closes it and raises)."""
    block = _BLOCK.get()
    if block is None or not block.open:
        proxy.wait_started()
    else:
        block.made.append(proxy)


def _wait_all(proxies: list) -> None:
    """Wait for the start-ups of ``proxies``, reacting to the first that fails (or runs past its
    ``start_timeout_s``): that closes them all and raises its error, as does a start-up whose
    failure another use of the gang met first."""
    try:
        pending = {p.start_under_way.ref: p for p in proxies if p.start_under_way is not None}
        if pending:
            import ray

            from .progress import Progress

            progress = Progress(log=logger)
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0, fetch_local=False)
                for ref in ready:
                    pending.pop(ref).wait_started()  # the description, or the start-up's error
                for ref, p in list(pending.items()):  # closed meanwhile, or late: settled now
                    start = p.start_under_way
                    if start is None or start.late():
                        pending.pop(ref).wait_started()
                if pending:
                    names = ", ".join(p.label for p in pending.values())
                    progress.note(lambda s, names=names: f"start-up of gangs {names}: still "
                                                         f"waiting after {s:.0f}s")
        for p in proxies:
            p.wait_started()  # a start-up that failed where another use met it first raises here
    except BaseException as e:
        _close(proxies, f"another gang of its start_together() block did not start "
                        f"({type(e).__name__})")
        raise


def _close(proxies: list, reason: str) -> None:
    for p in proxies:
        p.close(reason)
