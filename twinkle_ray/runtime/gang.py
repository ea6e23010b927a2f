"""create_gang: start a gang of workers and its dispatcher for one instance of a user class.

Called by ``@remote_class`` construction in Ray mode (through the session);
returns the :class:`~twinkle_ray.runtime.proxy.GangProxy` that calls go through.

Example::

    proxy = create_gang(Model, execute="all", distributed=None, max_restarts=0,
                        group_name="trainer", args=(), kwargs={"device_mesh": mesh},
                        runtime=session, mesh_type=DeviceMesh)
"""

from __future__ import annotations

import dataclasses
import functools
import time

import ray
from ray.exceptions import ActorAlreadyExistsError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..core import defaults
from .dispatcher import RemoteDispatcher
from .progress import wait_with_progress
from .proxy import GangProxy, wait_for_gangs
from .restarts import RebuildLedger, RestartPolicy
from .spec import GangSpec
from .together import Start, join_or_wait
from .wire import unpicklable

# How long a respawn waits for a dead dispatcher's name to be released by Ray.
RESPAWN_NAME_WAIT_S = 60.0


def create_gang(
    cls: type,
    *,
    execute: str,
    distributed: bool | None,
    max_restarts: int,
    stuck_grace_s: float | None = defaults.STUCK_GRACE_S,
    group_name: str,
    args: tuple,
    kwargs: dict,
    runtime,
    mesh_type: type,
) -> GangProxy:
    """Start a gang for ``cls`` on group ``group_name`` and return its proxy."""
    group = runtime.group(group_name)
    mesh = next((v for v in (*args, *kwargs.values()) if isinstance(v, mesh_type)), None)
    slots = runtime.slots[group.name]
    if execute == "first":
        slots = slots[:1]
    elif mesh is not None and mesh.world_size != (group.num_devices or group.num_workers):
        raise ValueError(
            f"{cls.__name__} on group '{group.name}': its DeviceMesh has world size "
            f"{mesh.world_size} but the group has {group.num_devices or group.num_workers} "
            f"{'device' if group.num_devices else 'worker'}(s)"
        )
    wait_for_gangs(args, kwargs)  # a gang of a start_together() block: its own start error
    why = unpicklable(args, kwargs)  # before anything is claimed or created (docs/design.md#failures)
    if why is not None:
        raise TypeError(f"{cls.__name__}(remote_group='{group.name}'): {why}")
    label = runtime.new_label(group.name, cls.__name__)
    owns = runtime.claim(group.name, [s.bundle_index for s in slots])
    taken = [s.bundle_index for s, o in zip(slots, owns, strict=True) if o]
    try:  # every failure from here on gives the claimed devices back to the group
        spec = GangSpec(
            group=group,
            cls=cls,
            label=label,
            args=args,
            kwargs=kwargs,
            slots=slots,
            owns=owns,
            pg=runtime.pgs[group.name],
            owns_pg=(group.name not in runtime.adopted
                     and sum(p is runtime.pgs[group.name] for p in runtime.pgs.values()) == 1),
            mesh=mesh,
            distributed=distributed,
            dist_timeout_s=runtime.dist_timeout_s,
            placement_timeout_s=runtime.placement_timeout_s,
            start_timeout_s=runtime.start_timeout_s,
            seed=runtime.seed,
            namespace=runtime.namespace,
            max_restarts=max_restarts,
            stuck_grace_s=stuck_grace_s,
            execute=execute,
            lazy_collect=runtime.lazy_collect,
        )
        proxy = _start(spec, runtime.start_timeout_s)
        # this proxy (the creator's) rebuilds a dead dispatcher and its gang, once a restart
        # policy allows rebuilds (the class's max_restarts, or a later set_restart_policy)
        proxy.respawn_dispatcher(functools.partial(respawn, spec, runtime.start_timeout_s),
                                 RebuildLedger(RestartPolicy(max_restarts, spec.restart_window_s))
                                 if max_restarts > 0 else None)
        runtime.register(proxy, group.name, taken)
    except BaseException:
        runtime.release(group.name, taken)
        raise
    join_or_wait(proxy)  # now, or at the end of a start_together() block (a failure closes it)
    return proxy


def _start(spec: GangSpec, timeout_s: float | None) -> GangProxy:
    """Create the gang's dispatcher and ask it to start the gang; the proxy returned waits
    for that start-up before anything needs the gang (see runtime.together). A start-up that
    fails kills the dispatcher, and with it whatever it built."""
    label = spec.label
    dispatcher = new_dispatcher(spec)

    def finish(wait):
        try:
            return wait()
        except BaseException as e:
            ray.kill(dispatcher, no_restart=True)
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            if isinstance(e, ray.exceptions.RayActorError):  # (a class that will not unpickle
                # fails in the workers' start, named there: only they unpickle it)
                raise RuntimeError(f"gang {label}: its dispatcher could not be created. Ray "
                                   f"said: {str(e).splitlines()[0]}") from None
            raise

    try:
        start = Start(dispatcher.start.remote(), f"start-up of gang {label} ({len(spec.slots)} "
                      f"worker(s))", timeout_s, finish)
        # The dispatcher runs on this node (new_dispatcher): its node is known before it answers.
        here = (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
        return spec.proxy(dispatcher, {"label": label, "dispatcher_node": here}, starting=start)
    except BaseException:  # (a KeyboardInterrupt, say) nothing of the gang is left
        ray.kill(dispatcher, no_restart=True)
        raise


def new_dispatcher(spec: GangSpec):
    """A dispatcher actor for ``spec``, named by its label, on this process's node.

    The affinity is hard: the dispatcher shares its creator's node, so losing that node
    loses both together (for a driver, a run continued with checkpoints and ``--resume``),
    and a lost node never takes the dispatcher unless its creator runs there. With a soft
    affinity Ray put it on another node now and then even though it asks for no resources
    (seen on a 3-node ``Cluster``), and that node's loss then cost the gang its dispatcher.
    """
    here = ray.get_runtime_context().get_node_id()
    return RemoteDispatcher.options(
        name=spec.label,
        namespace=spec.namespace,
        num_cpus=0,
        max_concurrency=1000,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote(spec)


def respawn(spec: GangSpec, timeout_s: float | None, saved: list[list] | None,
            budget: RebuildLedger) -> tuple:
    """Rebuild a gang whose dispatcher died: a new dispatcher under the same name, a fresh
    gang, and each rank's ``saved`` state restored (``saved``: the files of the last
    ``save_state(path=...)`` calls, oldest first; the newest still found is restored). The
    new dispatcher rebuilds dead workers within the gang's one restart budget: ``budget``'s
    limits and its history (this respawn included).
    Returns (the new dispatcher, its describe()).

    The dead dispatcher's name is free only once Ray has recorded its death (after a node
    loss, when its health checks give the node up): until then, creating the new one is
    retried for up to RESPAWN_NAME_WAIT_S.
    """
    policy = budget.policy
    spec = dataclasses.replace(spec, max_restarts=policy.max_restarts,
                               restart_window_s=policy.window_s,
                               restart_times=budget.history(), restarts=budget.count)
    deadline = time.monotonic() + RESPAWN_NAME_WAIT_S
    while True:
        try:
            dispatcher = new_dispatcher(spec)
            break
        except ActorAlreadyExistsError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
    try:
        if saved is not None:
            ray.get(dispatcher.keep_saved.remote(saved), timeout=60)
        desc = wait_with_progress(dispatcher.start.remote(),
                                  f"rebuild of gang {spec.label} after its dispatcher died", timeout_s)
    except BaseException:
        ray.kill(dispatcher, no_restart=True)
        raise
    return dispatcher, desc
