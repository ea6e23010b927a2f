"""``LazyResult.as_completed``: a balanced call's items, in the order they finish.

The caller asks the gang's dispatcher once for the workers of the call's generation
(``Dispatcher.stream_workers``), then submits one streaming generator task
(``GangWorker.stream``) to the worker read in each data-parallel group (its first on the last
pipeline stage; its tp/pp peers run the same chunks). Each yields batches of finished chunks
as they finish; the objects are the caller's own (Ray's streaming generators), read with
``ray.wait`` over every group's stream: no payload passes through the dispatcher, and the
caller's work is reading results.

When a group's stream ends, that group's record (small: its positions) is fetched with the
call's error contract: a rank that raised raises here (its type kept, its rank named), a dead
worker is a WorkerDiedError. A time limit raises CallTimeoutError naming the groups not done.
Items a worker no longer kept (a reader that came after more than ``STREAMS_KEPT`` later
calls ended there) come last, from the call's outputs, with ``versions`` None.

Example::

    for c in sampler.generate(prompts).as_completed(timeout=600):
        buffer[c.index] = c.value
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import ray
from ray.exceptions import RayError

from ..core.balance import (
    Completed,
    chunk_items,
    group_readers,
    join_items,
    take_items,
    total_items,
)
from ..core.dispatch import worker_data_ranks
from .diagnose import fetch
from .errors import CallTimeoutError, WorkerDiedError

logger = logging.getLogger(__name__)

SUPPORTED = ("a dispatch='balance' call (its result is one item per input, joined in input "
             "order); other calls give their result whole: get()")


def completions(lazy: Any, timeout: float | None, where: str, caller: Any = None
                ) -> Iterator[Completed]:
    """See :meth:`LazyResult.as_completed` (``where`` names the call, ``caller`` is the proxy
    that made it, for its error contract). Raises TypeError at once (not at the first
    ``next``) on a call that is not balanced."""
    start = time.monotonic()
    reply = lazy.reply(timeout)
    if not reply.balanced or reply.stream is None:
        raise TypeError(f"{where}: as_completed() needs {SUPPORTED}")
    deadline = None if timeout is None else start + timeout
    return _stream(lazy, reply, deadline, timeout, where, caller)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Requeue(NamedTuple):
    """How a balanced call runs its undelivered items again after a death (the proxy that made
    it sets one when its gang may be rebuilt, ``max_restarts``): ``n`` items in all;
    ``call(indices)`` makes the same call on those items only (a LazyResult)."""

    n: int
    call: Callable[[list[int]], Any]


def _stream(lazy: Any, reply: Any, deadline: float | None, stated: float | None, where: str,
            caller: Any) -> Iterator[Completed]:
    """The call's items; after a death, with a :class:`Requeue`, those not delivered yet run
    again on the rebuilt gang (each delivered once), and ``get()`` then gives every item in
    input order."""
    delivered: set[int] = set()
    batches: list[tuple[int, int, Any]] = []  # what was streamed: (start, stop, value)
    try:
        yield from _from_gang(lazy, reply, deadline, stated, where, caller, delivered, batches)
    except WorkerDiedError as death:
        again = lazy.requeue
        if again is None:
            raise
        todo = [i for i in range(again.n) if i not in delivered]
        logger.info("%s: %s; %d of %d item(s) undelivered, re-queued on the rebuilt gang", where,
                    str(death).splitlines()[0], len(todo), again.n)
        rerun = again.call(todo)
        for c in rerun.as_completed(timeout=_left(deadline)):
            yield c._replace(index=todo[c.index])
        items = {i: take_items(v, i - s, i - s + 1) for s, e, v in batches for i in range(s, e)}
        value = rerun.get()
        items.update((i, take_items(value, j, j + 1)) for j, i in enumerate(todo))
        lazy.fill(join_items([items[i] for i in range(again.n)]))  # get(): input order


def _from_gang(lazy: Any, reply: Any, deadline: float | None, stated: float | None, where: str,
               caller: Any, delivered: set[int], batches: list) -> Iterator[Completed]:
    gang, method = lazy.gang, lazy.method
    seq, gen = reply.stream
    _, data_ranks = worker_data_ranks(len(reply.workers), gang.mesh, gang.gpus_per_worker,
                                      method, gang.group)
    # data rank -> the worker read (index into reply.workers): its first on the last pp stage
    readers = group_readers(len(reply.workers), gang.mesh, gang.gpus_per_worker)
    handles = None
    try:
        handles = ray.get(gang.dispatcher.stream_workers.remote(gen), timeout=_left(deadline))
    except Exception:  # the dispatcher is gone or busy: the outputs' own error path says why
        handles = None

    def check(ks: list[int]) -> list:
        """The records of workers ``ks`` (the call's error, if they failed, raised)."""
        return fetch([reply.records[k] for k in ks], [reply.workers[k] for k in ks], gang,
                     method, _left(deadline), stated, caller)

    if handles is not None:
        streams = {handles[reply.workers[k]].stream.remote(seq): (d, k) for d, k in readers.items()}
        try:
            yield from _read(streams, reply, deadline, stated, where, check, delivered, batches)
        finally:  # abandoned (closed, dropped) or failed: the workers' readers end too
            for g in streams:
                try:
                    ray.cancel(g)
                except Exception:  # its worker is gone: nothing holds a thread there
                    pass
    yield from _the_rest(lazy, reply, delivered, data_ranks, check)


def _read(streams: dict, reply: Any, deadline: float | None, stated: float | None, where: str,
          check: Any, delivered: set[int], batches: list) -> Iterator[Completed]:
    """Every group's stream read to its end (``streams``: generator -> (data rank, worker);
    each ended one is removed), items yielded as they come."""
    while streams:
        ready, _ = ray.wait(list(streams), num_returns=1, timeout=_left(deadline))
        if not ready:
            late = sorted(reply.workers[k] for _, k in streams.values())
            raise CallTimeoutError(f"{where}: rank(s) {late} did not finish within "
                                   f"{stated:g}s (as_completed)", late)
        for g in ready:
            d, k = streams[g]
            try:
                batch = ray.get(next(g))
            except StopIteration:
                del streams[g]
                check([k])  # raises the group's error, if it failed
                continue
            except RayError:  # the worker died (or its stream broke): named by its record
                del streams[g]
                check([k])
                raise
            for s, e, value, versions in batch:
                batches.append((s, e, value))
                for c in chunk_items(s, e, value, d, versions):
                    delivered.add(c.index)
                    yield c


def _the_rest(lazy: Any, reply: Any, delivered: set[int], data_ranks: list[int], check: Any
              ) -> Iterator[Completed]:
    """Items not streamed (their worker no longer kept them, or the gang was rebuilt since
    the call): from the call's outputs, in input order, ``versions`` None."""
    records = check(list(range(len(reply.workers))))
    positions = [r[1] for r in records]
    n = total_items(positions)
    if len(delivered) >= n:
        return
    value = lazy.get()
    rank_of = {}
    for k, pos in enumerate(positions):
        for s, e in pos or ():
            for i in range(s, e):
                rank_of.setdefault(i, data_ranks[k])
    for i in range(n):
        if i not in delivered:
            item = chunk_items(i, i + 1, _one(value, i), rank_of.get(i, -1), None)[0]
            yield item


def _one(value: Any, i: int) -> Any:
    """Item i of a joined result as a one-item batch (element-wise for tuples)."""
    if isinstance(value, tuple):
        parts = [_one(v, i) for v in value]
        return type(value)(*parts) if hasattr(type(value), "_fields") else tuple(parts)
    return value[i:i + 1]
