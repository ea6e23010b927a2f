"""GangProxy: what ``MyClass(..., remote_group='g')`` returns in Ray mode.

Over 400 lines, and owed a split: the call path (``_call``, ``_encode``), the gang's life
(restart, save_state, its dispatcher's rebuild, close) and lookup are three jobs in one class.

The proxy holds the gang's dispatcher handle and what is needed to split
arguments (the gang's DeviceMesh and size). A method call splits plain
arguments here with the pure dispatch rules, puts large pieces in the object
store once (tp peers share a piece), and sends the dispatcher refs and small
values only; LazyResult arguments are routed by the dispatcher. The proxy is
picklable: pass it to another gang's worker, or find it by name from a Serve
replica or another job with ``GangProxy.lookup``.

Example::

    model = Model(device_mesh=mesh, remote_group="trainer")   # a GangProxy
    out = model.forward(batch)                                # LazyResult
    model.restart()                                           # after a WorkerDiedError
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from ..core.dispatch import call_targets, slice_length, worker_splits
from ..core.dispatch import dispatch as split_args
from ..core.functions import DEFAULT_FUNCTION, RemoteFunction
from ..core.platform import Platform
from ..core.saved import kept_saves
from . import balance
from .completed import Requeue
from .diagnose import Caller, GangRef, fetch
from .errors import WorkerDiedError
from .lazy import LazyResult
from .progress import wait_with_progress
from .restarts import RebuildLedger, RestartPolicy
from .sequencer import SETTLED
from .together import Start, StartFailed
from .wire import Call, Encoding, mark_cuts

logger = logging.getLogger(__name__)

# How long a proxy whose dispatcher died waits for the answer of one found under its name.
LOOKUP_WAIT_S = 10.0
def _caller() -> tuple[int, int] | None:
    """(rank, world size) when called from inside a gang worker, else None."""
    if "TWINKLE_WORKER" not in os.environ:
        return None
    return Platform.get_rank(), Platform.get_world_size()


class RemoteMethod:
    """A bound remote method of a gang: calling it dispatches to the workers."""

    __slots__ = ("proxy", "name", "spec")

    def __init__(self, proxy: GangProxy, name: str, spec: RemoteFunction):
        self.proxy, self.name, self.spec = proxy, name, spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.proxy._call(self.name, self.spec, args, kwargs)

    def options(self, *, max_staleness: int | None = None) -> RemoteMethod:
        """This method with per-call settings: ``max_staleness`` (a ``dispatch='balance'``
        method only; an int >= 0 or None: see ``remote_function``). ValueError otherwise.

        Example::

            rollouts = sampler.generate.options(max_staleness=1)(prompts)
        """
        try:
            spec = self.spec.replaced(max_staleness=max_staleness)
        except ValueError as e:
            raise ValueError(f"{self.proxy._gang.cls_name}.{self.name}(): {e}") from None
        return RemoteMethod(self.proxy, self.name, spec)

    def __repr__(self) -> str:
        return f"<remote method {self.proxy._gang.cls_name}.{self.name} on '{self.proxy._gang.group}'>"


def _pick(args: tuple, kwargs: dict, todo: list[int]) -> tuple[tuple, dict]:
    """A balanced call's arguments for items ``todo`` only (its list arguments cut to them)."""
    def pick(v: Any) -> Any:
        return [v[i] for i in todo] if isinstance(v, list) else v

    return tuple(pick(v) for v in args), {k: pick(v) for k, v in kwargs.items()}


def call_setting_version(method: RemoteMethod, version: int, *args: Any, **kwargs: Any) -> Any:
    """Call ``method`` (the weight receive) so that, once it succeeds on a rank, the gang's
    weight version there becomes ``version`` (the sender's sync number): what a balanced
    call's ``Completed.versions`` read (:mod:`~twinkle_ray.runtime.beside`)."""
    return method.proxy._call(method.name, method.spec, args, kwargs, version=version)


class GangProxy:
    """Handle to a gang of workers hosting one instance of a user class.

    Attribute access returns :class:`RemoteMethod` objects for the class's
    methods; each call returns a :class:`LazyResult` (or the value, for
    ``sync=True`` / ``lazy_collect=False``). ``restart()`` rebuilds the gang
    with a fresh torch.distributed world after a worker died.
    """

    def __init__(self, cls: type, gang: GangRef, execute: str, lazy_default: bool, desc: dict,
                 starting: Start | None = None):
        self._cls = cls
        self._gang = gang
        self._execute = execute
        self._lazy_default = lazy_default
        self._desc = desc
        # The gang's start-up while it runs (made in a start_together() block; see
        # runtime.together): whatever needs the gang waits for it first. Never pickled.
        self._starting = starting
        self._start_error: BaseException | None = None  # why that start-up failed
        self._start_lock = threading.Lock()
        self._closed: str | None = None
        # A call saw the gang's dispatcher (the one in ``_gang``) die: the next call rebuilds it
        # (the creator's proxy) or looks it up by name (a copy). Never pickled.
        self._lost = False
        # Called once by close(), in the order added (never pickled): see on_close().
        self._close_callbacks: list[Callable[[], None]] = []
        self._methods: dict[str, RemoteMethod] = {}
        # what this proxy's calls tell it when they fail (see diagnose.Caller); never pickled
        self._hooks = Caller(lost=self._dispatcher_died, closed=lambda: self._closed)
        # Calls are numbered per proxy so the dispatcher takes them in the order made here.
        self._caller_id = uuid.uuid4().hex
        self._next_turn = 0
        # The previous call (see _Previous): its settled ref travels with the next call unless
        # this process already had its reply.
        self._prev: _Previous | None = None
        self._turn_lock = threading.Lock()
        # Set by create_gang on the creator's proxy when max_restarts > 0 (respawn_dispatcher):
        # rebuilds the gang after its dispatcher died, within the gang's one restart budget (its
        # history kept here, where it outlives the dispatcher); never pickled: only the creator can.
        self._respawn: Callable[..., tuple] | None = None
        self._budget: RebuildLedger | None = None
        # How this (the creator's) proxy would respawn: armed by a restart policy that allows
        # rebuilds (the class's max_restarts, or set_restart_policy later); never pickled.
        self._respawner: Callable[..., tuple] | None = None
        # the files of the last saves (save_state(path=...)), oldest first; None: the last
        # save was in memory (it dies with the dispatcher)
        self._saved_files: list[list[str]] | None = None

    # -- lookup --------------------------------------------------------------------------------
    @classmethod
    def lookup(cls, label: str, namespace: str | None = None) -> GangProxy:
        """Find a running gang by its dispatcher name (``'group/Class'``)."""
        handle = ray.get_actor(label, namespace=namespace)
        return ray.get(handle.proxy.remote())

    def __getattr__(self, name: str) -> RemoteMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        m = self._methods.get(name)
        if m is None:
            attr = getattr(self._cls, name, None)
            if not callable(attr):
                raise AttributeError(
                    f"{self._cls.__name__} has no method '{name}' (gang on group '{self._gang.group}')"
                )
            spec = attr if isinstance(attr, RemoteFunction) else DEFAULT_FUNCTION
            m = self._methods[name] = RemoteMethod(self, name, spec)
        return m

    # -- what names the gang (read-only) ------------------------------------------------------
    @property
    def label(self) -> str:
        """The gang's name: its dispatcher's actor name, ``'group/Class'`` (or ``'group/Class-2'``)."""
        return self._desc["label"]

    @property
    def group(self) -> str:
        """The name of the DeviceGroup the gang runs on."""
        return self._gang.group

    @property
    def n_workers(self) -> int:
        """How many workers (ranks) the gang has."""
        return self._gang.n_workers

    @property
    def backend(self) -> str | None:
        """The gang's torch.distributed backend at its last (re)build, as its dispatcher said
        (a gang still starting: once it is up)."""
        if self._starting is not None:
            self.wait_started()
        return self._desc.get("backend")

    @property
    def closed(self) -> str | None:
        """Why the gang was closed (``close(reason)``), or None while it is open."""
        return self._closed

    @property
    def start_under_way(self) -> Start | None:
        """The gang's start-up while it still runs (it was made in a ``start_together()``
        block), else None."""
        return self._starting

    def wait_started(self) -> None:
        """Wait until the gang is up (only a gang made in a ``start_together()`` block may not
        be yet). A start-up that failed closes the gang and raises its error, here and at each
        later ``wait_started()`` (other uses say the gang is gone).

        Example::

            with twinkle.start_together():
                sampler = Sampler(remote_group="sampler")
                sampler.wait_started()     # this one now; the block's end waits for the rest
        """
        if self._starting is None and self._start_error is None:
            return
        with self._start_lock:  # another thread that needs the gang waits here too
            start = self._starting
            if start is None:  # up, failed, or closed meanwhile
                if self._start_error is not None:  # (a fresh traceback each time, not a longer one)
                    raise self._start_error.with_traceback(None)
                return
            try:
                desc = start.result()
            except BaseException as e:
                if self._closed:  # closed meanwhile (close(), shutdown()): that is what happened
                    raise self._gone() from None
                if isinstance(e, Exception):  # not a Ctrl-C: that is not the gang's error
                    self._start_error = e
                self.close(f"its start-up failed: {type(e).__name__}")
                raise
            self._desc = desc
            self._starting = None

    # -- calls ---------------------------------------------------------------------------------
    def _gone(self) -> RuntimeError:
        return RuntimeError(f"gang {self._desc['label']} is gone ({self._closed}); create it "
                            f"again after twinkle_ray.initialize()")

    def _check_open(self) -> None:
        if not self._closed and self._starting is not None:
            self.wait_started()
        if self._closed:
            raise self._gone()

    def _call(self, name: str, spec: RemoteFunction, args: tuple, kwargs: dict,
              wait_end: bool = False, version: int | None = None) -> Any:
        self._check_open()
        wait_for_gangs(args, kwargs)  # not while pickling them under the turn lock
        if self._lost:
            self._rebuild_dispatcher()
        if self._budget is not None:  # the creator: count the rebuilds made, tickets re-armed
            self._budget.catch_up()
        execute = "first" if self._execute == "first" else spec.execute
        caller = _caller() if execute == "peer" else None
        eager = spec.sync or not (self._lazy_default if spec.lazy_collect is None else spec.lazy_collect)
        balanced = spec.dispatch == "balance"
        if eager and spec.timeout is None and not wait_end and not balanced:
            returns = "inline"  # the values in the dispatcher's reply (see runtime.reply)
        elif wait_end or balanced or spec.collect in ("flatten", "none"):
            returns = "meta"  # and a record: routed by it (or iteration's end, balance's order)
        else:
            returns = "value"
        g = self._gang
        call = self._encode(g, name, spec, execute, args, kwargs, caller, returns, wait_end)
        with self._turn_lock:  # numbers follow submission order, also across threads
            if self._gang is not g:  # another thread replaced the dead dispatcher meanwhile:
                g = self._gang  # this call goes to the new one, whose own outputs these are not
                call = self._encode(g, name, spec, execute, args, kwargs, caller, returns,
                                    wait_end)
            call = call._replace(turn=(self._caller_id, self._next_turn, self._told_prev()),
                                 beside=spec.beside, version=version)
            reply_ref, settled = g.dispatcher.call.remote(call)
            self._next_turn += 1  # only a submitted call takes a turn
            self._prev = previous = _Previous(settled)
        again = None
        if balanced and not call.routes and not eager:  # as_completed after a death: the
            # undelivered items run again on the rebuilt gang (runtime.completed)
            n = next(len(v) for v in [*args, *kwargs.values()] if isinstance(v, list))
            again = Requeue(n, lambda todo: self._call(name, spec, *_pick(args, kwargs, todo)))
        result = LazyResult(reply_ref, collect=spec.collect, gang=g, method=name,
                            timeout=spec.timeout, turn=call.turn[:2], caller=self._hooks,
                            previous=previous, again=again)
        return result.get() if eager else result

    def _encode(self, g: GangRef, name: str, spec: RemoteFunction, execute: str, args: tuple,
                kwargs: dict, caller: tuple[int, int] | None, returns: str,
                wait_end: bool) -> Call:
        """The call as its dispatcher takes it (:mod:`~twinkle_ray.runtime.wire`): the arguments
        split by ``spec``'s dispatch with the pure rules, each distinct split pickled once (the
        tp/pp peers of a data rank share one), large values put, LazyResults anywhere turned
        into routed slots. The same for any dispatcher of the gang (its size and mesh never
        change). A value that cannot be pickled raises TypeError naming it, before anything
        is sent."""
        n = g.n_workers
        heads: list = [None] * n
        splits: list = [None] * n
        # execute='peer': the caller's arguments are cut over its peer workers only (Twinkle's
        # rule: each of its items runs exactly once); every worker otherwise
        runners = (call_targets(execute, caller, n, g.mesh, g.gpus_per_worker)
                   if execute == "peer" else None)
        if spec.dispatch == "balance":  # chunks handed out while the call runs (runtime.balance)
            per_worker, heads = balance.split(name, spec, g, self._execute, args, kwargs)
        elif execute == "first" or spec.dispatch == "all":
            per_worker = [(args, kwargs)] * n
        elif callable(spec.dispatch) and _routes_any(g, name, args, kwargs):
            # each rank applies the function to the values (it would see LazyResults here)
            enc = Encoding(own_gang=g)
            reslice = (n, g.mesh, g.gpus_per_worker) if runners is None else \
                (len(runners), g.mesh, g.gpus_per_worker, tuple(runners))
            s = enc.encode(args, kwargs, None, reslice=reslice)
            return Call(name, [s], None, enc.routes, execute, caller, None, returns, wait_end)
        else:
            marked = mark_cuts(spec.dispatch, args, kwargs)
            per_worker = split_args(spec.dispatch, n, *marked, device_mesh=g.mesh,
                                    gpus_per_worker=g.gpus_per_worker, method=name, group=g.group,
                                    runners=runners)
            if marked[0] is not args or marked[1] is not kwargs:  # a LazyResult it cuts:
                splits = worker_splits(spec.dispatch, n, device_mesh=g.mesh,
                                       gpus_per_worker=g.gpus_per_worker, method=name, group=g.group,
                                       runners=runners)
                if spec.dispatch == "slice":
                    common = slice_length({f"argument {p}": len(v) for p, v in
                                           [*enumerate(args), *kwargs.items()]
                                           if isinstance(v, list)}, name, g.group)
                    splits = [s._replace(slice_len=common) for s in splits]
        enc = Encoding(own_gang=g)
        slices, of_rank, seen = [], [], {}
        pickled: dict = {}  # the same arguments cut by another split: the same pickles
        for (a, kw), split, head in zip(per_worker, splits, heads, strict=True):
            same = (_identity(a, kw), head)
            key = (same, split)
            if key not in seen:
                s = pickled.get(same)
                if s is not None:  # (a routed value's split travels beside its slot)
                    s = s._replace(split=split)
                else:
                    try:
                        s = pickled[same] = enc.encode(a, kw, split, head)
                    except TypeError as e:  # names the argument
                        raise TypeError(f"{g.cls_name}.{name}() on group '{g.group}': {e}") from None
                seen[key] = len(slices)
                slices.append(s)
            of_rank.append(seen[key])
        return Call(name, slices, None if len(slices) == 1 else of_rank, enc.routes, execute,
                    caller, None, returns, wait_end)

    def _told_prev(self) -> list | str | None:
        """What this proxy's next call tells the dispatcher of its previous one (see
        ``_Previous.told``; None: no previous call). The caller holds ``_turn_lock``."""
        return None if self._prev is None else self._prev.told()

    def __iter__(self):
        if not hasattr(self._cls, "__next__"):
            raise TypeError(f"{self._cls.__name__} is not an iterator (no __next__)")
        if hasattr(self._cls, "__iter__"):
            self._call("__iter__", _ITER_FUNCTION, (), {}).get()
        return self

    def __next__(self) -> LazyResult:
        result = self._call("__next__", _ITER_FUNCTION, (), {}, wait_end=True)
        if result.reply().ended:
            raise StopIteration
        return result

    def __len__(self) -> int:
        return self._call("__len__", _ITER_FUNCTION, (), {}).get()

    # -- lifecycle -----------------------------------------------------------------------------
    def restart(self, timeout: float | None = None) -> None:
        """Tear the gang down and rebuild it with a fresh torch.distributed world."""
        self._check_open()
        if self._lost:
            self._rebuild_dispatcher()
            return
        if self._budget is not None:
            self._budget.catch_up()
        g = self._gang
        desc = wait_with_progress(g.dispatcher.restart.remote(), f"restart of gang {self._desc['label']}",
                                  timeout)
        with self._turn_lock:  # not over a new dispatcher's description (another thread's respawn)
            if self._gang is g:
                self._desc = desc

    def save_state(self, path: str | None = None, timeout: float | None = None) -> None:
        """Save every rank's ``state_dict()``; after a rebuild each rank gets it back.

        The states stay in the object store, owned by the gang's dispatcher (no
        copy passes through this process), or, with ``path``, in one file per
        rank under ``path`` (``rank<r>.pt``; survives the loss of a node's object
        store; the directory must be reachable from every worker). Taken in
        order with this caller's calls; blocks until every rank has saved. After
        an automatic (``max_restarts``) or a manual ``restart()`` rebuild, each
        new rank's ``load_state_dict(state)`` runs before any other call, with a state of its
        own (writable, independent of the saved copy). Files saved inside a
        :class:`~twinkle_ray.checkpoint.CheckpointDir` save are found after it renames its
        temporary folder to ``step-N`` (``twinkle_ray.core.saved.saved_places``). The last
        3 saves to files are remembered: a rebuild restores the newest every rank still
        finds (one aborted or pruned since is passed over, with a warning); with none left it
        fails naming the missing files, and the next ``restart()`` starts from the constructor.

        Example::

            trainer.train_step(batch)
            trainer.save_state()          # at most the steps since this one are lost
        """
        self._check_open()
        if self._lost:  # as for a call: the creator's proxy rebuilds a dead dispatcher first
            self._rebuild_dispatcher()
        with self._turn_lock:
            g = self._gang  # read under the lock: another thread may replace a dead dispatcher
            turn = (self._caller_id, self._next_turn, self._told_prev())
            ref = g.dispatcher.save_state.remote(path, turn)
            self._next_turn += 1
            self._prev = previous = _Previous(ref)
        n = fetch([ref], [0], g, "save_state", timeout, caller=self._hooks)[0]
        previous.replied_now()
        # States saved in memory are owned by the dispatcher and die with it; files do not.
        # A few saves are kept: a rebuild restores the newest still found (one aborted or
        # pruned since leaves the one before it).
        self._saved_files = None if path is None else kept_saves(
            self._saved_files or [], [os.path.join(path, f"rank{r}.pt") for r in range(n)])

    def _rebuild_dispatcher(self) -> None:
        """The gang's dispatcher died: with ``max_restarts`` (and this proxy its creator's), a
        new dispatcher under the same name rebuilds the gang and restores the last state saved
        to files. Any other proxy (a copy pickled into a worker, or one found by name) looks
        the gang up by name once: the creator's proxy may have respawned it. Else the
        dispatcher's death is raised again."""
        g = self._gang
        with self._turn_lock:
            if not self._lost:  # another thread rebuilt it
                return
            if self._respawn is None:
                found = self._find_dispatcher()
                if found is None:
                    raise WorkerDiedError(g.group, g.cls_name, None, None,
                                          f"its dispatcher died and is not rebuilt (no live "
                                          f"dispatcher under its name '{g.label}'; the proxy "
                                          f"that created the gang respawns it, with "
                                          f"max_restarts)", kind="dispatcher")
                self._use_dispatcher(*found)
                logger.warning("gang %s: its dispatcher died; found its new one by name",
                               self._desc["label"])
                return
            budget = self._budget
            if not budget.allow_respawn(time.time()):
                raise WorkerDiedError(g.group, g.cls_name, None, None,
                                      "its dispatcher died and is not rebuilt (its restart "
                                      f"budget is spent: {budget.policy.describe()})",
                                      kind="dispatcher")
            logger.warning("gang %s: its dispatcher died; rebuilding it and the gang (%s)",
                           self._desc["label"], budget.policy.describe())
            if self._saved_files is None:
                logger.warning("gang %s: no state saved to files; the rebuilt gang starts from "
                               "its constructor (in-memory saves die with the dispatcher)",
                               self._desc["label"])
            dispatcher, desc = self._respawn(self._saved_files, budget)
            budget.follow(dispatcher)  # count the new dispatcher's rebuilds
            self._use_dispatcher(dispatcher, desc)

    def _dispatcher_died(self, gang: GangRef) -> None:
        """A call through ``gang`` found its dispatcher dead (``Caller.lost``); one of
        a dispatcher this proxy has replaced already changes nothing. (Never called with the
        turn lock held: it runs in a fetch, and no fetch runs under that lock.)"""
        with self._turn_lock:  # not between another thread's replacement and its _lost = False
            if gang is self._gang:
                self._lost = True

    def _use_dispatcher(self, dispatcher: Any, desc: dict) -> None:
        """Call the gang through ``dispatcher`` (a new one: this proxy starts a fresh turn)."""
        self._gang = dataclasses.replace(self._gang, dispatcher=dispatcher,
                                         dispatcher_node=desc.get("dispatcher_node"))
        self._lost = False
        self._desc = desc
        self._caller_id, self._next_turn, self._prev = uuid.uuid4().hex, 0, None

    def _find_dispatcher(self) -> tuple[Any, dict] | None:
        """(the live dispatcher registered under the gang's name, its describe()), or None: one
        lookup and one short wait for its answer (the lost one's name may not be released yet,
        or no proxy respawned it)."""
        g = self._gang
        if g.label is None:
            return None
        try:
            handle = ray.get_actor(g.label, namespace=g.namespace)
            return handle, ray.get(handle.describe.remote(), timeout=LOOKUP_WAIT_S)
        except Exception:  # no such actor, the lost one itself, or it did not answer in time
            logger.debug("gang %s: no live dispatcher found by name", g.label, exc_info=True)
            return None

    def abort(self, reason: str, ranks: list[int] | None = None) -> None:
        """Tear the gang down: ``ranks`` (None: all) are stuck in a collective with another gang
        that failed (weight sync). Calls then raise GangStuckError, or run on the rebuilt gang.

        Example::

            trainer.abort("weight sync failed on the sampler", ranks=[0])
        """
        if self._starting is not None or self._closed:  # no call has run: no rank is stuck
            return
        try:
            ray.get(self._gang.dispatcher.abort.remote(reason, ranks), timeout=10)
        except Exception:  # the dispatcher is gone: nothing left to tear down
            logger.debug("abort of gang %s failed", self._desc["label"], exc_info=True)

    def check_health(self, timeout: float = 10.0, wait: bool = False) -> None:
        """Raise WorkerDiedError if a worker of the gang died. ``wait``: first wait for an
        automatic rebuild under way (then raise only if the gang stays down); a dead
        dispatcher is rebuilt with its gang, as the next call would (the creator's proxy,
        within the restart policy), and its new gang checked."""
        self._check_open()
        if wait and self._lost:
            self._rebuild_dispatcher()
        if self._budget is not None:
            self._budget.catch_up()
        g = self._gang  # once: another thread may replace a dead dispatcher meanwhile
        try:
            fetch([g.dispatcher.check_health.remote(wait)], [0], g, "check_health", timeout,
                  caller=self._hooks)
        except WorkerDiedError:
            if not (wait and self._lost):  # a worker's death, or no waiting asked for
                raise
            self._rebuild_dispatcher()  # the dispatcher died: raises if it is not rebuilt
            g = self._gang
            fetch([g.dispatcher.check_health.remote(wait)], [0], g, "check_health", timeout,
                  caller=self._hooks)

    def set_restart_policy(self, max_restarts: int, window_s: float | None = None) -> str:
        """Rebuild the gang automatically at most ``max_restarts`` times within ``window_s``
        seconds (None: ever), replacing the class's ``max_restarts``; returns the policy. The
        one policy of the gang: its dispatcher's rebuilds of dead workers, and (on the creator's
        proxy of a class with ``max_restarts``) the respawns of a dead dispatcher.

        Example::

            gang.set_restart_policy(3, window_s=600)   # 'max_restarts=3 within 600s'
        """
        self._check_open()
        policy = RestartPolicy(max_restarts, window_s)  # a bad value raises, changing nothing
        described = ray.get(self._gang.dispatcher.set_restart_policy.remote(max_restarts, window_s))
        if self._budget is not None:
            self._budget.limit(max_restarts, window_s)
        elif max_restarts > 0 and self._respawner is not None:  # the class had none: now the
            self.respawn_dispatcher(self._respawner, RebuildLedger(policy))  # creator respawns
        return described

    def respawn_dispatcher(self, respawn: Callable[..., tuple],
                           budget: RebuildLedger | None) -> None:
        """Make this (the creator's) proxy rebuild the gang when its dispatcher dies:
        ``respawn(saved_files, budget)`` returns (the new dispatcher, its describe()); at most
        as often as the gang's one restart budget (``budget``, which counts the dispatcher's
        automatic rebuilds too) allows. ``budget`` None: not yet (a class without
        ``max_restarts``); a later ``set_restart_policy`` that allows rebuilds arms it."""
        self._respawner = respawn
        if budget is None:
            return
        self._respawn, self._budget = respawn, budget
        budget.follow(self._gang.dispatcher)

    def topology(self) -> dict:
        """The gang's ranks, nodes and devices (as its dispatcher reports them)."""
        return ray.get(self.topology_ref())

    def topology_ref(self) -> ray.ObjectRef:
        """``topology()`` without waiting: a ref to it (read several gangs' in one round trip)."""
        self._check_open()
        return self._gang.dispatcher.describe.remote()

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once when this gang is closed (``close()``, ``shutdown()``), before
        its workers are killed. A gang already closed calls it at once.

        Example::

            channel = open_channel(trainer, sampler)
            sampler.on_close(channel.close)
        """
        if self._closed:
            callback()
            return
        self._close_callbacks.append(callback)

    def close(self, reason: str = "closed") -> None:
        """Kill the workers and the dispatcher, and drop the gang from the runtime. Idempotent."""
        if self._closed:
            return
        self._closed = reason
        self._starting = None  # a start-up under way ends with the dispatcher, killed below
        for callback in self._close_callbacks:  # e.g. off the runtime's gang table, devices back
            try:  # to the group; weight channels that end at this gang closed
                callback()
            except Exception:  # one failing callback must not keep the gang alive
                logger.warning("gang %s: a close callback failed", self._desc["label"],
                               exc_info=True)
        self._close_callbacks.clear()
        d = self._gang.dispatcher
        try:
            ray.get(d.stop.remote(), timeout=10)
        except Exception:  # already dead or stuck: kill it anyway
            logger.debug("dispatcher stop failed", exc_info=True)
        try:
            ray.kill(d, no_restart=True)
        except Exception:
            logger.debug("dispatcher already dead", exc_info=True)

    def __repr__(self) -> str:
        state = f", {self._closed}" if self._closed else ""
        return f"<{self._cls.__name__} gang '{self._desc['label']}' x{self._gang.n_workers}{state}>"

    def __reduce__(self):
        try:
            self.wait_started()  # a copy calls the gang as it is once up
        except Exception as e:
            raise StartFailed(e) from None
        return (GangProxy, (self._cls, self._gang, self._execute, self._lazy_default, self._desc))


def wait_for_gangs(args: tuple, kwargs: dict) -> None:
    """Wait for the start-up of every gang passed (at the top level) as an argument: pickling a
    proxy waits for it, and should not do so while a lock is held. A start-up that failed raises
    its own error here."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, GangProxy):
            v.wait_started()


def _routes_any(g: GangRef, name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a LazyResult sits anywhere in the arguments (what pickling them finds)."""
    enc = Encoding(own_gang=g)
    try:
        enc.encode(args, kwargs, None)
    except TypeError as e:  # names the argument
        raise TypeError(f"{g.cls_name}.{name}() on group '{g.group}': {e}") from None
    return bool(enc.routes)


def _identity(args: tuple, kwargs: dict) -> tuple:
    """What makes two ranks' arguments one slice: the very same objects, in order."""
    return (*map(id, args), *((k, id(v)) for k, v in kwargs.items()))


class _Previous:
    """A proxy's last call, as its next call tells the dispatcher of it (``Sequencer.wait``).

    ``settled`` is the ref of the dispatcher's second return (not the reply, which would pin
    the call's outputs): it settles once the call ended its turn, or failed before it reached
    the dispatcher (its arguments did not unpickle there) and so never took it. Once this
    process has had the call's reply (``replied_now``, called by the call's LazyResult), the
    next call says SETTLED instead: nothing to wait for, and no ref nested in its arguments.
    """

    __slots__ = ("settled", "replied")

    def __init__(self, settled: Any):
        self.settled, self.replied = settled, False

    def replied_now(self) -> None:
        """The call's reply is here: it ended its turn. Its settled ref is dropped (a kept
        LazyResult keeps this record)."""
        self.replied = True
        self.settled = None  # after ``replied``: told() in another thread reads them the other way

    def told(self) -> list | str:
        """What the next call says of this one: SETTLED, or ``[settled ref]`` to wait on."""
        settled = self.settled
        return SETTLED if self.replied or settled is None else [settled]


_ITER_FUNCTION = RemoteFunction(None, dispatch="all", execute="first", collect="none")
