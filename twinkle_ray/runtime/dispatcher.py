"""The dispatcher actor: one per gang, async, refs only.

It creates and owns the gang's workers (so they die with it), starts
torch.distributed among them, and is the gang's sequencer: every caller's
calls reach every rank in one order. It routes each call's LazyResult
arguments without waiting for anything: consumer workers get the producers'
length records as top-level task arguments (Ray resolves them before the
task runs) and pull only the producer refs that cover their slice. It
submits the worker tasks and returns their ObjectRefs at once.

Failures: a watch task per worker tells it within milliseconds when one
dies; a worker whose call raised reports it, and ranks of that call still
running ``stuck_grace_s`` later are presumed stuck in a collective. Either
way the gang is torn down whole (survivors are never trusted inside a
collective), the first error is kept for callers, and the gang is rebuilt on
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
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray

from ..core.dispatch import worker_data_ranks
from ..core.group import DeviceGroup
from ..core.routing import peer_workers
from .errors import GangStuckError, WorkerDiedError, describe_actor_death
from .lazy import END_OF_ITERATION, CallOutput, Collected, GangRef, LazyResult, Pieces, Window
from .metrics import GangMetrics, metrics_enabled
from .placement import BundleSlot, refresh_slots
from .proxy import GangProxy
from .worker import WorkerInfo, make_worker

logger = logging.getLogger(__name__)

STOP_GRACE_S = 2.0
# Plans of this many recent calls are kept, so routing one of them into a later call needs
# no fetch of the plan from the caller (who owns it). They keep those outputs alive a while.
RECENT_PLANS = 8
PROGRESS_QUERY_S = 5.0  # how long the stuck check waits for a worker to say what it is running
TURN_WAIT_S = 60.0  # how long a call waits for its caller's previous call to arrive


@dataclass
class GangSpec:
    """What a dispatcher needs to build (and rebuild) its gang."""

    group: DeviceGroup
    cls: type
    label: str  # 'group/Class' (or 'group/Class-2'): prefix of every actor name
    args: tuple
    kwargs: dict
    slots: list[BundleSlot]  # one per worker, in rank order
    owns: list[bool]  # per worker: takes the bundle's devices (first gang on them)
    pg: Any
    mesh: Any = None
    distributed: bool | None = None
    dist_timeout_s: float = 120.0
    placement_timeout_s: float = 60.0  # a rebuild waits this long for its bundles to be placed
    seed: int | None = 42
    namespace: str | None = None
    max_restarts: int = 0
    stuck_grace_s: float | None = 3.0  # None: never presume ranks stuck after a failure
    env: dict[str, str] = field(default_factory=dict)
    # metrics and 'group/Class.method' task names; TWINKLE_METRICS=0 where the gang is created: off
    metrics: bool = field(default_factory=metrics_enabled)

    @property
    def cls_name(self) -> str:
        return self.cls.__name__


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
        self.master_addr: str | None = None  # the rendezvous host of the current build
        # per bundle: this gang takes its devices (rank order may change when bundles move)
        self._owns = {s.bundle_index: o for s, o in zip(spec.slots, spec.owns, strict=True)}
        self.stopped = False
        self._turns: dict[str, int] = {}  # caller id -> sequence number of its next call
        # (caller id, number) -> future of a call that arrived before its predecessor ended:
        # ending a turn wakes exactly the caller's next call, not every waiting one.
        self._turn_waiters: dict[tuple[str, int], asyncio.Future] = {}
        self._watch_task: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self._suspect: asyncio.Task | None = None  # a stuck check after a reported failure
        self._recent: OrderedDict[tuple[str, int], CallOutput] = OrderedDict()  # turn -> plan
        self.seq = 0  # calls submitted (all callers, all generations): the gang's one order
        self.saved: list | None = None  # per rank: last saved state (ObjectRef) or its file
        self.pids: list[int] = []
        self._data_ranks: dict[int, tuple[int, list[int]]] = {}  # gang size -> slice_dp layout
        self._gang_ref: GangRef | None = None  # this gang, as producer of its own inputs
        self.metrics = GangMetrics.create(spec.label, spec.metrics)
        # (method, with length record) -> (the workers list, each worker's bound task method)
        self._submit: dict[tuple[str, bool], tuple[list, list]] = {}

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> dict:
        """Create the workers, join torch.distributed, build the user's instance."""
        spec, g = self.spec, self.spec.group
        self.generation += 1
        gen = self.generation
        # Every (re)build asks where the bundles are now: after a node loss Ray re-places them,
        # and the nodes, devices and rendezvous address must follow (never the initialize() ones).
        spec.slots = await refresh_slots(g, spec.pg, spec.slots, timeout_s=spec.placement_timeout_s)
        n = len(spec.slots)
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
                    backend=g.backend,
                    env={**g.env, **spec.env},
                    dispatcher=me,
                    generation=gen,
                    metrics=spec.label if spec.metrics else None,
                )
            )
        self.master_addr = master_addr
        self.names = [info.name for info in infos]
        owns = [self._owns[s.bundle_index] for s in spec.slots]
        self.workers = [
            make_worker(
                info,
                spec.pg,
                s.bundle_index,
                resource_name=g.resource_name,
                amount=g.gpus_per_worker if own and not s.assigned else 0,
                cpus=g.cpus_per_worker if own else 0,
                namespace=spec.namespace,
            )
            for info, s, own in zip(infos, spec.slots, owns, strict=True)
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
            self.seq += 1
            outs = [w.save_state.options(num_returns=2).remote(path) for w in workers]
        await _all_or_first_error([ok for _, ok in outs])  # tiny flags; the states stay put
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
        """A GangProxy for this gang, for callers that found it by name (GangProxy.lookup)."""
        execute = "first" if len(self.spec.slots) == 1 else "all"
        return GangProxy(self.spec.cls, self._own_gang(), execute, True, self.describe())

    def describe(self) -> dict:
        """The gang's topology: one row per rank."""
        g = self.spec.group
        return {
            "label": self.spec.label,
            "group": g.name,
            "cls": self.spec.cls_name,
            "backend": self.backend,
            "generation": self.generation,
            "restarts": self.restarts,
            "dead": str(self.dead) if self.dead else None,
            "saved_state": self.saved is not None,
            "master_addr": self.master_addr,
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
        """Route and submit one call; return the output refs without waiting for them.

        ``per_worker`` holds each worker's (args, kwargs) as the caller already
        split them (plain values and ObjectRefs); LazyResult arguments in it are
        routed here. ``turn`` = (caller id, sequence number): Ray may start an
        async actor's tasks out of order, so each caller's calls are taken
        strictly in the order it made them, and every rank gets the calls of
        all callers in the one order they are submitted here. ``wait_meta``
        waits for the outputs' length records (iteration uses it to see
        StopIteration). ``collect`` names the caller's collect mode (None:
        unknown); outputs get a length record only when routing them may slice
        by length (each record is one more ObjectRef the caller borrows).
        """
        async with self._turn(turn):
            workers = await self._running_workers()
            n = len(workers)
            if execute == "first":
                targets = [0]
            elif execute == "peer" and caller is not None:
                targets = peer_workers(caller[0], caller[1], n)
            else:
                targets = list(range(n))
            routes: dict[int, list] = {}
            lengths: list = []  # producers' length records: leading arguments of every task
            refs, metas = [], []
            with_meta = wait_meta or _needs_lengths(collect, len(targets))
            self.seq += 1
            if self.metrics is not None:
                self.metrics.called(method)
            submit = self._submitters(method, with_meta, workers)
            for i in targets:
                args, kwargs = per_worker[i] if len(per_worker) > 1 else per_worker[0]
                lead = lengths
                if _has_lazy(args, kwargs):
                    args, kwargs = await self._route(method, args, kwargs, i, dispatch, routes, lengths)
                    lead = lengths + _aligned_refs(len(lengths), args, kwargs)
                head = (method, self.seq, len(lead))
                if with_meta:
                    payload, meta = submit[i].remote(head, *lead, *args, **kwargs)
                    metas.append(meta)
                else:
                    payload = submit[i].remote(head, *lead, *args, **kwargs)
                refs.append(payload)
        ended = False
        if wait_meta:
            ended = any(m == END_OF_ITERATION for m in await asyncio.gather(*metas))
        out = CallOutput(refs=refs, metas=metas, workers=targets, ended=ended)
        if turn is not None:
            self._recent[turn] = out
            if len(self._recent) > RECENT_PLANS:
                self._recent.popitem(last=False)
        return out

    def _submitters(self, method: str, with_meta: bool, workers: list) -> list:
        """Each worker's bound task method for ``method`` (``run`` with two returns, or
        ``run_value``), named 'group/Class.method' for Ray's task list and timeline unless
        metrics are off. Made once per method and set of workers: nothing per call."""
        key = (method, with_meta)
        hit = self._submit.get(key)
        if hit is not None and hit[0] is workers:
            return hit[1]
        opts = {"name": f"{self.spec.label}.{method}"} if self.spec.metrics else {}
        if with_meta:
            bound = [w.run.options(num_returns=2, **opts) for w in workers]
        else:
            bound = [w.run_value.options(**opts) if opts else w.run_value for w in workers]
        self._submit[key] = (workers, bound)
        return bound

    def _own_gang(self) -> GangRef:
        """This gang's GangRef (for proxies; its callers send its own LazyResults without one)."""
        if self._gang_ref is None:
            spec = self.spec
            self._gang_ref = GangRef(spec.group.name, spec.cls_name,
                                     ray.get_runtime_context().current_actor, spec.mesh,
                                     spec.group.gpus_per_worker, len(spec.slots))
        return self._gang_ref

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

    async def _route(self, method, args, kwargs, i, dispatch, routes, lengths):
        async def one(v):
            if not isinstance(v, LazyResult):
                return v
            key = id(v)
            if key not in routes:
                routes[key] = await self._plan_route(method, v, dispatch, lengths)
            return routes[key][i]

        new_args = tuple([await one(a) for a in args])
        new_kwargs = {k: await one(v) for k, v in kwargs.items()}
        return new_args, new_kwargs

    async def _plan_route(self, method: str, lazy: LazyResult, dispatch: Any, lengths: list) -> list:
        """One routed marker per worker of this gang for the LazyResult ``lazy``.

        Waits for nothing but the producer's plan (its dispatcher returns that at
        once; this gang's own recent plans are at hand): when the consumer slices by length, the producer's length records
        are appended to ``lengths`` (the tasks' leading arguments) and each worker
        computes its own window from them.
        """
        out = lazy._out or self._recent.get(lazy._turn) or await lazy._plan_ref
        n = len(self.workers)
        mode = lazy.collect
        producer = lazy.gang if lazy.gang is not None else self._own_gang()  # see _strip_own_gang
        if mode not in ("flatten", "none", "first"):
            whole = Collected(list(out.refs), mode, list(out.workers), producer.mesh,
                              producer.gpus_per_worker, producer, lazy.method)
            return [whole] * n
        k = 1 if mode == "first" else len(out.refs)
        refs, ranks = list(out.refs[:k]), list(out.workers[:k])
        as_list = mode == "none" and k > 1
        # Enough to name the producer on failure (its dispatcher is found by name then): keeps
        # the markers small, since every worker task of the call carries one.
        named = GangRef(producer.group, producer.cls_name, dispatcher=None)
        common = dict(as_list=as_list, producer=named, method=lazy.method, ranks=ranks)
        if dispatch not in ("slice", "slice_dp"):
            return [Pieces(refs, **common)] * n
        if as_list:
            slots, const = None, [1] * k
        else:
            slots, const = (len(lengths), len(lengths) + k), None
            lengths.extend(out.metas[:k])
        g = self.spec.group
        if dispatch == "slice_dp":
            dp = self._data_ranks.get(n)
            if dp is None:  # the mesh is fixed: computed once per gang size
                dp = self._data_ranks[n] = worker_data_ranks(n, self.spec.mesh, g.gpus_per_worker)
            parts, index = dp
        else:
            parts, index = n, list(range(n))
        aligned = k == n == parts and not as_list  # output i is worker i's slice if lengths are even
        where, source = f"{method}() on group '{g.name}'", f"{producer.cls_name}.{lazy.method}"
        if aligned:  # the refs travel as one object, fetched only if lengths are uneven
            held = ray.put(refs)
            return [
                Pieces(None, **common, length_slots=slots, const_lengths=const,
                       window=Window(parts, index[i], where, source), aligned=i,
                       refs_ref=held, n_refs=k, own=refs[i])
                for i in range(n)
            ]
        return [
            Pieces(refs, **common, length_slots=slots, const_lengths=const,
                   window=Window(parts, index[i], where, source), aligned=i if aligned else None)
            for i in range(n)
        ]


def _needs_lengths(collect: str | None, n_outputs: int) -> bool:
    """Whether routing these outputs can slice them by length (see ``_plan_route``).

    'flatten' and 'first' outputs are sliced by their lengths, and so is a
    single 'none' output; several 'none' outputs route as a list of whole
    items, and 'mean'/'sum'/'last_pp'/custom collects route whole.
    """
    if collect is None:  # unknown: keep the records
        return True
    if collect == "none":
        return n_outputs == 1
    return collect in ("flatten", "first")


def _aligned_refs(start: int, args: tuple, kwargs: dict) -> list:
    """The producer refs that routed markers in one worker's arguments take as leading
    arguments (numbered from ``start``); sets each marker's slot."""
    extra = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, Pieces) and v.aligned is not None:
            if v.refs is None and v.own is None:  # the same value twice: its slot is set
                continue
            v.aligned_slot = start + len(extra)
            if v.refs is None:  # moved, so it does not travel nested in the marker too
                extra.append(v.own)
                v.own = None
            else:
                extra.append(v.refs[v.aligned])
    return extra


def _has_lazy(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, LazyResult) for a in args) or any(
        isinstance(v, LazyResult) for v in kwargs.values()
    )


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
