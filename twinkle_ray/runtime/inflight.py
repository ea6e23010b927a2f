"""Requests in flight: a worker's own event loop, and the completions a balanced call streams.

Two worker-side pieces of ``remote_function(dispatch='balance', in_flight=k)``:

- :class:`WorkerLoop`: an asyncio loop on a thread of the worker's own, started on first
  use. A balanced call on an ``async def`` method runs its chunk loop there
  (:func:`twinkle_ray.runtime.balance.run_chunks`): k coroutines each ask the dispatcher for
  the next chunk the moment their own one finishes. The call's task thread only waits for
  that loop; the worker's control methods (health, progress) run on their own threads, so
  no user coroutine ever blocks them.
- :class:`StreamBook`: each balanced call's finished chunks on this worker, in the order
  they finished, for :meth:`GangWorker.stream` (a streaming generator the caller of
  ``LazyResult.as_completed`` submits to one worker per data-parallel group). Results go
  from the worker to the reader as Ray objects the reader owns; the dispatcher never sees
  them. Memory: a call's entry holds its finished chunks until it is read to its end, or,
  unread, until ``STREAMS_KEPT`` later calls have ended here.

Example::

    book = StreamBook()
    entry = book.open(7)              # the call's chunk loop, at its start
    entry.add([(0, 1, ["a"], (0, 0))])
    entry.end()
    list(book.read(7, ended=lambda: 7))   # [[(0, 1, ['a'], (0, 0))]]
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

STREAMS_KEPT = 4  # ended calls whose unread completions a worker keeps for a late reader
GONE_KEPT = 1024  # numbers of calls whose entries went (so a late reader ends at once)
POLL_S = 0.5  # how often a waiting reader looks again at the worker's ended call


class WorkerLoop:
    """An asyncio event loop on a daemon thread of its own (started on first :meth:`run`)."""

    def __init__(self, name: str = "twinkle-inflight"):
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
                thread.start()
                self._loop = loop
            return self._loop

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the loop and wait for its result (raised as itself)."""
        return asyncio.run_coroutine_threadsafe(coro, self._start()).result()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the loop's thread (awaited there when it returns an awaitable) and
        wait for its result: while it blocks, every coroutine of the loop waits at an await."""
        return self.run(_called(fn))

    def listener(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        """``fn`` made safe to call from any thread: it runs on the loop's thread."""
        loop = self._start()
        return lambda value: loop.call_soon_threadsafe(fn, value)


async def _called(fn: Callable[[], Any]) -> Any:
    out = fn()
    if inspect.isawaitable(out):
        out = await out
    return out


class Entry:
    """One call's finished chunks on this worker: ``(start, stop, value, versions)`` each."""

    __slots__ = ("items", "ended", "failed", "cond")

    def __init__(self, cond: threading.Condition):
        self.items: list[tuple] = []
        self.ended = False
        self.failed = False
        self.cond = cond

    def add(self, items: list[tuple]) -> None:
        with self.cond:
            self.items.extend(items)
            self.cond.notify_all()

    def end(self, failed: bool = False) -> None:
        with self.cond:
            self.ended, self.failed = True, failed
            self.cond.notify_all()


class StreamBook:
    """A worker's balanced calls' completions, by call number (see the module docstring)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.entries: dict[int, Entry] = {}
        self.gone: OrderedDict[int, None] = OrderedDict()

    def open(self, seq: int) -> Entry:
        """The entry of call ``seq`` (its chunk loop starts); drops the oldest ended, unread
        entries beyond ``STREAMS_KEPT``."""
        with self.cond:
            entry = self.entries[seq] = Entry(self.cond)
            unread = [s for s, e in self.entries.items() if e.ended]
            for s in unread[:max(0, len(unread) - STREAMS_KEPT)]:
                self._forget(s)
            self.cond.notify_all()
            return entry

    def _forget(self, seq: int) -> None:
        self.entries.pop(seq, None)
        self.gone[seq] = None
        while len(self.gone) > GONE_KEPT:
            self.gone.popitem(last=False)

    def __len__(self) -> int:
        return len(self.entries)

    def read(self, seq: int, ended: Callable[[], int],
             cancelled: Callable[[], bool] = lambda: False) -> Iterator[list[tuple]]:
        """Call ``seq``'s finished chunks in the order they finished, in batches (all that
        finished since the last batch); ends when the call has ended here (its entry is then
        forgotten), at once when it is gone or ``ended()`` (the worker's last ended call)
        has passed it without one (it never ran here: another generation's call), and within
        ``POLL_S`` once ``cancelled()`` (its reader went away: the thread is free again)."""
        with self.cond:
            while seq not in self.entries:
                if seq in self.gone or ended() >= seq or cancelled():
                    return
                self.cond.wait(POLL_S)
            entry = self.entries[seq]
        at = 0
        while True:
            with self.cond:
                while at >= len(entry.items) and not entry.ended:
                    if cancelled():
                        return
                    self.cond.wait(POLL_S)
                batch, at = entry.items[at:], len(entry.items)
                last = entry.ended and at >= len(entry.items)
                if last:
                    self._forget(seq)
            if batch:
                yield batch
            if last:
                return
