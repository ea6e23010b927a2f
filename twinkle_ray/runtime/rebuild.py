"""Rebuild: what a failure leads to, and the rebuild itself.

A failure (a death, a stuck collective, an abort) tears the gang down whole
(survivors are never trusted inside a collective) and keeps the error for
callers. The gang's :class:`~twinkle_ray.runtime.restarts.RestartPolicy`
decides whether it is rebuilt automatically; ``restart()`` rebuilds it on
request. A rebuild waits for its bundles to be placed on live nodes (after a
node loss Ray re-places them), then builds a fresh generation within
``start_timeout_s`` with the last saved state restored. A rebuild that fails
leaves the gang down with GangRebuildError saying why; a newer restart() or
stop() ends a rebuild under way and kills what it built.

Example::

    rebuilds = Rebuilder(builder)
    await rebuilds.fail(error)     # teardown, and an automatic rebuild if the policy allows
    await rebuilds.settled()       # no build under way
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from .build import Builder
from .errors import (
    GangRebuildError,
    GangRestartedError,
    PlacementError,
    WorkerDiedError,
    cause_text,
)
from .health import alive_node_ids
from .placement import check_named_nodes, remove
from .restarts import RestartMetrics, RestartPolicy

logger = logging.getLogger(__name__)

PLACEMENT_POLL_S = 0.5


class Rebuilder:
    """One gang's restart policy and rebuilds (plain Python, owned by its dispatcher)."""

    def __init__(self, builder: Builder):
        self.builder = builder
        self.state, self.deaths = builder.state, builder.deaths
        spec = self.state.spec
        # The gang's one budget: the history a respawned dispatcher is handed counts too.
        self.policy = RestartPolicy(spec.max_restarts, spec.restart_window_s,
                                    list(spec.restart_times))
        self.metrics = RestartMetrics.create(spec.label, spec.metrics)
        self.restarts = spec.restarts  # automatic rebuilds started (respawns before this included)
        self.started: list[float] = []  # when this dispatcher's automatic rebuilds started
        # tickets waiting for a rebuild to start: (their event loop, a future). The tickets run in
        # a concurrency group of their own, on another thread and loop: an asyncio.Event set
        # here would never wake them
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        # the highest rebuild its creator holds a ticket for (0: no creator follows it): the
        # creator counts every rebuild, so none starts without a ticket to tell it
        self.tickets = 0
        # the build under way (automatic or restart()); None once it has ended
        self.task: asyncio.Task | None = None

    @property
    def building(self) -> bool:
        return self.task is not None and not self.task.done()

    def _run(self, build) -> None:
        """Start ``build`` as the build under way; ``task`` goes back to None when it ends."""
        task = self.task = asyncio.ensure_future(build)

        def ended(_: asyncio.Task) -> None:
            if self.task is task:
                self.task = None

        task.add_done_callback(ended)

    async def settled(self) -> None:
        """Wait until no build is under way (a build that restart() replaced is followed by its
        replacement). Never cancels the build."""
        while self.building:
            await asyncio.wait([self.task])

    def stop(self) -> None:
        """The gang is being stopped: end a build under way."""
        if self.task is not None:
            self.task.cancel()

    def set_policy(self, max_restarts: int, window_s: float | None = None) -> str:
        """New limits; the rebuilds made so far still count."""
        self.policy = self.policy.limited(max_restarts, window_s)
        return self.policy.describe()

    async def started_at(self, k: int) -> float:
        """When this dispatcher's k-th automatic rebuild started (1-based); waits for it (the
        creator's ticket: see :class:`~twinkle_ray.runtime.restarts.RebuildLedger`)."""
        self.tickets = max(self.tickets, k)
        loop = asyncio.get_running_loop()
        while len(self.started) < k:
            woken = loop.create_future()
            self._waiting.append((loop, woken))
            if len(self.started) < k:  # not started between the check and the append
                await woken
        return self.started[k - 1]

    async def fail(self, error: WorkerDiedError) -> None:
        """The gang is broken: keep ``error`` for callers, tear it down whole, rebuild if allowed.
        A build under way is ended first (and what it built killed): one build at a time."""
        st = self.state
        self.deaths.died(error, st.actor_ids())
        logger.warning("%s", error)
        previous = self._end_build()  # a later build waits for it; a teardown need not
        if st.stopped:
            await self.builder.kill()
            return
        now = time.time()
        # Followed by a creator (a ledger), a rebuild needs a ticket to count it by: without one
        # (more rebuilds than max_restarts since the creator last looked) the budget is spent.
        ticketed = self.tickets == 0 or len(self.started) < self.tickets
        allowed = self.policy.max_restarts > 0 and self.policy.room(now)
        if allowed and ticketed:
            self.policy.allow(now)  # records it
            self.restarts += 1
            self.started.append(now)
            waiting, self._waiting = self._waiting, []
            for loop, woken in waiting:
                try:
                    loop.call_soon_threadsafe(_wake, woken)
                except RuntimeError:  # its loop is closed (the actor is ending): nobody waits
                    logger.debug("a restart ticket's loop is closed", exc_info=True)
            if self.metrics is not None:
                self.metrics.restarted(error.kind)
            logger.warning("gang %s: automatic rebuild %d (%s)", st.label, self.restarts,
                           self.policy.describe())
            self._run(self._rebuild(error, "automatic", previous))
            return
        if self.policy.max_restarts > 0:
            if self.metrics is not None:
                self.metrics.refused_one()
            # the policy's verdict first: a creator's ticket still on its way changes nothing then
            reason = (f"not rebuilt: its restart budget is spent ({self.restarts} automatic "
                      f"rebuild(s); {self.policy.describe()})" if not allowed else
                      f"not rebuilt: {len(self.started)} automatic rebuild(s) since its creator "
                      f"last called it, as many as its restart tickets count between two of "
                      f"its calls; restart() it")
            self.deaths.not_rebuilt(reason, GangRebuildError(error, reason))
        await self.builder.kill()

    def _end_build(self) -> asyncio.Task | None:
        """Cancel the build under way, if any (it kills what it built); returns it, so the next
        build starts only once it has ended."""
        previous = self.task
        if previous is None or previous.done():
            return None
        previous.cancel()
        return previous

    async def restart(self) -> None:
        """A rebuild asked for (``restart()``); ends a build under way first and kills what it
        built. Returns once the gang is settled (up, or down with the rebuild's error)."""
        if self.metrics is not None:
            self.metrics.restarted("manual")
        previous = self._end_build()
        if previous is not None:
            logger.warning("gang %s: restart() asked for during a rebuild; ending that one and "
                           "building afresh", self.state.label)
        else:
            logger.warning("gang %s: restart() asked for; rebuilding it", self.state.label)
        death = self.deaths.restarting()  # what a failed rebuild followed
        # a call in flight on the workers torn down now is cut short by the caller's restart
        self.deaths.cut_short(self.state.actor_ids(),
                              GangRestartedError(self.state.label))
        # As a task of its own, like an automatic rebuild: calls (and a second restart) arriving
        # meanwhile wait for it instead of finding the gang half built.
        self._run(self._rebuild(death, "restart()", previous))
        await self.settled()

    async def _rebuild(self, error: WorkerDiedError | None, how: str,
                       previous: asyncio.Task | None = None) -> None:
        """A rebuild (``how``: 'automatic' after ``error``, or 'restart()'), once ``previous``
        (a build it replaces, cancelled) has ended; if it fails, calls get why
        (GangRebuildError). Cancelled (by restart() or stop()), it kills what it built."""
        if previous is not None:
            await asyncio.wait([previous])
        st = self.state
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await self.builder.kill()
            await self._placement_ready()
            await self.builder.start_within(st.spec.start_timeout_s)
        except asyncio.CancelledError:
            await self.builder.kill()
            raise
        except Exception as e:
            if self.metrics is not None:
                self.metrics.failed()
            reason = cause_text(e) if not isinstance(e, PlacementError) else str(e)
            self.deaths.not_rebuilt(reason, None if st.stopped else GangRebuildError(
                error, reason, how, gang=(st.spec.group.name, st.spec.cls_name)))
            return
        logger.warning("gang %s rebuilt (%s) in %.1fs%s", st.label, how, loop.time() - t0,
                       f" after: {error}" if error is not None else "")

    async def _placement_ready(self) -> None:
        """Wait until every bundle of the gang is placed on a live node (after a node loss Ray
        re-places the bundles that were on it once some node has room). After
        ``placement_timeout_s`` the placement group is removed (nothing stays reserved) and
        PlacementError names the bundles and resources missing."""
        spec, g = self.state.spec, self.state.spec.group
        await asyncio.to_thread(check_named_nodes, g, self.state.slots)
        index = sorted({s.bundle_index for s in self.state.slots})
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


def _placement_state(pg, index: list[int]) -> tuple[str, list[int]]:
    """(the placement group's state, the bundles of ``index`` not placed on a live node)."""
    table = ray.util.placement_group_table(pg)
    alive = alive_node_ids()
    where = table.get("bundles_to_node_id") or {}
    return table.get("state", "?"), [b for b in index if where.get(b) not in alive]


def _wake(woken: asyncio.Future) -> None:
    if not woken.done():
        woken.set_result(None)
