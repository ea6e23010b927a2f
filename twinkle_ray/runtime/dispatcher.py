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
A call with nothing routed goes as a named task, without a head
(:mod:`~twinkle_ray.runtime.message`); the dispatcher notes each such task's
id with the call's number (``GangState.tasks``), which is how a worker names it.

It composes one plain object per job, each in its own module ("room"):

- :mod:`~twinkle_ray.runtime.sequencer` -- the caller's turn;
- :mod:`~twinkle_ray.runtime.health` -- the watch per worker, the stuck check, the death record;
- :mod:`~twinkle_ray.runtime.rebuild` -- teardown, restart policy, rebuilds
  (:mod:`~twinkle_ray.runtime.build` builds each generation, with the saved state restored);
- :mod:`~twinkle_ray.runtime.ranks` -- what they share: one record per rank, the actor table;
- :mod:`~twinkle_ray.runtime.routing` -- the plan of a call.

This module is the actor: its remote methods (lifecycle, the call and its
submit, the queries) over those rooms.

Example (what GangProxy does)::

    d = Dispatcher.options(name="trainer/Model", num_cpus=0).remote(spec)
    ray.get(d.start.remote())
    plan, _ = d.call.remote(CallRequest("forward", per_worker, "slice_dp", "all"))
    out = ray.get(plan)
"""
from __future__ import annotations

import dataclasses
import os

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from .aio import ThreadedGets, all_or_first_error, values
from .build import Builder
from .errors import GangStuckError, WorkerDiedError, death_cause
from .health import DeathRecord, Health
from .lazy import END_OF_ITERATION, CallOutput, GangRef
from .message import CallRequest
from .metrics import GangMetrics
from .ranks import GangState
from .rebuild import Rebuilder
from .routing import CallPlan, Router
from .sequencer import TURN_CALLERS_KEPT, Sequencer
from .spec import GangSpec

__all__ = ["TURN_CALLERS_KEPT", "Dispatcher", "GangSpec", "RemoteDispatcher"]


class Dispatcher:
    """Async actor that owns one gang. See the module docstring."""

    def __init__(self, spec: GangSpec):
        self.spec = spec
        self.state = GangState(spec)  # the ranks and generation every room reads
        self.turns = Sequencer(spec.label)
        self.deaths = DeathRecord()
        self.health = Health(self.state, self.deaths, on_failure=self._fail)
        self.builder = Builder(self.state, self.deaths, self.health)
        self.rebuilds = Rebuilder(self.builder)
        self.seq = 0  # calls submitted (all callers, all generations): the gang's one order
        self._gang_ref: GangRef | None = None  # this gang (with this actor's handle)
        self._router: Router | None = None
        self.metrics = GangMetrics.create(spec.label, spec.metrics)
        # (method, with length record, balanced, inline, named) -> (the workers list, each one's
        # bound task method)
        self._bound: dict[tuple[str, bool, bool, bool, bool], tuple[list, list]] = {}
        # (node id, ip) of this actor: named in its death and in topology()
        self.node = (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
        self.gets = ThreadedGets()  # an eager call's values (see _values_back)

    async def _fail(self, error: WorkerDiedError) -> None:
        await self.rebuilds.fail(error)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> dict:
        """Create the workers, join torch.distributed, build the user's instance."""
        await self.builder.start()
        return self.describe()

    async def restart(self) -> dict:
        """Tear the gang down (if anything is left) and build a fresh one.

        A build under way (an automatic rebuild, or an earlier ``restart()``) is ended first and
        what it built is killed: a restart never waits on a build that hangs. Like every
        rebuild it is bounded by ``start_timeout_s``; if it fails, the gang's error (raised here
        and by later calls) is GangRebuildError saying why.
        """
        if self.state.stopped:
            raise RuntimeError(f"gang {self.spec.label} is not running (stopped)")
        await self.rebuilds.restart()
        if self.deaths.error is not None:
            raise self.deaths.error
        if not self.state.workers:
            raise RuntimeError(f"gang {self.spec.label} is not running (stopped)")
        return self.describe()

    async def stop(self) -> None:
        """Leave torch.distributed where possible, then kill every worker."""
        self.state.stopped = True
        if self.metrics is not None:  # the calls noted since the last flush
            self.metrics.flush()
        self.rebuilds.stop()
        await self.builder.kill(graceful=True)

    async def abort(self, reason: str, ranks: list[int] | None = None) -> bool:
        """Tear the gang down because a collective it is in cannot complete (e.g. a weight sync
        whose other end failed). Returns False if the gang was not running: down, stopped, or
        being (re)built (a build's new workers are in no collective yet)."""
        workers = self.state.workers
        if not workers or self.deaths.error is not None or self.rebuilds.building:
            return False
        stuck = list(range(len(workers))) if ranks is None else list(ranks)
        await self._fail(GangStuckError(self.spec.group.name, self.spec.cls_name, None, stuck,
                                        "a collective with another gang", reason, 0))
        return True

    async def report_failure(self, gen: int, seq: int | str, rank: int, method: str,
                             cause: str) -> None:
        """A worker's call raised (see :meth:`Health.report_failure`: the stuck check); ``seq``
        is its number, or its task's id for a named task."""
        self.health.report_failure(gen, seq, rank, method, cause)

    def set_restart_policy(self, max_restarts: int, window_s: float | None = None) -> str:
        """Replace the gang's restart limits (a Serve replica sets its own here); the
        rebuilds made so far still count."""
        return self.rebuilds.set_policy(max_restarts, window_s)

    async def rebuilt(self, k: int) -> float:
        """When this dispatcher's k-th automatic rebuild started; answered once it starts (the
        creator's ticket: its count of the gang's one restart budget outlives this actor)."""
        return await self.rebuilds.started_at(k)

    async def save_state(self, path: str | None = None, turn: tuple | None = None) -> int:
        """Keep every rank's ``state_dict()`` (ObjectRefs this actor owns, or files under
        ``path``) for the restore after a rebuild. Taken in call order; returns the rank count."""
        async with self.turns.turn(turn):
            workers = await self._running_workers()
            self.seq += 1
            outs = [w.save_state.options(num_returns=2).remote(path) for w in workers]
            await all_or_first_error([ok for _, ok in outs])  # tiny flags; states stay put
        self.builder.saved = [state for state, _ in outs]
        return len(outs)

    def keep_saved(self, saved: list) -> None:
        """Take per-rank saved states (files) to restore at start (a rebuilt dispatcher)."""
        self.builder.saved = list(saved)

    # -- health queries ------------------------------------------------------------------------
    async def death(self, wait_s: float = 2.0) -> WorkerDiedError | None:
        """The last death seen (kept across restarts); waits briefly for the watch to record one."""
        return await self.deaths.last(wait_s)

    async def death_of(self, actor_id: str | None, wait_s: float = 2.0,
                       ask_producers: bool = True) -> WorkerDiedError | None:
        """The death that explains a failed ref about actor ``actor_id`` (Ray's
        ``RayActorError.actor_id``): this gang's death record if the actor is one of its
        workers (or unknown), else the record of the producer gang whose worker it was (a gang
        whose output this one took as an input). None: no death known."""
        if actor_id is not None and actor_id in self.state.table:  # ours: that generation's death
            return await self.deaths.of_actor(actor_id, wait_s)
        if actor_id is None:  # an object was lost (no actor named): ours, or a producer's
            own = await self.deaths.last(wait_s)
            return own if own is not None or not ask_producers else await self._lost_producer()
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

    async def _lost_producer(self) -> WorkerDiedError | None:
        """The first producer gang whose dispatcher is gone (None: none is). It owned the
        outputs and length records this gang's calls took as inputs: a call that failed on a
        lost object while this gang had no death lost one of those."""
        producers = self._router.producers if self._router is not None else {}
        for (group, cls), handle in list(producers.items()):
            try:
                await handle.death.remote(0)
            except ActorUnavailableError:  # unreachable for now, not known dead
                continue
            except RayActorError as e:
                return WorkerDiedError(group, cls, None, None, death_cause(e), kind="dispatcher")
        return None

    async def check_health(self, wait: bool = False) -> None:
        """Raise WorkerDiedError if the gang is dead (Serve's health check calls this), and an
        error while it is being rebuilt; ``wait`` first waits for a rebuild under way (bounded
        by its ``start_timeout_s``)."""
        if wait:
            await self.rebuilds.settled()
        if self.deaths.error is not None:
            raise self.deaths.error
        if self.rebuilds.building:
            raise RuntimeError(f"gang {self.spec.label} is being rebuilt (restart())")
        if not self.state.workers:
            raise RuntimeError(f"gang {self.spec.label} is not running")

    async def _running_workers(self) -> list:
        """The workers once the gang can take a call: after a pending stuck check or rebuild;
        raises the gang's error when it is broken."""
        await self.health.checked()  # a failure was reported: were peers left stuck?
        await self.rebuilds.settled()  # a rebuild is under way
        if self.deaths.error is not None:
            raise self.deaths.error
        if not self.state.workers:
            raise RuntimeError(f"gang {self.spec.label} is not running (stopped)")
        return self.state.workers

    async def proxy(self):
        """A GangProxy for this gang, for callers that found it by name (GangProxy.lookup): the
        same ``execute`` and ``lazy_collect`` as the proxy ``create_gang`` returned. The class
        comes from the workers' payload (only here does the dispatcher unpickle it; never the
        constructor's arguments)."""
        cls = await self.spec.payload[0]
        return self.spec.proxy(None, self.describe(), gang=self._own_gang(), cls=cls)

    def describe(self) -> dict:
        """The gang's topology: one row per rank."""
        g, st, deaths = self.spec.group, self.state, self.deaths
        ranks = st.ranks
        return {
            "label": self.spec.label,
            "group": g.name,
            "cls": self.spec.cls_name,
            "backend": st.backend,
            "generation": st.generation,
            "restarts": self.rebuilds.restarts,
            "dead": str(deaths.error) if deaths.error else None,
            "rebuilding": self.rebuilds.building,
            "rebuild_error": deaths.rebuild_error,
            "restart_policy": self.rebuilds.policy.describe(),
            "dispatcher_node": self.node,
            # with "generation", what names one build: a respawned dispatcher counts from 1 again
            "dispatcher_id": ray.get_runtime_context().get_actor_id(),
            "dispatcher_pid": os.getpid(),
            "saved_state": self.builder.saved is not None,
            "master_addr": st.master_addr,
            "ranks": [
                {
                    "rank": r,
                    "name": ranks[r].name if r < len(ranks) else None,
                    "pid": ranks[r].pid if r < len(ranks) else None,
                    "bundle": s.bundle_index,
                    "node_ip": s.node_ip,
                    "node_id": s.node_id,
                    "devices": list(s.devices),
                }
                for r, s in enumerate(st.slots)
            ],
        }

    # -- calls ---------------------------------------------------------------------------------
    async def skip_turn(self, caller: str, seq: int) -> None:
        """Call ``seq`` of ``caller`` never reached this actor (Ray could not unpickle its
        arguments here; its caller saw that error): that caller's later calls stop waiting for
        it (:meth:`~twinkle_ray.runtime.sequencer.Sequencer.skip`)."""
        self.turns.skip(caller, seq)

    @ray.method(num_returns=2)
    async def call(self, request: CallRequest) -> tuple[CallOutput, bool]:
        """Take the call's turn, check the gang, plan the call, submit it; return the output refs
        without waiting for them, and True: a second return that tells the caller's next call
        that this one has settled without holding its outputs (the caller keeps that one, not
        the plan, between calls: an idle caller pins no output it dropped).

        The :class:`~twinkle_ray.runtime.message.CallRequest` (one argument: cheaper for Ray
        to carry than its fields one by one): ``per_worker`` holds each worker's (args, kwargs)
        as the caller already split them (plain values and ObjectRefs); LazyResult arguments in
        it are routed by the :class:`~twinkle_ray.runtime.routing.Router`. ``turn`` = (caller
        id, sequence number, previous call): Ray may start an async actor's tasks out of order,
        so each caller's calls are taken strictly in the order it made them
        (:class:`~twinkle_ray.runtime.sequencer.Sequencer`), and every rank gets the calls of
        all callers in the one order they are submitted here. ``wait_meta`` waits for the
        outputs' length records (iteration uses it to see StopIteration). ``collect`` names the
        caller's collect mode (None: unknown); outputs get a length record only when routing
        them may slice by length (each record is one more ObjectRef the caller borrows).
        ``inline``: an eager call; once its turn has ended the dispatcher awaits the outputs
        and replies with their values (:mod:`~twinkle_ray.runtime.inline`), or with the refs
        if a rank failed, for the caller to raise the call's error from them.
        """
        method, per_worker, dispatch, execute, caller, wait_meta, turn, collect, inline = request
        async with self.turns.turn(turn):  # 1. order
            workers = await self._running_workers()  # 2. health
            plan = await self._routing().plan(  # 3. plan
                method, per_worker, dispatch, execute, caller, len(workers),
                wait_meta=wait_meta, collect=collect,
            )
            if workers is not self.state.workers:  # rebuilt while planning: the new workers
                workers = await self._running_workers()
            out = self._submit(plan, workers, inline)  # 4. submit
            if not inline:  # an eager call's outputs are never routed
                self._routing().remember(turn[:2] if turn else None, out)
        if inline:
            return await self._values_back(out), True
        if wait_meta:
            out.ended = any(m == END_OF_ITERATION for m in await values(out.metas))
        return out.packed(), True

    async def _values_back(self, out: CallOutput) -> CallOutput:
        """An eager call's reply: its outputs' values in place of the refs once every rank has
        answered (any result not certainly small plain data stays a
        :class:`~twinkle_ray.runtime.inline.Held` ref), or the refs themselves if a rank failed:
        the caller raises the call's error from them, as for a lazy call (which rank, a death or
        the user's exception)."""
        try:
            got = await self.gets.all(out.refs)
        except Exception:
            return out
        return dataclasses.replace(out, refs=[], values=got)

    def _submit(self, plan: CallPlan, workers: list, inline: bool = False) -> CallOutput:
        """Send a planned call to its ranks: one actor task per target rank; takes the next
        number in the gang's one order. Returns at once with the output refs."""
        self.seq += 1
        if self.metrics is not None:
            self.metrics.called(plan.method)
        with_meta = plan.with_meta and not inline
        named = plan.named  # no head: see message
        submit = self._submitters(plan.method, with_meta, workers, plan.balanced, inline, named)
        refs, metas = [], []
        try:
            for i, msg in zip(plan.targets, plan.messages(self.seq), strict=True):
                args = msg.args if named else msg.task_args()
                if with_meta:
                    payload, meta = submit[i].remote(*args, **msg.kwargs)
                    metas.append(meta)
                else:
                    payload = submit[i].remote(*args, **msg.kwargs)
                refs.append(payload)
        finally:  # how its workers name the call (stuck check, failure report): also the
            if named and refs:  # ranks that got it when a later rank's submit raised
                self.state.tasks.add(self.seq, [ref.task_id().hex() for ref in refs])
        return CallOutput(refs=refs, metas=metas, workers=list(plan.targets), balanced=plan.balanced)

    async def next_chunk(self, gen: int, seq: int, group: int, k: int, n_chunks: int,
                         n_workers: int) -> int | None:
        """dispatch='balance': the chunk data-parallel group ``group`` runs as its k-th in
        call ``seq`` (None: no more). Never waits (see runtime.balance)."""
        if gen != self.state.generation:
            return None
        return self.state.chunks.ask(seq, group, k, n_chunks, n_workers)

    # -- submitting and routing -----------------------------------------------------------------
    def _submitters(self, method: str, with_meta: bool, workers: list, balanced: bool = False,
                    inline: bool = False, named: bool = False) -> list:
        """Each worker's bound task method for ``method`` (``run`` with two returns,
        ``run_value``, or ``run_inline`` for an eager call; their ``run_named`` forms for a
        call without a head), named 'group/Class.method' for Ray's task list and timeline
        ('Class.method' with metrics off; the worker of a named task reads the method there).
        Made once per method and set of workers: nothing per call."""
        key = (method, with_meta, balanced, inline, named)
        hit = self._bound.get(key)
        if hit is not None and hit[0] is workers:
            return hit[1]
        # With metrics off the name does not grow with the gangs made ('g/Cls-2', ...): Ray keeps
        # a ray_tasks metric series per task name.
        name = f"{self.spec.label if self.spec.metrics else self.spec.cls_name}.{method}"
        if balanced:  # dispatch='balance': a chunk loop (runtime.balance), positions record back
            bound = [w.run_balanced.options(num_returns=2, name=name) for w in workers]
        elif inline:  # a large result stays in the worker's store (runtime.inline)
            bound = [(w.run_named_inline if named else w.run_inline).options(name=name)
                     for w in workers]
        elif with_meta:
            bound = [(w.run_named if named else w.run).options(num_returns=2, name=name)
                     for w in workers]
        else:
            bound = [(w.run_named_value if named else w.run_value).options(name=name)
                     for w in workers]
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

    def stats(self) -> dict[str, int]:
        """Sizes of the dispatcher's tables, each bounded however many calls and callers it
        has seen: caller turns, calls waiting for their turn, recent plans kept for chaining,
        producer gangs it routed from, and bound task methods.

        Example::

            ray.get(ray.get_actor("trainer/Model").stats.remote())["turns"]   # <= 256
        """
        router = self._router
        return {
            **self.turns.stats(),
            "recent_plans": len(router.recent) if router is not None else 0,
            "producers": len(router.producers) if router is not None else 0,
            "bound_submitters": len(self._bound),
            "named_tasks": len(self.state.tasks),
        }


RemoteDispatcher = ray.remote(Dispatcher)
