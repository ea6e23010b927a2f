"""The dispatcher actor: one per gang, async, refs only.

One piece over 400 lines: the four steps of taking a call share the actor's state; its other
jobs already live apart (health, rebuild, sequencer, balance, beside).

It creates and owns the gang's workers (so they die with it), starts
torch.distributed among them, and is the gang's sequencer: every caller's
calls reach every rank in one order. A call is taken in four steps: its
caller's **turn** (each caller's calls in the order it made them), the gang's
**health** (a pending stuck check or rebuild first; a dead gang raises), its
routed inputs' **producers** (their replies: refs, never values;
:mod:`~twinkle_ray.runtime.routed`) and the **submit**: one actor task per
target rank (:class:`~twinkle_ray.runtime.wire.Task`), in the gang's order (Ray
keeps one submitter's tasks to an actor in order); it returns the output refs
at once. The caller already split and pickled the arguments: this actor only
ever holds small bytes it never unpickles, and refs.

It composes one plain object per job, each in its own module ("room"):

- :mod:`~twinkle_ray.runtime.sequencer` -- the caller's turn;
- :mod:`~twinkle_ray.runtime.health` -- the watch per worker, the stuck check, the death record;
- :mod:`~twinkle_ray.runtime.rebuild` -- teardown, restart policy, rebuilds
  (:mod:`~twinkle_ray.runtime.build` builds each generation, with the saved state restored);
- :mod:`~twinkle_ray.runtime.ranks` -- what they share: one record per rank, the actor table;
- :mod:`~twinkle_ray.runtime.routed` -- the producers of a call's routed inputs.

This module is the actor: its remote methods (lifecycle, the call and its
submit, the queries) over those rooms.

Example (what GangProxy does)::

    d = Dispatcher.options(name="trainer/Model", num_cpus=0).remote(spec)
    ray.get(d.start.remote())
    reply_ref, settled = d.call.remote(call)     # a wire.Call
    reply = ray.get(reply_ref)
"""
from __future__ import annotations

import asyncio
import os

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from ..core.dispatch import call_targets
from .aio import RankFailed, ThreadedGets, all_or_first_error, values
from .build import Builder
from .diagnose import GangRef
from .errors import GangClosedError, GangStuckError, WorkerDiedError
from .health import DeathRecord, Health
from .lazy import END_OF_ITERATION
from .metrics import GangMetrics
from .ranks import GangState
from .rebuild import Rebuilder
from .reply import Reply, inline_limit
from .restarts import TICKETS_MAX
from .routed import Routes
from .sequencer import TURN_CALLERS_KEPT, Sequencer
from .spec import GangSpec
from .wire import Call, Task

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
        self._routes: Routes | None = None
        self.metrics = GangMetrics.create(spec.label, spec.metrics)
        # (method, with record, beside) -> (the workers list, each one's bound task method)
        self._bound: dict[tuple[str, bool, bool], tuple[list, list]] = {}
        # (node id, ip) of this actor: named in its death and in topology()
        self.node = (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
        self.gets = ThreadedGets()  # an eager call's values (see _values_back)
        # runtime.beside: (generation, number, its ranks) of the last call submitted to the run
        # path when it was balanced (else None), and per rank the last beside call submitted
        # since that rank's last call on the run path (which its next such call follows)
        self._tail: tuple[int, int, frozenset] | None = None
        self._beside: tuple[int, dict[int, int]] = (0, {})

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

    async def report_failure(self, gen: int, seq: int, rank: int, method: str, cause: str,
                             balanced: bool = False) -> None:
        """A worker's call ``seq`` raised (see :meth:`Health.report_failure`: the stuck check)."""
        self.health.report_failure(gen, seq, rank, method, cause, balanced)

    async def verdict(self, seq: int) -> BaseException | None:
        """The end of the stuck check of call ``seq``, which a rank that reported its failure
        waits for before it runs its next call: None when no peer was left inside the call,
        else the gang's error (it was torn down). A peer stuck in that call's collective
        would otherwise pair it with the next call's."""
        check = self.health.suspects.get(seq)
        if check is not None:
            await asyncio.wait([check])
        return self.deaths.error

    def set_restart_policy(self, max_restarts: int, window_s: float | None = None) -> str:
        """Replace the gang's restart limits (a Serve replica sets its own here); the
        rebuilds made so far still count."""
        return self.rebuilds.set_policy(max_restarts, window_s)

    @ray.method(concurrency_group="tickets")
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
            self._tail = None  # a sync after this save queues behind it (runtime.beside)
            outs = [w.save_state.options(num_returns=2).remote(path) for w in workers]
            try:
                await all_or_first_error([ok for _, ok in outs])  # tiny flags; states stay put
            except RankFailed as failed:  # the rank's own error (its note names the rank)
                raise failed.error from None
        # a save to files is kept by its file names (a rebuild asks the ranks which still exist)
        self.builder.keep_save([state for state, _ in outs] if path is None else
                               [os.path.join(path, f"rank{r}.pt") for r in range(len(outs))])
        return len(outs)

    def keep_saved(self, saves: list[list]) -> None:
        """Take the gang's last saves to files (oldest first, per rank) to restore at start (a
        rebuilt dispatcher): the newest that still exists is restored."""
        for save in saves:
            self.builder.keep_save(list(save))

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
            producers = self._routes.producers if self._routes is not None else {}
            for handle, _ in list(producers.values()):
                try:
                    err = await handle.death_of.remote(actor_id, wait_s, False)
                except Exception:  # that producer's dispatcher is gone too
                    continue
                if err is not None:
                    return err
        return None

    async def _lost_producer(self) -> WorkerDiedError | None:
        """The first producer gang whose dispatcher is gone (None: none is). It owned the
        outputs and records this gang's calls took as inputs: a call that failed on a
        lost object while this gang had no death lost one of those (named by the method last
        routed from it here: the outputs lost are that method's)."""
        producers = self._routes.producers if self._routes is not None else {}
        for (group, cls), (handle, method) in list(producers.items()):
            try:
                await handle.death.remote(0)
            except ActorUnavailableError:  # unreachable for now, not known dead
                continue
            except RayActorError:
                return GangRef(group, cls, None).outputs_lost(method)
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

    async def _running_workers(self, call: str = "a call") -> list:
        """The workers once the gang can take ``call``: after a pending stuck check or
        rebuild; raises the gang's error when it is broken, GangClosedError once closed."""
        if self.health.suspects or self.rebuilds.task is not None:  # not the usual case
            await self.health.checked()  # a failure was reported: were peers left stuck?
            await self.rebuilds.settled()  # a rebuild is under way
        if self.deaths.error is not None:
            raise self.deaths.error
        if self.state.stopped:
            raise GangClosedError(self.spec.label, "closed", call)
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
    @ray.method(num_returns=2)
    async def call(self, call: Call) -> tuple[Reply, bool]:
        """Take the call's turn, check the gang, find its routed inputs' producers, submit one
        task per rank; return the :class:`~twinkle_ray.runtime.reply.Reply` (output refs, never
        waited for) and True: a second return that tells the caller's next call that this one
        has settled without holding its outputs (the caller keeps that one between calls, not
        the reply: an idle caller pins no output it dropped).

        ``call`` (:class:`~twinkle_ray.runtime.wire.Call`) holds each distinct set of the
        call's arguments already split and pickled by the caller (bytes and refs only: this
        actor never unpickles a user's value), and its routed arguments (slots). ``turn`` =
        (caller id, number, previous call): each caller's calls are taken strictly in the
        order it made them (:class:`~twinkle_ray.runtime.sequencer.Sequencer`), and every rank
        gets the calls of all callers in the one order they are submitted here. An eager call
        (``returns='inline'``) is answered once every rank has, with their values
        (:func:`~twinkle_ray.runtime.reply.inline`), or with the refs if a rank failed, for
        the caller to raise the call's error from them.
        """
        inline = call.returns == "inline"
        async with self.turns.turn(call.turn):  # 1. order
            what = f"{self.spec.cls_name}.{call.method}()"
            workers = await self._running_workers(what)  # 2. health
            inputs = [(r, *await self.routes.resolve(r)) for r in call.routes]  # 3. producers
            if workers is not self.state.workers:  # rebuilt meanwhile: the new workers
                workers = await self._running_workers(what)
            reply = self._submit(call, workers, inputs)  # 4. submit
            if not inline:  # an eager call's outputs are never routed
                self.routes.remember(call.turn[:2] if call.turn else None, reply)
        if inline:
            return await self._values_back(reply), True
        if call.wait_end:
            ended = any(r == END_OF_ITERATION for r in await values(reply.records))
            reply = reply._replace(ended=ended)
        return reply.packed(), True

    async def _values_back(self, reply: Reply) -> Reply:
        """An eager call's reply: each rank's Inline/Held result in place of its ref once every
        rank has answered, or the refs themselves if a rank failed: the caller raises the
        call's error from them, as for a lazy call (which rank, a death or the user's
        exception)."""
        try:
            got = await self.gets.all(reply.refs)
        except Exception:
            return reply
        return reply._replace(refs=[], values=got)

    def _submit(self, call: Call, workers: list, inputs: list) -> Reply:
        """Send a call to its ranks: one actor task per target rank, in the gang's one order
        (the next number); returns at once with the output refs. A call marked ``beside``
        (the weight receive) right after a balanced call (with only other beside calls
        between) goes beside it (``GangWorker.run_beside``, :mod:`~twinkle_ray.runtime.beside`);
        every other call queues on the run path, after the beside calls before it."""
        self.seq += 1
        if self.metrics is not None:
            self.metrics.called(call.method)
        n = len(workers)
        targets = call_targets(call.execute, call.caller, n, self.spec.mesh,
                               self.spec.group.gpus_per_worker)
        balanced = any(s.balance is not None for s in call.slices)
        gen = self.state.generation
        tail = self._tail if self._tail is not None and self._tail[0] == gen else None
        after = tail[1] if call.beside and tail is not None and set(targets) <= tail[2] else None
        if self._beside[0] != gen:
            self._beside = (gen, {})
        beside_of = self._beside[1]
        with_record = call.returns == "meta"
        submit = self._submitters(call.method, with_record, workers, after is not None)
        refs, records = [], []
        limit = inline_limit(len(targets))  # an eager call's inline bytes: bounded per call
        # routed inputs: what every rank shares, made once; their records go as top-level
        # arguments (resolved by Ray before the method starts: see runtime.routed)
        slots, tops = self.routes.shared(inputs) if inputs else ((), ())
        for i in targets:
            s = call.slices[call.of_rank[i]] if call.of_rank is not None else call.slices[0]
            routes = Routes.for_rank(slots, s.split) if slots else ()
            follows = None if after is not None else beside_of.pop(i, None)
            task = Task(call.method, self.seq, call.returns, s.args, s.kwargs, s.nested, routes,
                        s.split, s.balance, s.reslice, limit, after, follows, call.version)
            if after is not None:
                beside_of[i] = self.seq
            if with_record:
                out, record = submit[i].remote(task, s.tops, *tops)
                records.append(record)
            else:
                out = submit[i].remote(task, s.tops, *tops)
            refs.append(out)
        if after is None:
            self._tail = (gen, self.seq, frozenset(targets)) if balanced else None
        return Reply(refs=refs, records=records, workers=targets, balanced=balanced,
                     stream=(self.seq, self.state.generation) if balanced else None)

    async def next_chunk(self, gen: int, seq: int, group: int, k: int, n_chunks: int,
                         n_workers: int, peers: int = 0) -> int | None:
        """dispatch='balance': the chunk data-parallel group ``group`` runs as its k-th in
        call ``seq`` (None: no more). Never waits (see runtime.balance). ``peers``: the
        workers per group (answers are kept only until each has read them)."""
        if gen != self.state.generation:
            return None
        return self.state.chunks.ask(seq, group, k, n_chunks, n_workers, peers)

    async def next_chunks(self, gen: int, seq: int, group: int, ks: list[int], n_chunks: int,
                          n_workers: int, peers: int = 0) -> list[int | None]:
        """:meth:`next_chunk` for each of ``ks`` (a group's free slots, ``in_flight``);
        ``peers``: the workers per group (answers are kept only until each has read them)."""
        if gen != self.state.generation:
            return [None] * len(ks)
        return self.state.chunks.ask_many(seq, group, ks, n_chunks, n_workers, peers)

    def stream_workers(self, gen: int) -> list | None:
        """The workers of generation ``gen`` (None: the gang was rebuilt or is down since):
        whom ``LazyResult.as_completed`` asks for a balanced call's finished chunks."""
        if gen != self.state.generation or not self.state.workers:
            return None
        return list(self.state.workers)

    # -- submitting ----------------------------------------------------------------------------
    def _submitters(self, method: str, with_record: bool, workers: list, beside: bool = False
                    ) -> list:
        """Each worker's bound ``run`` (``beside``: ``run_beside``) for ``method`` (two returns
        when the outputs keep a record), named 'group/Class.method' in Ray's task list and
        timeline ('Class.method' with metrics off: Ray keeps a ``ray_tasks`` metric series per
        task name, so the name does not grow with the gangs made). Made once per method and
        set of workers."""
        key = (method, with_record, beside)
        hit = self._bound.get(key)
        if hit is not None and hit[0] is workers:
            return hit[1]
        name = f"{self.spec.label if self.spec.metrics else self.spec.cls_name}.{method}"
        bound = [(w.run_beside if beside else w.run).options(num_returns=2 if with_record else 1,
                                                             name=name) for w in workers]
        self._bound[key] = (workers, bound)
        return bound

    def _own_gang(self) -> GangRef:
        """This gang's GangRef (for proxies; its callers send its own LazyResults without one)."""
        if self._gang_ref is None:
            self._gang_ref = self.spec.gang_ref(ray.get_runtime_context().current_actor, self.node)
        return self._gang_ref

    @property
    def routes(self) -> Routes:
        """The routing room (made on first use: it needs this actor's own handle)."""
        if self._routes is None:
            self._routes = Routes(self._own_gang())
        return self._routes

    def stats(self) -> dict[str, int]:
        """Sizes of the dispatcher's tables, each bounded however many calls and callers it
        has seen: caller turns, calls waiting for their turn, recent replies kept for chaining,
        producer gangs it routed from, and bound task methods.

        Example::

            ray.get(ray.get_actor("trainer/Model").stats.remote())["turns"]   # <= 256
        """
        routes = self._routes
        return {
            **self.turns.stats(),
            "recent_replies": len(routes.recent) if routes is not None else 0,
            "producers": len(routes.producers) if routes is not None else 0,
            "bound_submitters": len(self._bound),
            "balanced_calls": len(self.state.chunks),  # balanced calls handing out chunks now
            "balanced_answers": self.state.chunks.answers,  # their answers kept for peers
        }


# The creator's restart tickets (rebuilt(k), each waiting until its rebuild starts) have a
# group of their own: however many wait, calls keep every slot of the default group.
RemoteDispatcher = ray.remote(concurrency_groups={"tickets": TICKETS_MAX})(Dispatcher)
