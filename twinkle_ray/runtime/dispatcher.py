"""The dispatcher actor: one per gang, async, refs only.

It creates and owns the gang's workers (so they die with it), starts
torch.distributed among them, and is the gang's sequencer: every caller's
calls reach every rank in one order. A call is taken in four steps: its
caller's **turn** (each caller's calls in the order it made them), the gang's
**health** (a pending stuck check or rebuild first; a dead gang raises), the
**plan** (:mod:`~twinkle_ray.runtime.routing`: target ranks and each one's
:class:`~twinkle_ray.runtime.message.WorkerCall`, LazyResult arguments routed
without waiting for their values) and the **submit**.

Submit, the graph path (default): the dispatcher compiles one Ray Compiled
Graph over its workers at start and after every rebuild
(:mod:`~twinkle_ray.runtime.graph`), and a call is one execution of it. Its
outputs: a result up to 64 KiB pickled comes back by value (as bytes this actor
never unpickles); a larger one stays in its
worker until the dispatcher submits that worker's ``take`` task, whose return
is the output: a Ray object on the worker's node, owned by this actor, whose
lifetime Ray's reference counting decides as for any task output (a ref
passed through a graph channel registers no borrower, so a worker-side
``ray.put`` would be freed under its consumers). ``save_state`` runs as actor
tasks between executions. The task path (``TWINKLE_COMPILED=0``, or a graph
that did not compile) submits one actor task per rank instead and returns the
output refs at once.

Failures: a watch task per worker tells it within milliseconds when one
dies; a worker whose call raised reports it (and, on the graph path, hands
over its exception, which answers the call at once), and ranks of that call
still running ``stuck_grace_s`` later are presumed stuck in a collective.
Either way the gang is torn down whole (survivors are never trusted inside a
collective; the graph goes with it, workers killed first, its teardown never
awaited), the first error is kept for callers, and the gang is rebuilt on
``restart()`` or automatically up to ``max_restarts`` times, with the state
last saved by ``save_state()`` restored on every rank before the next call.

Example (what GangProxy does)::

    d = Dispatcher.options(name="trainer/Model", num_cpus=0).remote(spec)
    ray.get(d.start.remote())
    out = ray.get(d.call.remote("forward", per_worker, "slice_dp", "all", None))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import ray

from .errors import GangStuckError, WorkerDiedError, describe_actor_death
from .graph import GangGraph
from .lazy import END_OF_ITERATION, CallOutput, GangRef
from .message import Kept, Raised
from .metrics import GangMetrics
from .routing import CallPlan, Router
from .spec import GangSpec
from .worker import WorkerInfo, make_worker

logger = logging.getLogger(__name__)

__all__ = ["Dispatcher", "GangSpec", "RemoteDispatcher"]

STOP_GRACE_S = 2.0
PROGRESS_QUERY_S = 5.0  # how long the stuck check waits for a worker to say what it is running
TURN_WAIT_S = 60.0
GRAPH_DEATH_WAIT_S = 5.0  # how long a broken graph's calls wait for the watcher to name the death  # how long a call waits for its caller's previous call to arrive


class Dispatcher:
    """Async actor that owns one gang. See the module docstring."""

    def __init__(self, spec: GangSpec):
        self.spec = spec
        self.workers: list = []
        self.names: list[str] = []
        self.generation = 0
        self.restarts = 0
        self.dead: WorkerDiedError | None = None  # the current gang is dead
        self.last_death: WorkerDiedError | None = None  # kept across restarts for pending calls
        self.backend: str | None = None
        self.stopped = False
        self._turns: dict[str, int] = {}  # caller id -> sequence number of its next call
        # (caller id, number) -> future of a call that arrived before its predecessor ended:
        # ending a turn wakes exactly the caller's next call, not every waiting one.
        self._turn_waiters: dict[tuple[str, int], asyncio.Future] = {}
        self._watch_task: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self._suspect: asyncio.Task | None = None  # a stuck check after a reported failure
        self.seq = 0  # calls submitted (all callers, all generations): the gang's one order
        self.saved: list | None = None  # per rank: last saved state (ObjectRef) or its file
        self.pids: list[int] = []
        self._gang_ref: GangRef | None = None  # this gang (with this actor's handle)
        self._router: Router | None = None
        self.metrics = GangMetrics.create(spec.label, spec.metrics)
        # (method, with length record) -> (the workers list, each worker's bound task method)
        self._bound: dict[tuple[str, bool], tuple[list, list]] = {}
        self.graph: GangGraph | None = None  # the gang's compiled graph (None: the task path)
        self.path = "tasks"  # how calls reach the workers, as describe() reports it
        # graph calls not answered yet: number -> (caller's turn, target ranks, the answer)
        self._pending: dict[int, tuple[tuple | None, list[int], asyncio.Future]] = {}

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> dict:
        """Create the workers, join torch.distributed, build the user's instance."""
        spec, g = self.spec, self.spec.group
        n = len(spec.slots)
        self.generation += 1
        gen = self.generation
        node_rank: dict[str, int] = {}
        for s in spec.slots:
            node_rank.setdefault(s.node_id, len(node_rank))
        # One node: the rendezvous is reached over loopback, nothing else needs to see it.
        master_addr = "127.0.0.1" if len(node_rank) == 1 else spec.slots[0].node_ip
        me = ray.get_runtime_context().current_actor
        infos = []
        for rank, s in enumerate(spec.slots):
            same_node = [r for r, t in enumerate(spec.slots) if t.node_id == s.node_id]
            suffix = f"#{gen - 1}" if gen > 1 else ""
            infos.append(
                WorkerInfo(
                    group=g.name,
                    cls_name=spec.cls_name,
                    name=f"{spec.label}/{rank}{suffix}",
                    rank=rank,
                    world_size=n,
                    local_rank=same_node.index(rank),
                    local_world_size=len(same_node),
                    node_rank=node_rank[s.node_id],
                    master_addr=master_addr,
                    devices=s.devices,
                    visible_devices_env=g.visible_devices_env,
                    kind=g.kind,
                    env={**g.env, **spec.env},
                    dispatcher=me,
                    generation=gen,
                    metrics=spec.label if spec.metrics else None,
                )
            )
        self.names = [info.name for info in infos]
        self.workers = [
            make_worker(
                info,
                spec.pg,
                s.bundle_index,
                resource_name=g.resource_name,
                amount=g.gpus_per_worker if own else 0,
                cpus=g.cpus_per_worker if own else 0,
                namespace=spec.namespace,
            )
            for info, s, own in zip(infos, spec.slots, spec.owns, strict=True)
        ]
        distributed = spec.distributed if spec.distributed is not None else n > 1
        try:
            _, port = await self.workers[0].endpoint.remote()
            starts = [
                w.start.remote(
                    port, distributed, spec.dist_timeout_s, spec.seed, spec.cls, spec.args, spec.kwargs
                )
                for w in self.workers
            ]
            started = await _all_or_first_error(starts)
            if self.saved is not None:  # a rebuild: every rank gets its last saved state back
                await _all_or_first_error(
                    [w.load_state.remote(st) for w, st in zip(self.workers, self.saved, strict=True)]
                )
        except Exception as e:
            await self._kill_workers()
            rank = getattr(e, "_twinkle_rank", None)
            raise RuntimeError(
                f"gang {spec.label} failed to start"
                + (f" (rank {rank})" if rank is not None else "")
                + f": {_cause_text(e)}"
            ) from None
        self.backend = started[0][0]
        self.pids = [pid for _, pid in started]
        self._compile_graph()
        self.dead = None
        self._watch_task = asyncio.ensure_future(self._watch(gen, list(self.workers)))
        return self.describe()

    async def restart(self) -> dict:
        """Tear the gang down (if anything is left) and build a fresh one."""
        if self._restart_task is not None and not self._restart_task.done():
            await self._restart_task
            return self.describe()
        return await self._kill_and_start()

    async def stop(self) -> None:
        """Leave torch.distributed where possible, then kill every worker."""
        self.stopped = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        await self._kill_workers(graceful=True)

    async def _kill_workers(self, graceful: bool = False) -> None:
        self.generation += 1  # watchers of the old generation now ignore deaths
        workers, self.workers = self.workers, []
        if self._watch_task is not None:
            self._watch_task.cancel()
        if graceful and workers:
            await asyncio.wait([asyncio.ensure_future(_quiet(w.stop.remote())) for w in workers],
                               timeout=STOP_GRACE_S)
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already dead
                logger.debug("kill of a dead worker", exc_info=True)
        self._close_graph()

    # -- health --------------------------------------------------------------------------------
    async def _watch(self, gen: int, workers: list) -> None:
        async def one(rank, ref):
            try:
                await ref
            except Exception as e:  # the actor died: that is the only way watch() ends
                return rank, e
            return rank, None

        tasks = [asyncio.ensure_future(one(r, w.watch.remote())) for r, w in enumerate(workers)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        if gen != self.generation or self.stopped:
            return
        rank, exc = next(iter(done)).result()
        node, cause = describe_actor_death(str(exc)) if exc else (None, "watch ended")
        node = node or self.spec.slots[rank].node_ip
        await self._fail(WorkerDiedError(self.spec.group.name, self.spec.cls_name, rank, node, cause))

    async def _fail(self, error: WorkerDiedError) -> None:
        """The gang is broken: keep ``error`` for callers, tear it down whole, rebuild if allowed."""
        self.dead = self.last_death = error
        logger.warning("%s", error)
        if self.restarts < self.spec.max_restarts and not self.stopped:
            self.restarts += 1
            self._restart_task = asyncio.ensure_future(self._kill_and_start())
        else:
            await self._kill_workers()

    async def report_failure(self, gen: int, seq: int, rank: int, method: str, cause: str) -> None:
        """A worker's call raised. Unless a check is already running, look again after the grace
        period: ranks still inside that call (or an earlier one) are stuck, and the gang goes."""
        grace = self.spec.stuck_grace_s
        if grace is None or gen != self.generation or self.stopped:
            return
        if self._suspect is None or self._suspect.done():
            self._suspect = asyncio.ensure_future(self._check_stuck(gen, seq, rank, method, cause, grace))

    async def _check_stuck(self, gen, seq, rank, method, cause, grace) -> None:
        await asyncio.sleep(grace)
        if gen != self.generation or self.stopped:
            return
        workers = list(self.workers)
        asks = [asyncio.ensure_future(_quiet(w.progress.remote())) for w in workers]
        done, _ = await asyncio.wait(asks, timeout=PROGRESS_QUERY_S)
        stuck = []
        for r, t in enumerate(asks):
            current = t.result() if t in done else seq  # no answer in time: as good as stuck
            if current is not None and current <= seq:
                stuck.append(r)
        if stuck and gen == self.generation and not self.stopped:
            await self._fail(GangStuckError(self.spec.group.name, self.spec.cls_name, rank, stuck,
                                            method, cause, grace))

    async def abort(self, reason: str, ranks: list[int] | None = None) -> bool:
        """Tear the gang down because a collective it is in cannot complete (e.g. a weight sync
        whose other end failed). Returns False if the gang was not running."""
        if not self.workers or self.dead is not None:
            return False
        stuck = list(range(len(self.workers))) if ranks is None else list(ranks)
        await self._fail(GangStuckError(self.spec.group.name, self.spec.cls_name, None, stuck,
                                        "a collective with another gang", reason, 0))
        return True

    async def _kill_and_start(self) -> dict:
        await self._kill_workers()
        return await self.start()

    async def _running_workers(self) -> list:
        """The workers once the gang can take a call: after a pending stuck check or rebuild;
        raises the gang's error when it is broken."""
        if self._suspect is not None and not self._suspect.done():
            await asyncio.shield(self._suspect)  # a failure was reported: were peers left stuck?
        if self._restart_task is not None and not self._restart_task.done():
            await asyncio.shield(self._restart_task)  # an automatic rebuild is under way
        if self.dead is not None:
            raise self.dead
        if not self.workers:
            raise RuntimeError(f"gang {self.spec.label} is not running (stopped)")
        return self.workers

    async def save_state(self, path: str | None = None, turn: tuple[str, int] | None = None) -> int:
        """Keep every rank's ``state_dict()`` (ObjectRefs this actor owns, or files under
        ``path``) for the restore after a rebuild. Taken in call order; returns the rank count."""
        async with self._turn(turn):
            workers = await self._running_workers()
            async with self._graph_paused():  # actor tasks, in order with the graph's calls
                self.seq += 1
                outs = [w.save_state.options(num_returns=2).remote(path) for w in workers]
                await _all_or_first_error([ok for _, ok in outs])  # tiny flags; states stay put
        self.saved = [state for state, _ in outs]
        return len(outs)

    async def death(self, wait_s: float = 2.0) -> WorkerDiedError | None:
        """The first death seen (kept across restarts); waits briefly for the watcher to record one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while self.last_death is None and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return self.last_death

    async def check_health(self) -> None:
        """Raise WorkerDiedError if the gang is dead (Serve's health check calls this)."""
        if self.dead is not None:
            raise self.dead
        if not self.workers:
            raise RuntimeError(f"gang {self.spec.label} is not running")

    def proxy(self):
        """A GangProxy for this gang, for callers that found it by name (GangProxy.lookup): the
        same ``execute`` and ``lazy_collect`` as the proxy ``create_gang`` returned."""
        return self.spec.proxy(None, self.describe(), gang=self._own_gang())

    def describe(self) -> dict:
        """The gang's topology: one row per rank."""
        g = self.spec.group
        return {
            "label": self.spec.label,
            "group": g.name,
            "cls": self.spec.cls_name,
            "backend": self.backend,
            "path": self.path,
            "generation": self.generation,
            "restarts": self.restarts,
            "dead": str(self.dead) if self.dead else None,
            "saved_state": self.saved is not None,
            "ranks": [
                {
                    "rank": r,
                    "name": self.names[r] if r < len(self.names) else None,
                    "pid": self.pids[r] if r < len(self.pids) else None,
                    "bundle": s.bundle_index,
                    "node_ip": s.node_ip,
                    "node_id": s.node_id,
                    "devices": list(s.devices),
                }
                for r, s in enumerate(self.spec.slots)
            ],
        }

    # -- calls ---------------------------------------------------------------------------------
    async def call(
        self,
        method: str,
        per_worker: list[tuple[tuple, dict]],
        dispatch: Any,
        execute: str,
        caller: tuple[int, int] | None = None,
        wait_meta: bool = False,
        turn: tuple[str, int] | None = None,
        collect: str | None = None,
    ) -> CallOutput:
        """Take the call's turn, check the gang, plan the call, submit it; return the output refs
        without waiting for them.

        ``per_worker`` holds each worker's (args, kwargs) as the caller already
        split them (plain values and ObjectRefs); LazyResult arguments in it are
        routed by the :class:`~twinkle_ray.runtime.routing.Router`. ``turn`` =
        (caller id, sequence number): Ray may start an async actor's tasks out
        of order, so each caller's calls are taken strictly in the order it made
        them, and every rank gets the calls of all callers in the one order they
        are submitted here. ``wait_meta`` waits for the outputs' length records
        (iteration uses it to see StopIteration). ``collect`` names the caller's
        collect mode (None: unknown); outputs get a length record only when
        routing them may slice by length (each record is one more ObjectRef the
        caller borrows).
        """
        async with self._turn(turn):  # 1. order
            workers = await self._running_workers()  # 2. health
            plan = await self._routing().plan(  # 3. plan
                method, per_worker, dispatch, execute, caller, len(workers),
                wait_meta=wait_meta, collect=collect,
            )
            answer = await self._submit(plan, workers, turn)  # 4. submit
            self._routing().remember(turn, answer)
        out = await answer
        if wait_meta:
            out.ended = any(m == END_OF_ITERATION for m in await _values(out.metas))
        return out

    async def _submit(self, plan: CallPlan, workers: list, turn: tuple | None) -> asyncio.Future:
        """Send a planned call to its ranks: through the gang's compiled graph, or as actor
        tasks when it has none. Returns a future of the call's CallOutput."""
        if self.graph is not None:
            return await self._submit_graph(self.graph, plan, workers, turn)
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(self._submit_tasks(plan, workers))
        return answer

    def _submit_tasks(self, plan: CallPlan, workers: list) -> CallOutput:
        """Send a planned call to its ranks as actor tasks (the task path); takes the next
        number in the gang's one order. Returns at once with the output refs."""
        self.seq += 1
        if self.metrics is not None:
            self.metrics.called(plan.method)
        submit = self._submitters(plan.method, plan.with_meta, workers)
        refs, metas = [], []
        for i, msg in zip(plan.targets, plan.messages(self.seq), strict=True):
            if plan.with_meta:
                payload, meta = submit[i].remote(*msg.task_args(), **msg.kwargs)
                metas.append(meta)
            else:
                payload = submit[i].remote(*msg.task_args(), **msg.kwargs)
            refs.append(payload)
        return CallOutput(refs=refs, metas=metas, workers=list(plan.targets))

    # -- the graph path --------------------------------------------------------------------------
    def _compile_graph(self) -> None:
        """Compile the gang's graph (at start and after every rebuild); on failure, or with
        ``compiled`` off, calls go through actor tasks."""
        self.graph, self.path = None, "tasks"
        if not self.spec.compiled:
            return
        try:
            self.graph = GangGraph.compile(self.workers)
            self.path = "graph"
        except Exception as e:  # e.g. channels Ray cannot set up between these workers
            text = str(e).splitlines()[0][:300] if str(e) else ""
            self.path = f"tasks (the graph did not compile: {type(e).__name__}: {text})"
            logger.warning("gang %s: calls go through actor tasks: %s", self.spec.label, self.path)

    def _close_graph(self) -> None:
        """Tear the graph down (its workers are dead or killed: never waits) and answer the
        calls still in it with the gang's error."""
        graph, self.graph = self.graph, None
        if graph is not None:
            graph.teardown()
        error = self.dead or RuntimeError(f"gang {self.spec.label} is not running (stopped)")
        for _, _, answer in self._pending.values():
            if not answer.done():
                answer.set_exception(error)
        self._pending.clear()

    @contextlib.asynccontextmanager
    async def _graph_paused(self):
        """Around actor tasks of the gang: in-flight graph calls end first, the next waits."""
        graph = self.graph
        if graph is None:
            yield
            return
        async with graph.exclusive():
            yield

    async def _submit_graph(self, graph: GangGraph, plan: CallPlan, workers: list,
                            turn: tuple | None) -> asyncio.Future:
        """One execution of the graph for a planned call (waits for an in-flight slot)."""
        async with graph.order():
            if graph is not self.graph:  # torn down while this call waited for its slot
                raise self.dead or RuntimeError(f"gang {self.spec.label} is not running")
            self.seq += 1
            seq = self.seq
            if self.metrics is not None:
                self.metrics.called(plan.method)
            inputs: list = [None] * graph.n
            for i, msg in zip(plan.targets, plan.messages(seq), strict=True):
                inputs[i] = msg
            try:
                done = await graph.start(inputs)
            except Exception as e:
                raise self.dead or RuntimeError(f"gang {self.spec.label}: its compiled graph "
                                                f"failed: {e}") from None
        answer = asyncio.get_running_loop().create_future()
        self._pending[seq] = (turn, list(plan.targets), answer)
        asyncio.ensure_future(self._answer(done, seq, plan, workers, answer))
        return answer

    async def _answer(self, done: asyncio.Future, seq: int, plan: CallPlan, workers: list,
                      answer: asyncio.Future) -> None:
        """Turn an execution's per-rank outputs into the call's CallOutput: small results by
        value, large ones as Ray objects made by the worker's ``take`` task (kept on its node,
        owned by this actor, so Ray counts their references as for any task output)."""
        try:
            result = await done
            if isinstance(result, BaseException):
                error = await self._graph_error(result)
                if not answer.done():
                    answer.set_exception(error)
                return
            refs, metas = [], []
            for i in plan.targets:
                body, meta = result[i]
                if isinstance(body, Kept):
                    body = workers[i].take.remote(body.seq)
                refs.append(body)
                metas.append(meta)
            if not answer.done():
                answer.set_result(CallOutput(refs=refs, metas=metas, workers=list(plan.targets)))
        finally:
            self._pending.pop(seq, None)

    async def _graph_error(self, cause: BaseException) -> BaseException:
        """The error for calls of a broken graph: the gang's death, once the watcher has it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GRAPH_DEATH_WAIT_S
        while self.dead is None and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.dead is not None:
            return self.dead
        return RuntimeError(f"gang {self.spec.label}: its compiled graph failed: "
                            f"{type(cause).__name__}: {cause}")

    async def rank_raised(self, gen: int, seq: int, raised: Raised) -> None:
        """A rank's call raised (graph path): answer the call now with that error, without
        waiting for the other ranks (they may be stuck in a collective; see report_failure)."""
        entry = self._pending.get(seq)
        if gen != self.generation or entry is None:
            return
        _, targets, answer = entry
        if not answer.done():
            refs = [raised if r == raised.rank else None for r in targets]
            answer.set_result(CallOutput(refs=refs, metas=[None] * len(targets), workers=targets))

    async def late_ranks(self, turn: tuple) -> list[int]:
        """The ranks still running (or yet to run) the graph call made in ``turn``: what a
        caller's timeout names."""
        found = [(seq, targets) for seq, (t, targets, _) in self._pending.items()
                 if t is not None and tuple(t) == tuple(turn)]
        if not found:
            return []
        seq, targets = found[0]
        workers = list(self.workers)
        asks = [asyncio.ensure_future(_quiet(workers[r].progress.remote())) for r in targets]
        done, _ = await asyncio.wait(asks, timeout=PROGRESS_QUERY_S)
        late = [r for r, t in zip(targets, asks, strict=True)
                if t not in done or (t.result() is not None and t.result() <= seq)]
        return late or list(targets)

    # -- the task path ---------------------------------------------------------------------------
    def _submitters(self, method: str, with_meta: bool, workers: list) -> list:
        """Each worker's bound task method for ``method`` (``run`` with two returns, or
        ``run_value``), named 'group/Class.method' for Ray's task list and timeline unless
        metrics are off. Made once per method and set of workers: nothing per call."""
        key = (method, with_meta)
        hit = self._bound.get(key)
        if hit is not None and hit[0] is workers:
            return hit[1]
        opts = {"name": f"{self.spec.label}.{method}"} if self.spec.metrics else {}
        if with_meta:
            bound = [w.run.options(num_returns=2, **opts) for w in workers]
        else:
            bound = [w.run_value.options(**opts) if opts else w.run_value for w in workers]
        self._bound[key] = (workers, bound)
        return bound

    def _own_gang(self) -> GangRef:
        """This gang's GangRef (for proxies; its callers send its own LazyResults without one)."""
        if self._gang_ref is None:
            self._gang_ref = self.spec.gang_ref(ray.get_runtime_context().current_actor)
        return self._gang_ref

    def _routing(self) -> Router:
        if self._router is None:
            self._router = Router(self.spec, self._own_gang())
        return self._router

    @contextlib.asynccontextmanager
    async def _turn(self, turn: tuple[str, int] | None):
        """Hold the caller's turn: wait until its previous call was submitted, and pass the
        turn on when the body ends (whatever happened in it). None: no order to keep."""
        if turn is None:
            yield
            return
        await self._wait_turn(*turn)
        try:
            yield
        finally:
            self._end_turn(turn[0])

    async def _wait_turn(self, caller: str, seq: int) -> None:
        if self._turns.get(caller, 0) >= seq:  # its turn already (the usual case): no wait
            return
        fut = self._turn_waiters[(caller, seq)] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(fut, TURN_WAIT_S)
        except asyncio.TimeoutError:
            logger.warning("gang %s: call %d of caller %s waited %.0fs for its predecessor; "
                           "going ahead", self.spec.label, seq, caller, TURN_WAIT_S)
        finally:
            self._turn_waiters.pop((caller, seq), None)

    def _end_turn(self, caller: str) -> None:
        nxt = self._turns.get(caller, 0) + 1
        self._turns[caller] = nxt
        fut = self._turn_waiters.get((caller, nxt))
        if fut is not None and not fut.done():
            fut.set_result(None)


async def _all_or_first_error(refs: list) -> list:
    """Await every ref; on the first failure raise it (tagged with its rank) without waiting."""
    async def one(rank, ref):
        try:
            return await ref
        except Exception as e:
            e._twinkle_rank = rank
            raise

    tasks = [asyncio.ensure_future(one(r, ref)) for r, ref in enumerate(refs)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in done:
        if t.exception() is not None:
            for p in pending:
                p.cancel()
            raise t.exception()
    return [t.result() for t in tasks]


async def _values(items: list) -> list:
    """Await the ObjectRefs among ``items``; other values pass as they are."""
    return [await x if isinstance(x, ray.ObjectRef) else x for x in items]


async def _quiet(ref) -> Any:
    """The ref's value, or None if it failed (teardown and probes are best effort)."""
    try:
        return await ref
    except Exception:
        return None


def _cause_text(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    text = str(e)
    if "dead because" in text or "died" in text:
        return describe_actor_death(text)[1]
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


RemoteDispatcher = ray.remote(Dispatcher)
