"""The worker actor: hosts one instance of the user's class in a gang.

One piece over 400 lines: its methods are the worker's remote interface (start, run,
run_beside, stream, control, save and load), which Ray needs on one class; their bodies live in
balance, beside, inflight and routed.

The user's class needs no ``@ray.remote``; the worker builds it after setting
the gang's environment (devices, RANK, MASTER_ADDR, ...) and, when asked,
initialising torch.distributed. Every call reaches a rank through one entry
point, ``run(task, tops)`` (:class:`~twinkle_ray.runtime.wire.Task`); its routed
arguments are built from the producers' object stores before the method runs.

Example (what the dispatcher does)::

    w = make_worker(info, pg, slot.bundle_index, resource_name="GPU", amount=1, cpus=1,
                    namespace=ns)
    _, port = ray.get(workers[0].endpoint.remote())       # rank 0's node IP and a free port
    ray.get(w.start.remote(port, True, dist_timeout_s, seed, (ray.put(cls), ray.put((args, kwargs)))))
    out, record = w.run.options(num_returns=2).remote(task)     # a wire.Task
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..core.dispatch import dispatch_one
from ..core.routing import record_of
from . import balance
from .beside import Flow, Running, Versions
from .diagnose import raised_note
from .dist_setup import loopback_store, nccl_env, seed_everything, url_host, usable_backend
from .errors import portable
from .inflight import StreamBook, WorkerLoop
from .lazy import END_OF_ITERATION, LazyResult
from .metrics import GangMetrics, args_nbytes
from .net import is_loopback
from .placement import resource_options
from .reply import inline
from .routed import Slots
from .wire import Task, decode

logger = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 5.0


@dataclass
class WorkerInfo:
    """Everything a worker needs to know about its place in the gang."""

    group: str
    cls_name: str
    name: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    devices: tuple[int, ...]
    visible_devices_env: str | None
    kind: str
    backend: str = "gloo"  # the group's torch.distributed backend (DeviceGroup.backend)
    env: dict[str, str] = field(default_factory=dict)
    dispatcher: Any = field(default=None, repr=False)  # to report a failed call (stuck check)
    generation: int = 0
    metrics: str | None = None  # the gang's label when it records metrics (see .metrics)
    gpus_per_worker: int = 1  # devices of this worker: its mesh rank is rank * gpus_per_worker
    # the gang joins torch.distributed: the worker imports torch as soon as it exists (see
    # GangWorker.__init__)
    distributed: bool = False
    stuck_grace_s: float | None = None  # the gang's (a failure report waits for its verdict)

    def environ(self) -> dict[str, str]:
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "TWINKLE_GROUP": self.group,
            "TWINKLE_WORKER": self.name,
            # Platform.get_mesh_rank: the mesh rank is rank * this, as the dispatcher routes it
            "TWINKLE_GPUS_PER_WORKER": str(self.gpus_per_worker),
        }
        if self.visible_devices_env:
            env[self.visible_devices_env] = ",".join(str(d) for d in self.devices)
        env.update(self.env)
        return env


class GangWorker:
    """One member of a gang. Created by the dispatcher, never by users."""

    def __init__(self, info: WorkerInfo):
        os.environ.update(info.environ())
        self.info = info
        self.instance: Any = None
        # which calls run and ended here, on the run thread and beside it (runtime.beside)
        self.flow = Flow()
        self.verdict_of: int | None = None  # a failed call whose stuck check the next call awaits
        # the gang's weight version here (syncs applied), and the balanced call running now
        self.versions = Versions()
        self.running: Running | None = None
        self.phase: str | None = "created"  # what start() is doing (None: started)
        self.metrics = GangMetrics.create(info.metrics, True) if info.metrics else None
        # balanced calls: their finished chunks for streams, and the loop of async methods
        self.streams = StreamBook()
        self.loop = WorkerLoop()
        # torch takes seconds of CPU to import, and a distributed gang's start needs it: the
        # import runs while the gang's other workers are still being created and rank 0 is
        # asked for the rendezvous port, rather than after (start() waits for it first, so no
        # other import ever runs beside it; a failed import is raised by start's own import).
        self._torch_import: threading.Thread | None = None
        if info.distributed:
            self._torch_import = threading.Thread(target=_import_quietly, args=("torch.distributed",),
                                                  name="twinkle-import-torch", daemon=True)
            self._torch_import.start()

    def endpoint(self) -> tuple[str, int]:
        """This node's IP and a free TCP port on it (for MASTER_PORT)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(
        self,
        master_port: int,
        distributed: bool,
        dist_timeout_s: float,
        seed: int | None,
        payload: tuple[Any, Any],
    ) -> tuple[str | None, int]:
        """Join torch.distributed (all ranks call this concurrently), then build the instance
        from ``payload``: (the ref of the class, the ref of (its args, its kwargs)), fetched here
        (nested in a tuple, Ray does not resolve them before the call).

        Returns (the torch.distributed backend used or None, this process's pid).
        """
        if self._torch_import is not None:
            self.phase = "importing torch"
            self._torch_import.join()
        self.phase = "fetching the class and its arguments"
        cls, (args, kwargs) = self._unpickle(payload)
        os.environ["MASTER_PORT"] = str(master_port)
        backend = None
        if distributed:
            self.phase = "torch.distributed init"
            backend = self._init_distributed(dist_timeout_s)
        self.phase = "the constructor"
        if seed is not None:
            seed_everything(seed)
        # Constructor arguments travel nested in the payload: a whole argument that is an
        # ObjectRef or a LazyResult is given as its value, as a call's would be.
        args = tuple(_value_of(a) for a in args)
        kwargs = {k: _value_of(v) for k, v in kwargs.items()}
        try:
            self.instance = cls(*args, **kwargs)
        except Exception as e:  # reaches the caller as itself (its type kept), as a method's does
            raise portable(e) from None
        self.phase = None
        return backend, os.getpid()

    def _unpickle(self, refs: tuple[Any, Any]) -> tuple[type, tuple[tuple, dict]]:
        """(cls, (args, kwargs)) from the spec's payload refs; a failure names the class and the fix."""
        try:
            return tuple(ray.get(list(refs)))
        except ray.exceptions.RaySystemError as e:  # Ray's wrapper of an unpickling error
            why = e.client_exc if isinstance(e.client_exc, BaseException) else None
            raise TypeError(
                f"{self.info.cls_name} or its constructor arguments cannot be unpickled in this Ray worker "
                f"({f'{type(why).__name__}: {why}' if why else str(e).splitlines()[0]}): a module "
                f"workers cannot import? ship it with runtime_env working_dir/py_modules"
            ) from None

    def _init_distributed(self, timeout_s: float) -> str:
        import torch
        import torch.distributed as dist

        if self.info.backend == "nccl":
            for k, v in nccl_env(timeout_s).items():  # before any NCCL communicator exists
                os.environ.setdefault(k, v)
        backend = usable_backend(self.info.backend)
        if backend == "nccl":
            torch.cuda.set_device(0)
        rendezvous: dict[str, Any] = {
            "init_method": f"tcp://{url_host(self.info.master_addr)}:{os.environ['MASTER_PORT']}"}
        if is_loopback(self.info.master_addr):  # one node: keep the store and gloo on loopback
            port = int(os.environ["MASTER_PORT"])
            rendezvous = {"store": loopback_store(self.info.rank, self.info.world_size, port,
                                                  timeout_s)}
        dist.init_process_group(
            backend=backend,
            rank=self.info.rank,
            world_size=self.info.world_size,
            timeout=timedelta(seconds=timeout_s),
            **rendezvous,
        )
        return backend

    def run(self, task: Task, tops: list, *records: Any) -> Any:
        """One rank's task of a call (:mod:`~twinkle_ray.runtime.wire`): its arguments
        decoded (routed ones built from the producers' outputs and ``records``, the values of
        their records, :mod:`~twinkle_ray.runtime.routed`), the method run (a balanced call: its chunk loop,
        :mod:`~twinkle_ray.runtime.balance`), the result returned as ``task.returns`` says:
        the result (``'value'``), the result and its record (``'meta'``), or the result for an
        eager reply (``'inline'``). A failure is reported to the dispatcher before it is
        raised, so it can tell whether peers are left stuck in a collective. A call that
        follows a beside call (``task.follows``) first waits until that one ended here."""
        running = None
        try:
            if task.follows is not None:
                self.flow.wait_beside(task.follows)
            if self.verdict_of is not None:
                self._await_verdict()
            if task.balance is not None:  # known before the call counts as started: a sync
                # that waits for it to start finds what to run beside
                running = self.running = Running(task.seq, balance.runs_async(self.instance,
                                                                              task.method))
            self.flow.started(task.seq)
            return self._execute(task, tops, records, None)
        finally:
            if running is not None:
                self.running = None
                running.close()  # a sync still waiting for the next chunk runs now
            self.flow.ended_call(task.seq)

    @ray.method(concurrency_group="beside")
    def run_beside(self, task: Task, tops: list, *records: Any) -> Any:
        """A call marked ``beside`` (the weight receive) submitted while balanced call
        ``task.after`` runs on the gang: it waits until that call has started here (or
        ended), then runs beside it (:mod:`~twinkle_ray.runtime.beside`: the engine paused,
        the call, its version set, the engine resumed). Not reported to the stuck check: it
        runs no collective of the gang's own."""
        try:
            self.flow.wait_started(task.after)
            running = self.running
            if running is None or running.seq != task.after:  # it ended already: alone
                running = None
            return self._execute(task, tops, records, running)
        finally:
            self.flow.ended_beside(task.seq)

    def _execute(self, task: Task, tops: list, records: tuple, beside: Running | None) -> Any:
        """``run``'s body; ``beside``: the balanced call a beside call runs beside (None:
        alone, on the calling thread). A call with ``task.version`` sets the gang's weight
        version once it succeeded (beside a call: before the engine resumes)."""
        on_run = task.after is None
        m, t0, nbytes, failed = self.metrics, None, 0, True
        record = None
        try:
            args, kwargs = self._arguments(task, tops, records)
            if m is not None:
                nbytes, t0 = args_nbytes(args, kwargs), time.perf_counter()
            if task.balance is not None:
                result, record = balance.run_chunks(self, task, args, kwargs)
            else:
                def call() -> Any:
                    out = self._method(task.method, args, kwargs)
                    if task.version is not None:
                        self.versions.set(task.version)
                    return out

                result = call() if beside is None else beside.beside(call, self.instance, self.loop)
            failed = False
        except StopIteration:
            if task.method != "__next__":
                if on_run:
                    self._report(task, StopIteration())
                raise
            failed = False
            result, record = None, END_OF_ITERATION
        except BaseException as e:
            if on_run:
                self._report(task, e)
            info = self.info  # named here: a caller may meet it as another call's input
            e.add_note(raised_note(f"{info.cls_name}.{task.method}() on rank {info.rank} of "
                                   f"group '{info.group}'", traceback.format_exc()))
            raise portable(e) from None
        finally:
            if m is not None:
                m.ran(task.method, None if t0 is None else time.perf_counter() - t0, nbytes, failed)
        if result is self.instance:  # e.g. __iter__ returning self: it stays here
            result = None
        if task.returns == "meta":
            return result, record_of(result) if record is None else record
        if task.returns == "inline":
            return inline(result, task.inline_bytes)
        return result

    def _method(self, name: str, args: tuple, kwargs: dict) -> Any:
        """The instance's method ``name`` called; an ``async def`` one runs on the worker's
        event loop (the one balanced calls' coroutines share) and its value is returned."""
        out = getattr(self.instance, name)(*args, **kwargs)
        if inspect.iscoroutine(out):
            out = self.loop.run(out)
        return out

    def _arguments(self, task: Task, tops: tuple, records: tuple = ()) -> tuple[tuple, dict]:
        """The task's (args, kwargs): the put values fetched, unpickled, routed values built
        (see ``run``). Everything a rank reads is fetched here, inside its call, never by Ray
        before the method starts: a rank whose input cannot be had fails like any call, seen
        by the dispatcher (its stuck check), while its peers may be in a collective. (Only
        the routed inputs' records come resolved, every rank all of them: one that failed
        fails every rank alike, unrun; see runtime.routed.)"""
        info = self.info
        where = f"{info.cls_name}.{task.method}() on rank {info.rank} of group '{info.group}'"
        tops = ray.get(tops) if tops else tops
        slots = (Slots(task.routes, task.split, task.method, info.group, records)
                 if task.routes else None)
        args, kwargs = decode(task, tops, slots and slots.value, where)
        if task.reslice is not None:  # a dispatch function, applied here to the values
            n, mesh, gpus_per_worker, *runners = task.reslice  # runners: execute='peer'
            fn = getattr(type(self.instance), task.method).dispatch
            i = runners[0].index(info.rank) if runners else info.rank
            args, kwargs = dispatch_one(fn, n, i, args, kwargs, mesh, task.method, info.group)
        return args, kwargs

    def _report(self, task: Task, error: BaseException) -> None:
        """Tell the dispatcher that this rank's call failed (its stuck check; a balanced call's
        chunks stop), and wait for the receipt: the caller must not see the error before the
        dispatcher does. The rank's next call first waits for the check's verdict
        (:meth:`_await_verdict`)."""
        d = self.info.dispatcher
        if d is None:
            return
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        try:
            ray.get(d.report_failure.remote(self.info.generation, task.seq, self.info.rank,
                                            task.method, cause, task.balance is not None),
                    timeout=REPORT_TIMEOUT_S)
            if info_grace(self.info) is not None and (task.balance is None
                                                      or task.balance.peers > 1):
                self.verdict_of = task.seq
        except Exception:  # the dispatcher is gone or busy: raising the error matters more
            logger.debug("could not report a failure to the dispatcher", exc_info=True)

    def _await_verdict(self) -> None:
        """After a failed call, before the next: wait until the dispatcher's stuck check says
        no peer was left inside the failed call (else raise the gang's error, unrun). A peer
        blocked in that call's collective would pair it with this call's: a wrong value, not
        an error. At once when no peer is left (the check ends early); the grace at most."""
        seq, self.verdict_of = self.verdict_of, None
        try:
            error = ray.get(self.info.dispatcher.verdict.remote(seq),
                            timeout=REPORT_TIMEOUT_S + (info_grace(self.info) or 0.0))
        except Exception:  # the dispatcher is gone or busy: its own error path names it
            logger.debug("no verdict on call %s", seq, exc_info=True)
            return
        if error is not None:
            raise error

    @ray.method(concurrency_group="control")
    def progress(self) -> tuple[int | str | None, int]:
        """(the number of the call running now, or None when idle; that of the last ended)."""
        return self.flow.current, self.flow.ended

    @ray.method(concurrency_group="stream", num_returns="streaming")
    def stream(self, seq: int):
        """Balanced call ``seq``'s finished chunks on this worker, as they finish: batches of
        ``(start, stop, value, versions)`` (:class:`~twinkle_ray.runtime.inflight.StreamBook`);
        what ``LazyResult.as_completed`` reads. Ends with the call here."""
        ctx = ray.get_runtime_context()  # a reader that went away cancels it: it ends here too
        yield from self.streams.read(seq, lambda: self.flow.ended, ctx.is_canceled)

    @ray.method(concurrency_group="control")
    def start_phase(self) -> str | None:
        """What ``start`` is doing now ('torch.distributed init', 'the constructor'), or None
        once the instance is built: what a start past its deadline names."""
        return self.phase

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def identity(self) -> tuple[str, str, str]:
        """(this actor's id, its node's id, its node's IP): the dispatcher's table of its workers."""
        ctx = ray.get_runtime_context()
        return ctx.get_actor_id(), ctx.get_node_id(), ray.util.get_node_ip_address()

    def save_state(self, path: str | None = None) -> tuple[Any, bool]:
        """(the instance's ``state_dict()``, or the file it was saved to under ``path``; True)."""
        fn = getattr(self.instance, "state_dict", None)
        if not callable(fn):
            raise TypeError(f"{self.info.cls_name} has no state_dict(): it cannot be saved "
                            f"(define state_dict() and load_state_dict(state))")
        state = fn()
        if path is None:
            return state, True
        import torch

        os.makedirs(path, exist_ok=True)
        file = os.path.join(path, f"rank{self.info.rank}.pt")
        torch.save(state, file + ".tmp")
        os.replace(file + ".tmp", file)  # a half-written file never replaces a good one
        return file, True

    def saved_found(self, files: list[str]) -> list[bool]:
        """Whether each of ``files`` (this rank's, of its gang's last saves) is still found."""
        from ..core.saved import saved_exists

        return [saved_exists(f) for f in files]

    def load_state(self, state: Any) -> None:
        """Give the instance a saved state (or the file ``save_state`` wrote it to)."""
        fn = getattr(self.instance, "load_state_dict", None)
        if not callable(fn):
            raise TypeError(f"{self.info.cls_name} has no load_state_dict(state): its saved state "
                            f"cannot be restored")
        if isinstance(state, str):  # a file: where it is now (a CheckpointDir renames its save)
            import torch

            from ..core.saved import find_saved

            state = torch.load(find_saved(state), weights_only=False)
        else:  # from the object store: its arrays are read-only views of the saved copy
            from ..core.saved import own_state

            state = own_state(state)  # the rank's own: writable, independent of the save
        fn(state)

    @ray.method(concurrency_group="control")
    def watch(self) -> None:
        """Never returns; its ref fails when this actor dies (the dispatcher's health signal)."""
        threading.Event().wait()

    def stop(self) -> None:
        """Leave torch.distributed cleanly before the actor is killed (and hand Ray the metrics
        noted since the last flush)."""
        if self.metrics is not None:
            self.metrics.flush()
        try:
            import sys

            dist = sys.modules.get("torch.distributed")
            if dist is not None and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # best effort at teardown
            logger.debug("destroy_process_group failed", exc_info=True)


def _value_of(arg: Any) -> Any:
    if isinstance(arg, ray.ObjectRef):
        return ray.get(arg)
    return arg.get() if isinstance(arg, LazyResult) else arg


# control: watch() (always), progress() and pid() beside a running call; stream: readers of
# balanced calls' completions (each waits while its call runs); beside: calls that run beside a
# running balanced call (the weight receive; one at a time, in the order submitted).
STREAM_READERS = 4
_RemoteGangWorker = ray.remote(concurrency_groups={"control": 3, "stream": STREAM_READERS,
                                                   "beside": 1})(GangWorker)


def _import_quietly(module: str) -> None:
    """Import ``module`` ahead of its use; a failure is left for that use to raise."""
    try:
        importlib.import_module(module)
    except Exception:
        logger.debug("ahead-of-time import of %s failed", module, exc_info=True)


def make_worker(
    info: WorkerInfo,
    pg,
    bundle_index: int,
    *,
    resource_name: str | None,
    amount: float,
    cpus: float,
    namespace: str | None,
):
    """Create the worker actor for ``info`` on ``bundle_index`` of ``pg``.

    The first gang on a group takes the bundle's devices (``amount`` > 0) and
    Ray pins them; later gangs on the same devices ask for 0 and get the same
    devices through ``info.devices``.
    """
    return _RemoteGangWorker.options(
        name=info.name,
        namespace=namespace,
        max_restarts=0,
        max_concurrency=1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle_index
        ),
        **resource_options(resource_name if amount else None, amount, cpus),
    ).remote(info)


def info_grace(info: WorkerInfo) -> float | None:
    """The stuck grace a failure report may wait for (none for a gang without collectives)."""
    return info.stuck_grace_s if info.distributed else None
