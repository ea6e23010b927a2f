"""Building one generation of a gang: workers, torch.distributed, constructors, saved state.

Every build (the first and each rebuild) re-reads where the gang's bundles
are (after a node loss Ray re-places them, and the nodes, devices and
rendezvous address follow), creates one worker actor per rank, starts
torch.distributed and the user's constructor on all of them, records each
rank's actor id and node, restores the state last saved (a rebuild) and
starts the watch. A build that fails kills what it made; one bounded by
``start_timeout_s`` that runs late names the ranks it waited for and on what.

Example::

    builder = Builder(state, deaths, health)
    await builder.start_within(spec.start_timeout_s)
    await builder.kill(graceful=True)
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from ..core.saved import kept_saves, newest_complete, saved_places
from .aio import RankFailed, all_or_first_error, quiet
from .errors import cause_text, portable
from .health import PROGRESS_QUERY_S, DeathRecord, Health
from .placement import refresh_slots
from .ranks import GangState, RankState
from .worker import WorkerInfo, make_worker

logger = logging.getLogger(__name__)

STOP_GRACE_S = 2.0
# What a start past its deadline names when a rank did not say what it was doing.
START = "the start (torch.distributed init and the constructor)"


def own_error(e: BaseException) -> Exception | None:
    """The exception a rank's own code raised in ``e`` (a Ray task error's cause), or None for
    Ray's errors (a death, a system error): what a start that failed raises, with its type
    kept, as the constructor raises it in local mode."""
    from ray.exceptions import RayError

    cause = getattr(e, "cause", None) if isinstance(e, RayError) else None
    if isinstance(cause, Exception) and not isinstance(cause, RayError):
        return cause
    return None


class Builder:
    """Builds and tears down one gang's generations (plain Python, owned by its dispatcher)."""

    def __init__(self, state: GangState, deaths: DeathRecord, health: Health):
        self.state = state
        self.deaths = deaths
        self.health = health
        spec = state.spec
        # per bundle: this gang takes its devices (rank order may change when bundles move)
        self._owns = {s.bundle_index: o for s, o in zip(spec.slots, spec.owns, strict=True)}
        # the gang's saves, oldest first (core.saved.kept_saves): per rank, a state held in
        # memory (ObjectRef) or its file; a rebuild restores the newest that still exists
        self.saves: list[list] = []
        self.saves_lost: str | None = None  # why the saves were forgotten (said at next start)
        # what a start under way waits for: (what, rank -> its ref), named if it is too late
        self._start_waits: tuple[str, dict[int, Any]] | None = None

    async def start(self) -> None:
        """Create the workers, join torch.distributed, build the user's instance."""
        st = self.state
        spec, g = st.spec, st.spec.group
        st.generation += 1
        gen = st.generation
        # Every (re)build asks where the bundles are now: after a node loss Ray re-places them,
        # and the nodes, devices and rendezvous address must follow (never the initialize() ones).
        st.slots = await refresh_slots(g, spec.pg, st.slots, timeout_s=spec.placement_timeout_s)
        slots = st.slots
        n = len(slots)
        node_rank: dict[str, int] = {}
        for s in slots:
            node_rank.setdefault(s.node_id, len(node_rank))
        # One node: the rendezvous is reached over loopback, nothing else needs to see it.
        master_addr = "127.0.0.1" if len(node_rank) == 1 else slots[0].node_ip
        me = ray.get_runtime_context().current_actor  # workers report failures to it
        distributed = spec.distributed if spec.distributed is not None else n > 1
        st.distributed = distributed
        infos = []
        for rank, s in enumerate(slots):
            same_node = [r for r, t in enumerate(slots) if t.node_id == s.node_id]
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
                    distributed=distributed,
                    stuck_grace_s=spec.stuck_grace_s,
                )
            )
        st.master_addr = master_addr
        owns = [self._owns[s.bundle_index] for s in slots]
        st.ranks = [
            RankState(rank, info.name, s, make_worker(
                info,
                spec.pg,
                s.bundle_index,
                resource_name=g.resource_name,
                amount=g.gpus_per_worker if own and not s.assigned else 0,
                cpus=g.cpus_per_worker if own else 0,
                namespace=spec.namespace,
            ))
            for rank, (info, s, own) in enumerate(zip(infos, slots, owns, strict=True))
        ]
        workers = st.workers = [r.worker for r in st.ranks]
        try:
            endpoint = workers[0].endpoint.remote()
            self._start_waits = ("the worker actor", {0: endpoint})
            _, port = await endpoint
            starts = [
                w.start.remote(port, distributed, spec.dist_timeout_s, spec.seed, spec.payload)
                for w in workers
            ]
            idents = [w.identity.remote() for w in workers]  # (its own concurrency group: at once)
            self._start_waits = (START, dict(enumerate(starts)))
            started = await all_or_first_error(starts)
            self._start_waits = ("the worker actor", dict(enumerate(idents)))
            ids = await asyncio.gather(*idents)
            for r, (actor_id, node_id, node_ip) in zip(st.ranks, ids, strict=True):
                r.actor_id, r.node_id, r.node_ip = actor_id, node_id, node_ip
                st.table[actor_id] = r.row
            saved = await self._restorable(workers)
            if saved is not None:  # a rebuild: every rank gets its last saved state back
                loads = [w.load_state.remote(s) for w, s in zip(workers, saved, strict=True)]
                self._start_waits = ("load_state_dict", dict(enumerate(loads)))
                await all_or_first_error(loads)
        except Exception as e:
            await self.kill()
            rank = e.rank if isinstance(e, RankFailed) else None
            e = e.error if isinstance(e, RankFailed) else e
            why = (f"gang {spec.label} failed to start"
                   + (f" (rank {rank})" if rank is not None else "") + f": {cause_text(e)}")
            own = own_error(e) if gen == 1 else None
            if own is not None:  # the constructor's own exception, as in local mode: type kept
                own.add_note(why)
                raise portable(own) from None  # (pickled again, to the caller: see portable)
            raise RuntimeError(why) from None
        self._start_waits = None
        st.backend = started[0][0]
        for r, (_, pid) in zip(st.ranks, started, strict=True):
            r.pid = pid
        self.deaths.revived()
        self.health.watch(gen, list(workers))

    @property
    def saved(self) -> list | None:
        """The newest save (per rank), None without any."""
        return self.saves[-1] if self.saves else None

    def keep_save(self, save: list) -> None:
        """A save made (per rank: its state's ref or its file)."""
        self.saves = kept_saves(self.saves, save)
        self.saves_lost = None

    async def _restorable(self, workers: list) -> list | None:
        """The newest save every rank still finds (a save to files may have been aborted or
        pruned since: an older one is restored, and said so); None without any save (a
        constructor's state, said so when saves were forgotten). FileNotFoundError naming
        the files missing when none is found: the saves are forgotten, so the next build
        starts from the constructor."""
        label = self.state.spec.label
        if not self.saves:
            if self.saves_lost is not None:
                logger.warning("gang %s: rebuilt from its constructor, without a saved state "
                               "(%s)", label, self.saves_lost)
                self.saves_lost = None
            return None
        newest_first = self.saves[::-1]
        if not all(isinstance(x, str) for x in newest_first[0]):
            return newest_first[0]  # held in memory: always there
        asks = [w.saved_found.remote([e[r] for e in newest_first]) for r, w in enumerate(workers)]
        self._start_waits = ("the check of the saved files", dict(enumerate(asks)))
        found = await asyncio.gather(*asks)
        i = newest_complete(found)
        # named where a complete save is (a CheckpointDir save's folder renamed to step-N)
        missing = [[saved_places(e[r])[-1] for r in range(len(workers)) if not found[r][j]]
                   for j, e in enumerate(newest_first)]
        if i is None:
            looked = "; ".join(f"{m[0]}" + (f" (and {len(m) - 1} more)" if len(m) > 1 else "")
                               for m in missing)
            self.saves, self.saves_lost = [], (
                f"none of its {len(newest_first)} last save(s) to files is found any more: "
                f"missing {looked}")
            raise FileNotFoundError(
                f"no saved state of gang {label} is found any more (aborted or pruned since it "
                f"was saved): missing {looked}. The next restart() rebuilds it from its "
                f"constructor")
        where = os.path.dirname(saved_places(newest_first[i][0])[-1])
        if i == 0:
            logger.info("gang %s: restoring the state saved in %s", label, where)
        else:
            gone = ", ".join(os.path.dirname(m[0]) for m in missing[:i])
            logger.warning("gang %s: restoring an older state, saved in %s: the %d newer "
                           "save(s) are gone (%s)", label, where, i, gone)
        if i:  # the ones that are gone are never looked for again
            self.saves = self.saves[:len(self.saves) - i]
        return newest_first[i]

    async def kill(self, graceful: bool = False) -> None:
        """Kill the current workers (``graceful``: let them leave torch.distributed first)."""
        st = self.state
        st.generation += 1  # watchers of the old generation now ignore deaths
        workers, st.workers = st.workers, []
        st.chunks.clear()  # balanced calls of this generation end: no chunk is handed out again
        self.health.unwatch()
        if graceful and workers:
            await asyncio.wait([asyncio.ensure_future(quiet(w.stop.remote())) for w in workers],
                               timeout=STOP_GRACE_S)
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already dead
                logger.debug("kill of a dead worker", exc_info=True)

    async def start_within(self, limit: float | None) -> None:
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
        await self.kill()
        raise RuntimeError(f"gang {self.state.label} failed to start: {late} did not finish "
                           f"within start_timeout_s={limit:g}s (what was built is killed)")

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
        workers = list(self.state.workers)
        asks = [asyncio.ensure_future(quiet(workers[r].start_phase.remote())) for r in late]
        done, _ = await asyncio.wait(asks, timeout=PROGRESS_QUERY_S)
        phases: dict[str, list[int]] = {}
        for r, t in zip(late, asks, strict=True):
            phase = (t.result() if t in done else None) or START
            phases.setdefault(phase, []).append(r)
        for t in asks:
            t.cancel()
        return " and ".join(f"{phase} of rank(s) {ranks}" for phase, ranks in phases.items())
