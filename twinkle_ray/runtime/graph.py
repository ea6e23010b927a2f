"""GangGraph: the Ray Compiled Graph through which a dispatcher sends its gang's calls.

One graph per gang, compiled by the gang's dispatcher when the gang starts
and again after every rebuild. It has one input per rank and one output per
rank: rank ``i`` reads input ``i`` (``InputNode`` indexing) into the
worker's generic entry ``GangWorker.graph_entry``, which runs the
:class:`~twinkle_ray.runtime.message.WorkerCall` it was given (or nothing,
for a rank that is not a target of the call). Only the compiling process may
execute a graph, and every execution reaches every rank in one order: the
dispatcher's one order per gang, without one task submission per rank.

In flight: at most ``limit`` executions. A call beyond that waits for a slot
in the dispatcher (backpressure); Ray's own capacity error is never reached.
Calls that must run as actor tasks (``save_state``) take the whole graph
with :meth:`GangGraph.exclusive`: in-flight executions finish first, and no
new one starts until the tasks are done, since graph calls and tasks run on
different threads of a worker.

Teardown never waits on the workers: the dispatcher kills them first, and
the graph's own teardown runs on a helper thread.

Example (what the dispatcher does)::

    graph = GangGraph.compile(workers)
    async with graph.order():                    # one execution at a time takes its slot
        done = await graph.start([msg0, msg1, None, msg3])   # one entry per rank
    outputs = await done                         # per rank: (body, meta)
    graph.teardown()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Any

logger = logging.getLogger(__name__)

INFLIGHT_LIMIT = 8  # executions in flight per gang (Ray's default capacity is 10)


class GangGraph:
    """One compiled graph over a gang's workers (see the module docstring)."""

    def __init__(self, compiled: Any, n: int, limit: int):
        self.compiled = compiled
        self.n = n
        self.limit = limit
        self._slots = asyncio.Semaphore(limit)
        self._order = asyncio.Lock()  # a call's number and its execution are taken together
        self.closed = False

    @classmethod
    def compile(cls, workers: list, limit: int = INFLIGHT_LIMIT) -> GangGraph:
        """Compile the graph over ``workers`` (blocks while Ray sets up the channels)."""
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            dag = MultiOutputNode([w.graph_entry.bind(inp[i]) for i, w in enumerate(workers)])
        # Ray's own capacity (DAGContext.max_inflight_executions, 10 unless
        # RAY_CGRAPH_max_inflight_executions says otherwise) stays above ``limit``: the dispatcher
        # queues what is beyond it, so RayCgraphCapacityExceeded never reaches a caller.
        from ray.dag.context import DAGContext

        limit = max(1, min(limit, DAGContext.get_current().max_inflight_executions - 1))
        compiled = dag.experimental_compile(enable_asyncio=True)
        return cls(compiled, len(workers), limit)

    @contextlib.asynccontextmanager
    async def order(self):
        """Hold the gang's order: numbering a call and starting its execution happen under it."""
        async with self._order:
            yield

    async def start(self, inputs: list) -> asyncio.Future:
        """Start one execution (``inputs``: one entry per rank); call under :meth:`order`.

        Waits for an in-flight slot first. Returns a future of the per-rank
        outputs, or of the exception that broke the graph.
        """
        await self._slots.acquire()
        try:
            futs = await self.compiled.execute_async(*inputs)
        except BaseException:
            self._slots.release()
            raise
        done = asyncio.get_running_loop().create_future()
        asyncio.ensure_future(self._read(futs, done))
        return done

    async def _read(self, futs: list, done: asyncio.Future) -> None:
        try:
            result: Any = [await f for f in futs]
        except BaseException as e:  # the graph broke: a worker died, or it was torn down
            result = e
        finally:
            self._slots.release()
        if not done.done():
            done.set_result(result)

    @contextlib.asynccontextmanager
    async def exclusive(self):
        """Run actor tasks in the gang's order: after every in-flight execution, before the next."""
        async with self._order:
            for _ in range(self.limit):
                await self._slots.acquire()
            try:
                yield
            finally:
                for _ in range(self.limit):
                    self._slots.release()

    def teardown(self) -> None:
        """Tear the graph down on a helper thread (its workers are killed already: no wait)."""
        if self.closed:
            return
        self.closed = True

        def run():
            try:
                self.compiled.teardown()
            except Exception:  # the workers are gone: nothing to release
                logger.debug("compiled graph teardown", exc_info=True)

        threading.Thread(target=run, name="twinkle-graph-teardown", daemon=True).start()


def compiled_enabled() -> bool:
    """Whether new gangs send calls through a Compiled Graph when their ``remote_class`` does
    not say: only if ``TWINKLE_COMPILED`` is ``1`` (or ``true``/``yes``/``on``); by default
    calls are actor tasks.

    Not the default because of a cost measured with Ray 2.60: a channel reader waits by
    spinning (``sched_yield``, about 20,000 calls a second), so each worker of an idle gang
    and its dispatcher's reader thread keep a CPU core busy. A plain Ray actor in a compiled
    graph used 5.05 CPU-seconds in 5 idle seconds, and 0.07 outside one.

    >>> import os
    >>> os.environ["TWINKLE_COMPILED"] = "1"; compiled_enabled()
    True
    >>> del os.environ["TWINKLE_COMPILED"]; compiled_enabled()
    False
    """
    return os.environ.get("TWINKLE_COMPILED", "0").strip().lower() in ("1", "true", "yes", "on")
