"""The dispatcher actor: one per gang, async, refs only.

It creates and owns the gang's workers (so they die with it), starts
torch.distributed among them, and is the gang's sequencer: every caller's
calls reach every rank in one order. A call is taken in four steps: its
caller's **turn** (each caller's calls in the order it made them), the gang's
**health** (a pending stuck check or rebuild first; a dead gang raises), the
**plan** (:mod:`~twinkle_ray.runtime.routing`: target ranks and each one's
:class:`~twinkle_ray.runtime.message.WorkerCall`, LazyResult arguments routed
without waiting for their values) and the **submit**.

Submit: one actor task per target rank, in the gang's order (Ray keeps one
submitter's tasks to an actor in order); it returns the output refs at once.

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
    plan, _ = d.call.remote("forward", per_worker, "slice_dp", "all", None)
    out = ray.get(plan)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import ray

from .errors import (
    NODE_LOST,
    OUTAGE,
    PREEMPTED,
    GangRebuildError,
    GangStuckError,
    PlacementError,
    WorkerDiedError,
    classify_death,
    death_cause,
)
from .lazy import END_OF_ITERATION, CallOutput, GangRef
from .metrics import GangMetrics
from .placement import check_named_nodes, refresh_slots, remove
from .restarts import RestartMetrics, RestartPolicy
from .routing import CallPlan, Router
from .spec import GangSpec
from .worker import WorkerInfo, make_worker

logger = logging.getLogger(__name__)

__all__ = ["Dispatcher", "GangSpec", "RemoteDispatcher"]

STOP_GRACE_S = 2.0
# What a start past its deadline names when a rank did not say what it was doing.
START = "the start (torch.distributed init and the constructor)"
PROGRESS_QUERY_S = 5.0  # how long the stuck check waits for a worker to say what it is running
TURN_WAIT_S = 60.0  # how long a call waits for its caller's previous call to arrive
# The turn table keeps the entries of this many callers, those whose turns ended last; older
# ones are dropped (every unpickled proxy copy is a caller: their number has no bound). See
# Dispatcher._wait_turn for why a dropped caller's next call still comes after its previous one.
TURN_CALLERS_KEPT = 256
# A worker Ray calls unavailable (ActorUnavailableError) is watched again every OUTAGE_POLL_S
# until Ray says it died, its node is reported dead (a lost node), it answers again (an outage
# that ended) or OUTAGE_LIMIT_S pass (then it counts as dead: 'unreachable').
OUTAGE_POLL_S = 0.5
OUTAGE_LIMIT_S = 30.0
PLACEMENT_POLL_S = 0.5


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
        # caller id -> number of its next call, least recently ended first (TURN_CALLERS_KEPT)
        self._turns: dict[str, int] = {}
        # (caller id, number) -> future of a call that arrived before its predecessor ended:
        # ending a turn wakes exactly the caller's next call, not every waiting one.
        self._turn_waiters: dict[tuple[str, int], asyncio.Future] = {}
        self._watch_task: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        # call number -> the stuck check after a failure of that call was reported
        self._suspects: dict[int, asyncio.Task] = {}
        self.distributed = False  # the workers joined torch.distributed (a collective can block)
        # what a start under way waits for: (what, rank -> its ref), named if it is too late
        self._start_waits: tuple[str, dict[int, Any]] | None = None
        self.seq = 0  # calls submitted (all callers, all generations): the gang's one order
        self.saved: list | None = None  # per rank: last saved state (ObjectRef) or its file
        self.pids: list[int] = []
        self._gang_ref: GangRef | None = None  # this gang (with this actor's handle)
        self._router: Router | None = None
        self.metrics = GangMetrics.create(spec.label, spec.metrics)
        # (method, with length record) -> (the workers list, each worker's bound task method)
        self._bound: dict[tuple[str, bool], tuple[list, list]] = {}
        self.policy = RestartPolicy(spec.max_restarts, spec.restart_window_s)
        self.restart_metrics = RestartMetrics.create(spec.label, spec.metrics)
        # actor id (hex) -> (rank, node id, node ip) of this gang's workers, all generations:
        # the one table deaths are classified by (see errors.classify_death)
        self.table: dict[str, tuple[int, str | None, str | None]] = {}
        self.where: list[tuple[int, str | None, str | None]] = []  # current workers' rows
        self.ids_now: list[str] = []  # current workers' actor ids
        self.death_by_actor: dict[str, WorkerDiedError] = {}  # each generation's death, by actor
        self.rebuild_error: str | None = None  # why the last automatic rebuild failed
        # (node id, ip) of this actor: named in its death and in topology()
        self.node = (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())

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
                    gpus_per_worker=g.gpus_per_worker,
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
        self.distributed = distributed
        try:
            endpoint = self.workers[0].endpoint.remote()
            self._start_waits = ("the worker actor", {0: endpoint})
            _, port = await endpoint
            starts = [
                w.start.remote(
                    port, distributed, spec.dist_timeout_s, spec.seed, spec.cls, spec.args, spec.kwargs
                )
                for w in self.workers
            ]
            self._start_waits = (START, dict(enumerate(starts)))
            started = await _all_or_first_error(starts)
            idents = [w.identity.remote() for w in self.workers]
            self._start_waits = ("the worker actor", dict(enumerate(idents)))
            ids = await asyncio.gather(*idents)
            self.where = [(rank, node_id, node_ip) for rank, (_, node_id, node_ip) in enumerate(ids)]
            self.ids_now = [actor_id for actor_id, _, _ in ids]
            self.table.update({actor_id: row for (actor_id, _, _), row in zip(ids, self.where, strict=True)})
            if self.saved is not None:  # a rebuild: every rank gets its last saved state back
                loads = [w.load_state.remote(st) for w, st in zip(self.workers, self.saved, strict=True)]
                self._start_waits = ("load_state_dict", dict(enumerate(loads)))
                await _all_or_first_error(loads)
        except Exception as e:
            await self._kill_workers()
            rank = getattr(e, "_twinkle_rank", None)
            raise RuntimeError(
                f"gang {spec.label} failed to start"
                + (f" (rank {rank})" if rank is not None else "")
                + f": {_cause_text(e)}"
            ) from None
        self._start_waits = None
        self.backend = started[0][0]
        self.pids = [pid for _, pid in started]
        self.dead = None
        self._watch_task = asyncio.ensure_future(self._watch(gen, list(self.workers)))
        return self.describe()

    async def restart(self) -> dict:
        """Tear the gang down (if anything is left) and build a fresh one.

        A build under way (an automatic rebuild, or an earlier ``restart()``) is ended first and
        what it built is killed: a restart never waits on a build that hangs. Like every
        rebuild it is bounded by ``start_timeout_s``; if it fails, the gang's error (raised here
        and by later calls) is GangRebuildError saying why.
        """
        if self.stopped:
            raise RuntimeError(f"gang {self.spec.label} is not running (stopped)")
        if self.restart_metrics is not None:
            self.restart_metrics.restarted("manual")
        previous = self._restart_task
        if previous is not None and not previous.done():
            logger.warning("gang %s: restart() asked for during a rebuild; ending that one and "
                           "building afresh", self.spec.label)
            previous.cancel()
        else:
            logger.warning("gang %s: restart() asked for; rebuilding it", self.spec.label)
        self.rebuild_error = None
        death = getattr(self.dead, "death", self.dead)  # what a failed rebuild followed
        # As a task of its own, like an automatic rebuild: calls (and a second restart) arriving
        # meanwhile wait for it instead of finding the gang half built.
        self._restart_task = asyncio.ensure_future(self._rebuild(death, "restart()", previous))
        await self._settled()
        if self.dead is not None:
            raise self.dead
        if not self.workers:
            raise RuntimeError(f"gang {self.spec.label} is not running (stopped)")
        return self.describe()

    async def _settled(self) -> None:
        """Wait until no build is under way (a build that restart() replaced is followed by its
        replacement). Never cancels the build."""
        while self._restart_task is not None and not self._restart_task.done():
            await asyncio.wait([self._restart_task])

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
        async def one(rank, w):
            loop = asyncio.get_running_loop()
            since = None
            while True:
                asked = loop.time()
                try:
                    await w.watch.remote()
                except Exception as e:  # the actor died or is unreachable: watch() never returns
                    d = classify_death(e, self.table)
                    if d is None or d.kind != OUTAGE:
                        return rank, e
                    if since is not None and loop.time() - asked > 2 * OUTAGE_POLL_S:
                        since = None  # it answered for a while: the last outage had ended
                    # Unavailable is not dead: look again until Ray decides, or the node is gone.
                    if since is None:
                        since = loop.time()
                        logger.warning("gang %s: rank %d is unreachable (%s); watching it",
                                       self.spec.label, rank, type(e).__name__)
                    node = self._node_of(rank)
                    if node and node not in await asyncio.to_thread(_alive_node_ids):
                        return rank, e
                    if loop.time() - since > OUTAGE_LIMIT_S:
                        return rank, e
                    await asyncio.sleep(OUTAGE_POLL_S)
                    if gen != self.generation or self.stopped:
                        return rank, None
                    continue
                return rank, None

        tasks = [asyncio.ensure_future(one(r, w)) for r, w in enumerate(workers)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        for t in tasks:
            t.cancel()
        if gen != self.generation or self.stopped:
            return
        rank, exc = next(iter(done)).result()
        error = await self._death_error(rank, exc)
        if gen != self.generation or self.stopped:
            return
        await self._fail(error)

    def _node_of(self, rank: int) -> str | None:
        return self.where[rank][1] if rank < len(self.where) else None

    async def _death_error(self, rank: int, exc: BaseException | None) -> WorkerDiedError:
        """The WorkerDiedError for rank ``rank``'s failed watch, classified from Ray's structured
        fields and this dispatcher's table (a lost node names every rank that ran on it)."""
        g, cls = self.spec.group.name, self.spec.cls_name
        if exc is None:
            slot = self.spec.slots[rank]
            return WorkerDiedError(g, cls, rank, slot.node_ip, "its watch ended", slot.node_id)
        alive = await asyncio.to_thread(_alive_node_ids)
        d = classify_death(exc, self.table, alive)
        if d is None:  # not an actor error about a worker we know: say what Ray said
            slot = self.spec.slots[rank]
            return WorkerDiedError(g, cls, rank, slot.node_ip, death_cause(exc), slot.node_id)
        kind, cause = d.kind, d.cause
        if kind == OUTAGE:
            if d.node_id is not None and d.node_id not in alive:
                kind = NODE_LOST
                cause = f"its node {d.node_ip} ({d.node_id[:8]}) left the cluster"
            else:
                kind = "unreachable"
                cause = f"unreachable for more than {OUTAGE_LIMIT_S:g}s (ActorUnavailableError)"
        if kind in (NODE_LOST, PREEMPTED) and d.node_id is not None:
            there = sorted(r for r, n, _ in self.where if n == d.node_id)
            cause += f"; rank(s) {there} of the gang ran there"
        return WorkerDiedError(g, cls, d.rank, d.node_ip, cause, node_id=d.node_id, kind=kind)

    async def _fail(self, error: WorkerDiedError) -> None:
        """The gang is broken: keep ``error`` for callers, tear it down whole, rebuild if allowed."""
        self.dead = self.last_death = error
        self.death_by_actor.update(dict.fromkeys(self.ids_now, error))
        logger.warning("%s", error)
        if self.stopped:
            await self._kill_workers()
            return
        if self.policy.max_restarts > 0 and self.policy.allow(asyncio.get_running_loop().time()):
            self.restarts += 1
            if self.restart_metrics is not None:
                self.restart_metrics.restarted(error.kind)
            logger.warning("gang %s: automatic rebuild %d (%s)", self.spec.label, self.restarts,
                           self.policy.describe())
            self._restart_task = asyncio.ensure_future(self._rebuild(error, "automatic"))
            return
        if self.policy.max_restarts > 0:
            if self.restart_metrics is not None:
                self.restart_metrics.refused_one()
            self.rebuild_error = (f"not rebuilt: its restart budget is spent ({self.restarts} "
                                  f"automatic rebuild(s); {self.policy.describe()})")
            self.dead = GangRebuildError(error, self.rebuild_error)
            logger.error("%s", self.dead)
        await self._kill_workers()

    async def _rebuild(self, error: WorkerDiedError | None, how: str,
                       previous: asyncio.Task | None = None) -> None:
        """A rebuild (``how``: 'automatic' after ``error``, or 'restart()'), once ``previous``
        (a build it replaces, cancelled) has ended; if it fails, calls get why
        (GangRebuildError). Cancelled (by restart() or stop()), it kills what it built."""
        if previous is not None:
            await asyncio.wait([previous])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await self._kill_and_start()
        except asyncio.CancelledError:
            await self._kill_workers()
            raise
        except Exception as e:
            if self.restart_metrics is not None:
                self.restart_metrics.failed()
            self.rebuild_error = _cause_text(e) if not isinstance(e, PlacementError) else str(e)
            if not self.stopped:
                self.dead = GangRebuildError(error, self.rebuild_error, how,
                                             gang=(self.spec.group.name, self.spec.cls_name))
                logger.error("%s", self.dead)
            return
        logger.warning("gang %s rebuilt (%s) in %.1fs%s", self.spec.label, how, loop.time() - t0,
                       f" after: {error}" if error is not None else "")

    async def _placement_ready(self) -> None:
        """Wait until every bundle of the gang is placed on a live node (after a node loss Ray
        re-places the bundles that were on it once some node has room). After
        ``placement_timeout_s`` the placement group is removed (nothing stays reserved) and
        PlacementError names the bundles and resources missing."""
        spec, g = self.spec, self.spec.group
        await asyncio.to_thread(check_named_nodes, g, spec.slots)
        index = sorted({s.bundle_index for s in spec.slots})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + spec.placement_timeout_s
        while True:
            state, missing = await asyncio.to_thread(_placement_state, spec.pg, index)
            if state == "REMOVED":
                raise PlacementError(f"gang {spec.label}: the placement group of group '{g.name}' "
                                     f"was removed; create the gang again")
            if state == "CREATED" and not missing:
                return
            if loop.time() >= deadline:
                need: dict[str, float] = {}
                for b in missing:
                    for k, v in spec.pg.bundle_specs[b].items():
                        need[k] = need.get(k, 0.0) + v
                have = await asyncio.to_thread(ray.available_resources)
                fmt = ", ".join(f"{k}: {v:g}" for k, v in sorted(need.items()))
                avail = ", ".join(f"{k}: {have.get(k, 0.0):g}" for k in sorted(need))
                if spec.owns_pg:
                    await asyncio.to_thread(remove, spec.pg)
                    left = ("The group's placement group was removed, so nothing stays reserved; "
                            "add capacity and create the gang again")
                else:  # shared with other groups, or adopted (Serve's): not this gang's to remove
                    left = ("The placement group is shared with other groups or owned by its "
                            "creator, so it stays; add capacity and restart() the gang")
                raise PlacementError(
                    f"gang {spec.label} cannot be rebuilt: bundle(s) {missing} of group '{g.name}' "
                    f"found no node within placement_timeout_s={spec.placement_timeout_s:g}s "
                    f"(their node left the cluster): missing {{{fmt}}}, available {{{avail}}}. "
                    + left)
            await asyncio.sleep(PLACEMENT_POLL_S)

    async def report_failure(self, gen: int, seq: int, rank: int, method: str, cause: str) -> None:
        """A worker's call raised. Unless that call is checked already, look again after the
        grace period: ranks still inside that same call are stuck in a collective, and the gang
        goes. A gang without torch.distributed has no collective to be stuck in: no check.
        Ranks still on an earlier call are not stuck by this one's failure."""
        grace = self.spec.stuck_grace_s
        if grace is None or not self.distributed or gen != self.generation or self.stopped:
            return
        if seq not in self._suspects:
            check = asyncio.ensure_future(self._check_stuck(gen, seq, rank, method, cause, grace))
            self._suspects[seq] = check
            check.add_done_callback(lambda _: self._suspects.pop(seq, None))

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
            if current == seq:
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
        await self._placement_ready()
        return await self._start_within(self.spec.start_timeout_s)

    async def _start_within(self, limit: float | None) -> dict:
        """start(), bounded by ``limit`` seconds (a rebuild's ``start_timeout_s``; None: no
        bound). Past it, what the start built is killed and RuntimeError names the ranks it
        waited for and on what (e.g. 'the constructor of rank(s) [1]')."""
        if limit is None:
            return await self.start()
        task = asyncio.ensure_future(self.start())
        try:
            done, _ = await asyncio.wait([task], timeout=limit)
        except asyncio.CancelledError:  # the rebuild was ended: so is its start
            task.cancel()
            await asyncio.wait([task])
            raise
        if task in done:
            return task.result()
        late = await self._late_start()
        task.cancel()
        await asyncio.wait([task])
        await self._kill_workers()
        raise RuntimeError(f"gang {self.spec.label} failed to start: {late} did not finish within "
                           f"start_timeout_s={limit:g}s (what was built is killed)")

    async def _late_start(self) -> str:
        """What a start under way still waits for: which ranks, doing what."""
        what, refs = self._start_waits or ("the start", {})
        if not refs:
            return what
        ready, _ = await asyncio.to_thread(ray.wait, list(refs.values()), num_returns=len(refs),
                                           timeout=0, fetch_local=False)
        late = [r for r, ref in refs.items() if ref not in ready] or list(refs)
        if what != START:
            return f"{what} of rank(s) {late}"
        workers = list(self.workers)
        asks = [asyncio.ensure_future(_quiet(workers[r].start_phase.remote())) for r in late]
        done, _ = await asyncio.wait(asks, timeout=PROGRESS_QUERY_S)
        phases: dict[str, list[int]] = {}
        for r, t in zip(late, asks, strict=True):
            phase = (t.result() if t in done else None) or START
            phases.setdefault(phase, []).append(r)
        for t in asks:
            t.cancel()
        return " and ".join(f"{phase} of rank(s) {ranks}" for phase, ranks in phases.items())

    def set_restart_policy(self, max_restarts: int, window_s: float | None = None) -> str:
        """Replace the gang's restart policy (a Serve replica sets its own limits here)."""
        self.policy = RestartPolicy(max_restarts, window_s)
        return self.policy.describe()

    async def _running_workers(self) -> list:
        """The workers once the gang can take a call: after a pending stuck check or rebuild;
        raises the gang's error when it is broken."""
        checks = [t for t in self._suspects.values() if not t.done()]
        if checks:  # a failure was reported: were peers left stuck?
            await asyncio.wait(checks)
        await self._settled()  # a rebuild is under way
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
            await _all_or_first_error([ok for _, ok in outs])  # tiny flags; states stay put
        self.saved = [state for state, _ in outs]
        return len(outs)

    def keep_saved(self, saved: list) -> None:
        """Take per-rank saved states (files) to restore at start (a rebuilt dispatcher)."""
        self.saved = list(saved)

    async def death(self, wait_s: float = 2.0) -> WorkerDiedError | None:
        """The first death seen (kept across restarts); waits briefly for the watcher to record one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while self.last_death is None and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return self.last_death

    async def death_of(self, actor_id: str | None, wait_s: float = 2.0,
                       ask_producers: bool = True) -> WorkerDiedError | None:
        """The death that explains a failed ref about actor ``actor_id`` (Ray's
        ``RayActorError.actor_id``): this gang's death record if the actor is one of its
        workers (or unknown), else the record of the producer gang whose worker it was (a gang
        whose output this one took as an input). None: no death known."""
        if actor_id is not None and actor_id in self.table:  # ours: that generation's death
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            while actor_id not in self.death_by_actor and loop.time() < deadline:
                await asyncio.sleep(0.02)
            return self.death_by_actor.get(actor_id) or self.last_death
        if actor_id is None:
            return await self.death(wait_s)
        if ask_producers:
            producers = self._router.producers if self._router is not None else {}
            for handle in list(producers.values()):
                try:
                    err = await handle.death_of.remote(actor_id, wait_s, False)
                except Exception:  # that producer's dispatcher is gone too
                    continue
                if err is not None:
                    return err
        return None

    async def check_health(self, wait: bool = False) -> None:
        """Raise WorkerDiedError if the gang is dead (Serve's health check calls this), and an
        error while it is being rebuilt; ``wait`` first waits for a rebuild under way (bounded
        by its ``start_timeout_s``)."""
        if wait:
            await self._settled()
        if self.dead is not None:
            raise self.dead
        if self._restart_task is not None and not self._restart_task.done():
            raise RuntimeError(f"gang {self.spec.label} is being rebuilt (restart())")
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
            "generation": self.generation,
            "restarts": self.restarts,
            "dead": str(self.dead) if self.dead else None,
            "rebuilding": self._restart_task is not None and not self._restart_task.done(),
            "rebuild_error": self.rebuild_error,
            "restart_policy": self.policy.describe(),
            "dispatcher_node": self.node,
            "dispatcher_pid": os.getpid(),
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
    @ray.method(num_returns=2)
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
    ) -> tuple[CallOutput, bool]:
        """Take the call's turn, check the gang, plan the call, submit it; return the output refs
        without waiting for them, and True: a second return that tells the caller's next call
        that this one has settled without holding its outputs (the caller keeps that one, not
        the plan, between calls: an idle caller pins no output it dropped).

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
            out = self._submit(plan, workers)  # 4. submit
            self._routing().remember(turn[:2] if turn else None, out)
        if wait_meta:
            out.ended = any(m == END_OF_ITERATION for m in await _values(out.metas))
        return out, True

    def _submit(self, plan: CallPlan, workers: list) -> CallOutput:
        """Send a planned call to its ranks: one actor task per target rank; takes the next
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

    # -- submitting and routing -----------------------------------------------------------------
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
            self._gang_ref = self.spec.gang_ref(ray.get_runtime_context().current_actor, self.node)
        return self._gang_ref

    def _routing(self) -> Router:
        if self._router is None:
            self._router = Router(self.spec, self._own_gang())
        return self._router

    @contextlib.asynccontextmanager
    async def _turn(self, turn: tuple | None):
        """Hold the caller's turn: wait until its previous call was submitted, and pass the
        turn on when the body ends (whatever happened in it). None: no order to keep.

        ``turn`` is (caller id, number[, [previous call's ref]]): a previous call that Ray
        failed before it reached this actor (its arguments could not be unpickled) never takes
        its turn; its ref settles, and this call goes ahead at once instead of waiting for it.
        """
        if turn is None:
            yield
            return
        await self._wait_turn(turn[0], turn[1], turn[2] if len(turn) > 2 else None)
        try:
            yield
        finally:
            self._end_turn(turn[0], turn[1])

    async def _wait_turn(self, caller: str, seq: int, prev: list | None = None) -> None:
        """Wait until call ``seq`` of ``caller`` may go: its previous call ended its turn here.

        The rule that bounds the table: only the TURN_CALLERS_KEPT callers whose turns ended
        last keep an entry. A caller without one (new, or dropped) and ``seq > 0`` waits for
        its previous call's settled ref ``prev`` to settle: that call's ``call`` returns only after
        its turn ended, so order holds without the entry (at the cost of that one await); a
        previous call still in its turn wakes this one when it ends (``_end_turn``).
        """
        if self._turns.get(caller, 0) >= seq:  # its turn already (the usual case): no wait
            return
        fut = self._turn_waiters[(caller, seq)] = asyncio.get_running_loop().create_future()
        settled = asyncio.ensure_future(_quiet(prev[0])) if prev and prev[0] is not None else None
        try:
            done, _ = await asyncio.wait([t for t in (fut, settled) if t is not None],
                                         timeout=TURN_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
            if fut in done:
                return
            if settled is not None and settled in done and caller not in self._turns:
                # An entry dropped (TURN_CALLERS_KEPT), or a previous call that never arrived.
                logger.debug("gang %s: call %d of caller %s: its previous call has settled; "
                             "going ahead", self.spec.label, seq, caller)
                return
            if settled is not None and settled in done and self._turns[caller] < seq:
                # Settled without taking its turn here: it never arrived. Skip it.
                logger.warning("gang %s: call %d of caller %s never reached the dispatcher (its "
                               "arguments could not be unpickled?); call %d goes ahead",
                               self.spec.label, seq - 1, caller, seq)
                self._turns[caller] = seq
                return
            if not done:
                logger.warning("gang %s: call %d of caller %s waited %.0fs for its predecessor; "
                               "going ahead", self.spec.label, seq, caller, TURN_WAIT_S)
        finally:
            self._turn_waiters.pop((caller, seq), None)
            if settled is not None:
                settled.cancel()

    def _end_turn(self, caller: str, seq: int) -> None:
        """Call ``seq`` of ``caller`` ended its turn: its next call may go. The caller's entry
        moves to the end of the table; the oldest beyond TURN_CALLERS_KEPT are dropped."""
        nxt = max(self._turns.pop(caller, 0), seq + 1)
        self._turns[caller] = nxt
        while len(self._turns) > TURN_CALLERS_KEPT:
            del self._turns[next(iter(self._turns))]
        fut = self._turn_waiters.get((caller, nxt))
        if fut is not None and not fut.done():
            fut.set_result(None)

    def stats(self) -> dict[str, int]:
        """Sizes of the dispatcher's tables, each bounded however many calls and callers it
        has seen: caller turns, calls waiting for their turn, recent plans kept for chaining,
        producer gangs it routed from, and bound task methods.

        Example::

            ray.get(ray.get_actor("trainer/Model").stats.remote())["turns"]   # <= 256
        """
        router = self._router
        return {
            "turns": len(self._turns),
            "turn_waiters": len(self._turn_waiters),
            "recent_plans": len(router.recent) if router is not None else 0,
            "producers": len(router.producers) if router is not None else 0,
            "bound_submitters": len(self._bound),
        }


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
    if isinstance(e, ray.exceptions.RayActorError):
        return death_cause(e)
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _alive_node_ids() -> set[str]:
    """Ids of the nodes Ray reports alive (a GCS query: run it in a thread)."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _placement_state(pg, index: list[int]) -> tuple[str, list[int]]:
    """(the placement group's state, the bundles of ``index`` not placed on a live node)."""
    table = ray.util.placement_group_table(pg)
    alive = _alive_node_ids()
    where = table.get("bundles_to_node_id") or {}
    return table.get("state", "?"), [b for b in index if where.get(b) not in alive]


RemoteDispatcher = ray.remote(Dispatcher)
