"""A call beside a running balanced call: the in-flight weight sync, and the gang's weight version.

A method marked ``beside`` (:class:`~twinkle_ray.core.functions.RemoteFunction`; the weight
receive, ``WeightSyncMixin.weight_sync_recv``) issued while a balanced call runs on the gang
does not queue behind that call. The dispatcher submits it to the worker's ``beside``
concurrency group (``GangWorker.run_beside``), naming the balanced call it runs beside; the
worker waits until that call has started there (or ended), then:

- an ``async def`` balanced method whose class has ``pause_generation`` and
  ``resume_generation`` (vLLM's names): ``pause_generation()`` runs on the worker's event loop
  (awaited when it is a coroutine), the call itself on the beside thread (the loop keeps
  running: a hook may drive an async engine with ``asyncio.run_coroutine_threadsafe``), then
  ``resume_generation()`` on the loop, always, even when the call raised;
- an ``async def`` method without them: the call runs on the loop's own thread, a blocking
  call, so every request coroutine is suspended at an await while it runs;
- a plain balanced method: the call runs on the call's own thread between two chunks.

Later calls of the gang still run after it on every rank: each carries the number of the last
beside call before it (``Task.follows``) and the worker's ``run`` waits until that one has
ended there (:meth:`Flow.wait_beside`).

The gang's weight version (:class:`Versions`) is the runtime's, never an attribute of the
user's instance: a call that carries a version (``Task.version``: the sender's sync number)
sets it on success, before the engine resumes; a balanced chunk reads it when it starts and
when it ends (``Completed.versions``), and ``max_staleness`` listens for its changes.

Example (what the worker does)::

    flow = Flow()
    flow.started(7); ...; flow.ended_call(7)       # run(): call 7 on the run thread
    flow.wait_started(7)                           # run_beside(): call 7 has started here
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Versions:
    """The gang's weight version on this worker (syncs applied), and who listens for changes.

    >>> v = Versions(); seen = []; v.listen(seen.append); v.set(3); v.value, seen
    (3, [3])
    """

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()
        self._listeners: list[Callable[[int], None]] = []

    def set(self, value: int) -> None:
        with self._lock:
            self.value = int(value)
            listeners = list(self._listeners)
        for fn in listeners:
            fn(self.value)

    def listen(self, fn: Callable[[int], None]) -> None:
        with self._lock:
            self._listeners.append(fn)

    def unlisten(self, fn: Callable[[int], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)


class Flow:
    """Which calls have started and ended on this worker, on the run thread and beside it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.current: int | str | None = None  # the run thread's call now (None: idle)
        self.ended = -1  # the last call that ended on the run thread
        self.beside_ended = -1  # the last beside call that ended

    def started(self, seq: int) -> None:
        with self.cond:
            self.current = seq
            self.cond.notify_all()

    def ended_call(self, seq: int) -> None:
        with self.cond:
            self.current, self.ended = None, seq
            self.cond.notify_all()

    def ended_beside(self, seq: int) -> None:
        with self.cond:
            self.beside_ended = max(self.beside_ended, seq)
            self.cond.notify_all()

    def wait_started(self, seq: int) -> None:
        """Until call ``seq`` runs on the run thread or has ended there."""
        with self.cond:
            self.cond.wait_for(lambda: self.current == seq or self.ended >= seq)

    def wait_beside(self, seq: int) -> None:
        """Until beside call ``seq`` has ended (a later call of the gang runs after it)."""
        with self.cond:
            self.cond.wait_for(lambda: self.beside_ended >= seq)


class Running:
    """The balanced call running on this worker, as a beside call sees it (see the module
    docstring). ``is_async``: its method is ``async def`` (it runs on the worker's loop)."""

    def __init__(self, seq: int, is_async: bool):
        self.seq, self.is_async = seq, is_async
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._open = True

    def between_chunks(self) -> None:
        """A plain method's chunk loop, between two chunks: run the beside calls waiting."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                fn, fut = self._pending.pop(0)
            _settle(fn, fut)

    def close(self) -> None:
        """The balanced call ends here: run what still waits; later beside calls run alone."""
        with self._lock:
            self._open = False
            pending, self._pending = self._pending, []
        for fn, fut in pending:
            _settle(fn, fut)

    def beside(self, fn: Callable[[], Any], instance: Any, loop: Any) -> Any:
        """Run ``fn`` (the call, and its version set) beside this balanced call."""
        if not self.is_async:
            with self._lock:
                if self._open:
                    fut: concurrent.futures.Future = concurrent.futures.Future()
                    self._pending.append((fn, fut))
                else:
                    fut = None
            return fn() if fut is None else fut.result()
        pause = getattr(instance, "pause_generation", None)
        resume = getattr(instance, "resume_generation", None)
        if not (callable(pause) and callable(resume)):  # paused at the coroutines' awaits
            return loop.call(fn)
        failed = True
        try:
            loop.call(pause)
            out = fn()
            failed = False
        finally:  # resumed always: after a failed pause or receive too
            try:
                loop.call(resume)
            except Exception:
                if not failed:
                    raise
                # the first error is the one to raise
                logger.warning("resume_generation() failed after a failed call beside call %s",
                               self.seq, exc_info=True)
        return out


def _settle(fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
    try:
        fut.set_result(fn())
    except BaseException as e:  # the beside call's own error, raised on its thread
        fut.set_exception(e)

