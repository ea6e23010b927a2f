"""Awaiting ObjectRefs in the dispatcher: every ref, the first error, quietly, or many at once.

Example::

    values = await all_or_first_error([w.start.remote() for w in workers])
    await quiet(w.stop.remote())          # None if it failed
    got = await ThreadedGets().all(refs)  # one ray.get in a helper thread
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from typing import Any

import ray

# Ray warns once per process when ray.get runs in an async actor, wherever it runs; ThreadedGets
# runs it in a helper thread, never on the event loop, so that warning would be noise.
_NO_BLOCKING_WARNING = ("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")


class RankFailed(Exception):
    """:func:`all_or_first_error`'s failure: rank ``rank``'s ref raised ``error``."""

    def __init__(self, rank: int, error: BaseException):
        super().__init__(f"rank {rank}: {error}")
        self.rank, self.error = rank, error


async def all_or_first_error(refs: list) -> list:
    """Await every ref; on the first failure raise RankFailed (its rank, its error) without
    waiting for the others."""
    async def one(rank, ref):
        try:
            return await ref
        except Exception as e:
            raise RankFailed(rank, e) from e

    tasks = [asyncio.ensure_future(one(r, ref)) for r, ref in enumerate(refs)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in done:
        if t.exception() is not None:
            for p in pending:
                p.cancel()
            raise t.exception()
    return [t.result() for t in tasks]


async def values(items: list) -> list:
    """Await the ObjectRefs among ``items``; other values pass as they are."""
    return [await x if isinstance(x, ray.ObjectRef) else x for x in items]


async def quiet(ref: Any) -> Any:
    """The ref's value, or None if it failed (teardown and probes are best effort)."""
    try:
        return await ref
    except Exception:
        return None


class ThreadedGets:
    """Await the values of many refs with one ``ray.get`` in a helper thread.

    Awaiting N refs on the event loop (``asyncio.gather``) costs a future and a
    loop wake-up per ref: at 32 refs, ~10 ms more than one ``ray.get`` of them
    all on a 2-core machine (`python -m bench.probes`, recorded in BENCHMARKS.md at adea4f8). The helper threads
    are few (``threads``, daemons started on first use, so a get that never ends
    cannot hold the process at exit); when all are busy (that many gets still
    waiting, e.g. long calls of several callers) a get is awaited on the loop
    instead, so none ever queues behind another.

    Example::

        gets = ThreadedGets()
        values = await gets.all([w.run_inline.remote(...) for w in workers])  # raises as ray.get
    """

    def __init__(self, threads: int = 8):
        self._threads = threads
        self._started = 0
        self._busy = 0  # gets a thread is on (changed on the loop only)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    async def all(self, refs: list) -> list:
        """The refs' values; the first failure raises (as ``ray.get`` raises it)."""
        if self._busy >= self._threads:
            return list(await asyncio.gather(*refs))
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self._started <= self._busy:  # every thread started so far is on a get: one more
            if not self._started:
                os.environ.setdefault(*_NO_BLOCKING_WARNING)
            threading.Thread(target=self._serve, name="twinkle-get", daemon=True).start()
            self._started += 1
        self._busy += 1
        self._jobs.put((loop, fut, refs))
        return await fut

    def _serve(self) -> None:
        while True:
            self._one(*self._jobs.get())  # its refs and values go with the call: an idle thread
            # holds none of them (a held result would stay pinned in its worker's store)

    def _one(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, refs: list) -> None:
        try:
            got, failed = ray.get(refs), None
        except BaseException as e:  # handed to the awaiting call as it is
            got, failed = None, e
        try:
            loop.call_soon_threadsafe(self._settle, fut, got, failed)
        except RuntimeError:  # the loop was closed meanwhile: no one is waiting
            pass

    def _settle(self, fut: asyncio.Future, got: Any, failed: BaseException | None) -> None:
        self._busy -= 1
        if fut.cancelled():
            return
        if failed is not None:
            fut.set_exception(failed)
        else:
            fut.set_result(got)
