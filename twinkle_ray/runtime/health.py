"""Health: the watch on every worker, the stuck check, and the gang's one death record.

A watch task per worker tells the dispatcher within milliseconds when one
dies; one Ray calls unavailable is watched again every ``OUTAGE_POLL_S``
until Ray says it died, its node is reported dead (a lost node), it answers
again (an outage that ended) or ``OUTAGE_LIMIT_S`` pass ('unreachable').
A worker whose call raised reports it (``report_failure``, with the call's
number); ranks of that same call still running ``stuck_grace_s`` later are
presumed stuck in a collective (only in a gang that joined torch.distributed; for a
balanced call, only the failed rank's tp/pp peers: its data-parallel groups share no
collective, a group's peers do). Either way the failure goes to the rebuild room
(``on_failure``), which tears the gang down.

:class:`DeathRecord` is what callers are told: the current error, the last
death (kept across restarts), each generation's death by worker actor, and
why the last rebuild failed.

Example::

    deaths = DeathRecord()
    health = Health(state, deaths, on_failure=rebuilds.fail)
    health.watch(state.generation, state.workers)
    await deaths.of_actor(actor_id, wait_s=2.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import ray

from ..core.dispatch import worker_data_ranks
from .aio import quiet
from .errors import (
    NODE_LOST,
    OUTAGE,
    PREEMPTED,
    GangRebuildError,
    GangStuckError,
    WorkerDiedError,
    classify_death,
    death_cause,
)
from .ranks import GangState

logger = logging.getLogger(__name__)

STUCK_POLL_S = 0.05  # the stuck check's first look at the ranks (then less often)
LATE = object()  # a rank that did not answer the stuck check in time
PROGRESS_QUERY_S = 5.0  # how long a check waits for a worker to say what it is running
OUTAGE_POLL_S = 0.5
OUTAGE_LIMIT_S = 30.0


class DeathRecord:
    """The gang's one record of its deaths (see the module docstring)."""

    def __init__(self):
        self.error: WorkerDiedError | None = None  # the current gang is down: calls raise this
        self.latest: WorkerDiedError | None = None  # the last death, kept across restarts
        self.by_actor: dict[str, WorkerDiedError] = {}  # each generation's death, by actor id
        self.rebuild_error: str | None = None  # why the last rebuild failed
        self._changed = asyncio.Event()

    def died(self, error: WorkerDiedError, actor_ids: list[str]) -> None:
        """The gang died of ``error``: each of ``actor_ids`` (its workers) died of it."""
        self.error = self.latest = error
        self.by_actor.update(dict.fromkeys(actor_ids, error))
        self._changed.set()
        self._changed = asyncio.Event()

    def cut_short(self, actor_ids: list[str], error: BaseException) -> None:
        """Workers torn down by a ``restart()``, not dead: a call that fails on one of them
        raises ``error`` (a death already recorded for one is kept)."""
        for a in actor_ids:
            self.by_actor.setdefault(a, error)
        self._changed.set()
        self._changed = asyncio.Event()

    def not_rebuilt(self, reason: str, error: GangRebuildError | None) -> None:
        """No rebuild (``reason``); ``error`` (if any) is what calls raise from now on."""
        self.rebuild_error = reason
        if error is not None:
            self.error = error
            logger.error("%s", error)

    def restarting(self) -> WorkerDiedError | None:
        """A restart() begins: forget why a rebuild failed; returns the death it follows."""
        self.rebuild_error = None
        return getattr(self.error, "death", self.error)

    def revived(self) -> None:
        """A build succeeded: the gang takes calls again."""
        self.error = None

    async def last(self, wait_s: float) -> WorkerDiedError | None:
        """The death kept across restarts; waits up to ``wait_s`` for the watch to record one."""
        await self._until(lambda: self.latest is not None, wait_s)
        return self.latest

    async def of_actor(self, actor_id: str, wait_s: float) -> WorkerDiedError | None:
        """The death of the generation of worker ``actor_id`` (waits up to ``wait_s`` for it),
        else the last death."""
        await self._until(lambda: actor_id in self.by_actor, wait_s)
        return self.by_actor.get(actor_id) or self.latest

    async def _until(self, ready: Callable[[], bool], wait_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not ready() and (left := deadline - loop.time()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)


class Health:
    """The watch and the stuck check of one gang (plain Python, owned by its dispatcher)."""

    def __init__(self, state: GangState, deaths: DeathRecord,
                 on_failure: Callable[[WorkerDiedError], Awaitable[None]]):
        self.state = state
        self.deaths = deaths
        self.on_failure = on_failure
        self._watch_task: asyncio.Task | None = None
        # call number -> the stuck check after a failure of that call was reported (dropped when
        # it ends: empty when no check is under way)
        self.suspects: dict[int, asyncio.Task] = {}
        self.reported: dict[int, set[int]] = {}  # call number -> ranks that reported its failure

    # -- the watch -----------------------------------------------------------------------------
    def watch(self, gen: int, workers: list) -> None:
        """Watch generation ``gen``'s workers until one dies (or the generation ends)."""
        self._watch_task = asyncio.ensure_future(self._watch(gen, workers))

    def unwatch(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()

    async def _watch(self, gen: int, workers: list) -> None:
        st = self.state

        async def one(rank, w):
            loop = asyncio.get_running_loop()
            since = None
            while True:
                asked = loop.time()
                try:
                    await w.watch.remote()
                except Exception as e:  # the actor died or is unreachable: watch() never returns
                    d = classify_death(e, st.table)
                    if d is None or d.kind != OUTAGE:
                        return rank, e
                    if since is not None and loop.time() - asked > 2 * OUTAGE_POLL_S:
                        since = None  # it answered for a while: the last outage had ended
                    # Unavailable is not dead: look again until Ray decides, or the node is gone.
                    if since is None:
                        since = loop.time()
                        logger.warning("gang %s: rank %d is unreachable (%s); watching it",
                                       st.label, rank, type(e).__name__)
                    node = st.node_of(rank)
                    if node and node not in await asyncio.to_thread(alive_node_ids):
                        return rank, e
                    if loop.time() - since > OUTAGE_LIMIT_S:
                        return rank, e
                    await asyncio.sleep(OUTAGE_POLL_S)
                    if not st.current(gen):
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
        if not st.current(gen):
            return
        rank, exc = next(iter(done)).result()
        error = await self.death_error(rank, exc)
        if not st.current(gen):
            return
        await self.on_failure(error)

    async def death_error(self, rank: int, exc: BaseException | None) -> WorkerDiedError:
        """The WorkerDiedError for rank ``rank``'s failed watch, classified from Ray's structured
        fields and the actor table (a lost node names every rank that ran on it)."""
        st = self.state
        g, cls = st.spec.group.name, st.spec.cls_name
        if exc is None:
            slot = st.slots[rank]
            return WorkerDiedError(g, cls, rank, slot.node_ip, "its watch ended", slot.node_id)
        alive = await asyncio.to_thread(alive_node_ids)
        d = classify_death(exc, st.table, alive)
        if d is None:  # not an actor error about a worker we know: say what Ray said
            slot = st.slots[rank]
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
            cause += f"; rank(s) {st.ranks_on(d.node_id)} of the gang ran there"
        return WorkerDiedError(g, cls, d.rank, d.node_ip, cause, node_id=d.node_id, kind=kind)

    # -- the stuck check -----------------------------------------------------------------------
    def report_failure(self, gen: int, seq: int, rank: int, method: str, cause: str,
                       balanced: bool = False) -> None:
        """A worker's call ``seq`` raised: check whether peers are left inside that call, stuck
        in a collective (the gang then goes). The reporting rank's next call waits for the
        check's end (``Dispatcher.verdict``). A gang without torch.distributed has no
        collective to be stuck in: no check. A ``balanced`` call hands out no more chunks; its
        data-parallel groups run their own chunks, so only the failed rank's tp/pp peers are
        checked (none when it has no peer). Ranks still on an earlier call are not stuck by
        this one's failure."""
        self.state.chunks.drop(seq)
        grace = self.state.spec.stuck_grace_s
        if grace is None or not self.state.distributed or not self.state.current(gen):
            return
        among = self._peers(rank) if balanced else None
        if among is not None and len(among) <= 1:
            return
        self.reported.setdefault(seq, set()).add(rank)
        if seq not in self.suspects:
            check = asyncio.ensure_future(self._check_stuck(gen, seq, rank, method, cause, grace,
                                                            among))
            self.suspects[seq] = check

            def done(_: object) -> None:
                self.suspects.pop(seq, None)
                self.reported.pop(seq, None)

            check.add_done_callback(done)

    def _peers(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s data-parallel group (its tp/pp peers and itself): those that
        share a balanced call's collectives with it."""
        spec = self.state.spec
        _, data = worker_data_ranks(len(self.state.slots), spec.mesh, spec.group.gpus_per_worker)
        return [r for r, d in enumerate(data) if d == data[rank]]

    async def _check_stuck(self, gen, seq, rank, method, cause, grace,
                           among: list[int] | None = None) -> None:
        """Ask the ranks (``among`` them; None: all) what they run, soon and then less often,
        until none but those that reported this call's failure is inside it (nothing stuck:
        the check ends), or the grace has passed with some still inside (stuck: the gang
        goes). A balanced call asks only the failed rank's data-parallel group: the other
        groups run chunks of their own, never a collective with it."""
        st = self.state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        delay = STUCK_POLL_S
        while True:
            await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))
            if not st.current(gen):
                return
            past = loop.time() >= deadline
            workers = list(st.workers)
            ranks = list(range(len(workers))) if among is None else among
            asks = [asyncio.ensure_future(quiet(workers[r].progress.remote())) for r in ranks]
            done, _ = await asyncio.wait(asks, timeout=PROGRESS_QUERY_S if past else delay)
            reported = self.reported.get(seq, set())
            answers = [(r, t.result() if t in done else LATE) for r, t in zip(ranks, asks, strict=True)]
            # a rank not yet at the call may still enter it: only ranks past it end the check
            if all(r in reported or _past(a, seq) for r, a in answers):
                return
            if past:  # no answer in time: as good as inside (a failed ask, None: a death's)
                inside = [r for r, a in answers
                          if r not in reported and (a is LATE or (a is not None and a[0] == seq))]
                if inside and st.current(gen):
                    await self.on_failure(GangStuckError(
                        st.spec.group.name, st.spec.cls_name, rank, inside, method, cause, grace))
                return
            delay = min(2 * delay, 0.5)

    async def checked(self) -> None:
        """Wait for the stuck checks under way (a failure was reported: were peers left stuck?)."""
        checks = [t for t in self.suspects.values() if not t.done()]
        if checks:
            await asyncio.wait(checks)


def _past(answer: tuple | None, seq: int) -> bool:
    """Whether a rank's progress answer says it is done with call ``seq`` (it ended it, or
    runs a later one)."""
    if answer is None or answer is LATE:
        return False
    current, ended = answer
    return ended >= seq or (isinstance(current, int) and current > seq)


def alive_node_ids() -> set[str]:
    """Ids of the nodes Ray reports alive (a GCS query: run it in a thread)."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
