"""initialize / shutdown: the one runtime of a driver process.

``initialize`` connects to Ray (or starts an embedded one), validates every
DeviceGroup, reserves its placement group and learns its device map before
returning. ``shutdown`` kills every gang and removes every placement group it
made, and stops Ray only if it started it. The runtime is held in one module
variable, as Ray holds its own worker: there is one per driver process.

One piece, a little over 400 lines: the :class:`Runtime` record and every function here
(``initialize`` creating or extending it, ``shutdown`` tearing it down, ``gang_for``,
``get_device_placement`` and ``current`` reading it) share that one module variable; split,
they would pass it between modules (``get``, which reads none of it, is the short exception,
kept beside the calls a script makes with it).

Example::

    import twinkle_ray as twinkle
    twinkle.initialize("ray", groups=[twinkle.DeviceGroup("trainer", 4, "cpu")])
    print(twinkle.get_device_placement())
    twinkle.shutdown()
"""

from __future__ import annotations

import inspect
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core import defaults
from ..core.group import DeviceGroup, check_groups
from .connect import connect

logger = logging.getLogger(__name__)

# Keywords of Twinkle's initialize() that have no meaning here, and why (docs/twinkle.md).
_TWINKLE_ONLY = {
    "nproc_per_node": "Ray knows every node's devices; for explicit device ids that span nodes "
                      "set DeviceGroup(gpus_per_node=...)",
    "ncpu_proc_per_node": "Ray knows every node's CPUs; CPU groups declare their worker count",
    "full_determinism": "each worker is seeded with seed=; deterministic kernels are the "
                        "user class's choice (torch.use_deterministic_algorithms)",
    "global_device_mesh": "pass the DeviceMesh to the class that uses it",
    "name": "gangs are named 'group/Class' in the Ray namespace (namespace=)",
    "notifier": "errors are raised to the caller with group, rank and method named",
}


@dataclass
class Runtime:
    """State of an initialised twinkle_ray driver."""

    mode: str
    groups: dict[str, DeviceGroup]
    address: str | None = None  # as asked (None: RAY_ADDRESS, or an embedded Ray)
    namespace: str | None = None
    seed: int | None = defaults.SEED
    lazy_collect: bool = defaults.LAZY_COLLECT
    placement_timeout_s: float = defaults.PLACEMENT_TIMEOUT_S
    start_timeout_s: float | None = defaults.START_TIMEOUT_S
    dist_timeout_s: float = defaults.DIST_TIMEOUT_S
    started_ray: bool = False
    pgs: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, list] = field(default_factory=dict)
    claimed: dict[str, set] = field(default_factory=dict)
    gangs: list = field(default_factory=list)
    owned: dict = field(default_factory=dict)  # gang label -> (group, bundles it took devices of)
    labels: Counter = field(default_factory=Counter)
    adopted: set = field(default_factory=set)  # groups on a placement group someone else owns
    # objects with a close() that live as long as this runtime (weight channels): closed by
    # shutdown() before the gangs
    resources: list = field(default_factory=list)

    def own(self, resource: Any) -> None:
        """Close ``resource`` (anything with a ``close()``) at ``shutdown()``, before the gangs.

        Example::

            twinkle_ray.runtime.session.current().own(channel)
        """
        if all(r is not resource for r in self.resources):
            self.resources.append(resource)

    def disown(self, resource: Any) -> None:
        """Stop tracking ``resource`` (its owner closed it)."""
        self.resources[:] = [r for r in self.resources if r is not resource]

    def group(self, name: str) -> DeviceGroup:
        if name not in self.groups:
            known = ", ".join(f"'{n}'" for n in self.groups) or "none"
            raise ValueError(f"unknown remote_group '{name}'; declared groups: {known}")
        return self.groups[name]

    def new_label(self, group: str, cls_name: str) -> str:
        key = f"{group}/{cls_name}"
        self.labels[key] += 1
        n = self.labels[key]
        return key if n == 1 else f"{key}-{n}"

    def _device_key(self, group: str) -> str:
        g = self.groups[group]
        return g.colocate_with or group

    def claim(self, group: str, bundles: list[int]) -> list[bool]:
        """Which of ``bundles`` this gang takes devices from (the first gang on them does)."""
        taken = self.claimed.setdefault(self._device_key(group), set())
        owns = [b not in taken for b in bundles]
        taken.update(bundles)
        return owns

    def release(self, group: str, bundles: list[int]) -> None:
        self.claimed.get(self._device_key(group), set()).difference_update(bundles)

    def register(self, proxy, group: str | None = None, bundles: list[int] | None = None) -> None:
        """Add a gang to the table; ``bundles``: those it took the devices of (see claim)."""
        self.gangs.append(proxy)
        label = proxy.label
        if group is not None:
            self.owned[label] = (group, list(bundles or []))
        proxy.on_close(lambda: self.forget(label))

    def forget(self, label: str) -> None:
        """Drop the gang ``label`` from the table and give its devices back to the group."""
        self.gangs[:] = [p for p in self.gangs if p.label != label]
        group, bundles = self.owned.pop(label, (None, []))
        if group is not None:
            self.release(group, bundles)

    def forget_adopted(self, group: str) -> None:
        """Drop an adopted group (``adopt_placement_group``) from the tables once its gangs
        are closed (each close ``forget``s its gang); the placement group stays its owner's
        (e.g. a Serve replica's)."""
        if group not in self.adopted:
            return
        for table in (self.groups, self.pgs, self.slots, self.claimed):
            table.pop(group, None)
        self.adopted.discard(group)


_runtime: Runtime | None = None


def current() -> Runtime | None:
    """The initialised runtime, or None."""
    return _runtime


def initialize(
    mode: str = "ray",
    groups: list[DeviceGroup] | None = None,
    *,
    address: str | None = None,
    namespace: str | None = None,
    seed: int | None = defaults.SEED,
    lazy_collect: bool = defaults.LAZY_COLLECT,
    placement_timeout_s: float = defaults.PLACEMENT_TIMEOUT_S,
    start_timeout_s: float | None = defaults.START_TIMEOUT_S,
    dist_timeout_s: float = defaults.DIST_TIMEOUT_S,
    **ray_init_kwargs: Any,
) -> None:
    """Start twinkle_ray: connect Ray and reserve every DeviceGroup.

    mode='ray': use Ray if already initialised here; else attach when
    ``address`` or RAY_ADDRESS is set (resource arguments are then ignored:
    the cluster declares its resources); else start an embedded local Ray
    with ``ray_init_kwargs`` (e.g. ``num_gpus=8`` for virtual GPUs): always a
    new private instance (``ray.init(address='local')``; a stale
    ``/tmp/ray/ray_current_cluster`` of a stopped cluster is not followed),
    every one of its servers and our gangs' rendezvous listening on 127.0.0.1
    only (see ``_start_embedded`` for the one Ray setting this needs). Every group's placement group is ready before this
    returns, or PlacementError is raised and nothing stays reserved.

    ``namespace`` is where gang actors are named; it defaults to the Ray
    job's namespace (when Ray is already initialised, an explicit namespace
    still names our actors, e.g. one per Serve replica).

    ``start_timeout_s`` bounds a gang's start-up (workers up, torch.distributed
    joined, instance built; None: no bound) and ``dist_timeout_s`` is each gang's
    torch.distributed timeout; both must be positive.

    mode='local': no Ray; remote classes are built in-process.

    Calling it again adds new groups; re-declaring a group differently, switching mode, or
    asking for other settings (``seed``, ``lazy_collect``, the timeouts, ``namespace``,
    ``address``, Ray's own keywords) raises RuntimeError: they are the running runtime's.

    >>> initialize("local", groups=[DeviceGroup("cpu", 2, "cpu")])
    >>> shutdown()
    """
    global _runtime
    mode = str(mode).lower()
    if mode not in ("ray", "local"):
        raise ValueError(f"initialize: unknown mode {mode!r}; use 'ray' or 'local'")
    for name, value in (("placement_timeout_s", placement_timeout_s),
                        ("start_timeout_s", start_timeout_s), ("dist_timeout_s", dist_timeout_s)):
        if value is None and name == "start_timeout_s":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"initialize: {name} must be a positive number of seconds, got {value!r}")
    twinkle_only = [k for k in ray_init_kwargs if k in _TWINKLE_ONLY]
    if twinkle_only:
        k = twinkle_only[0]
        raise TypeError(f"initialize: {k!r} is a Twinkle keyword with no meaning here: {_TWINKLE_ONLY[k]}")
    new = list(groups or [])
    check_groups(new)
    settings = dict(address=address, namespace=namespace, seed=seed, lazy_collect=lazy_collect,
                    placement_timeout_s=placement_timeout_s, start_timeout_s=start_timeout_s,
                    dist_timeout_s=dist_timeout_s)
    if _runtime is not None:
        _check_unchanged(_runtime, settings, ray_init_kwargs)
        _extend(_runtime, mode, new)
        return
    rt = Runtime(mode=mode, groups={}, **settings)
    if mode == "ray":
        rt.started_ray = connect(address, namespace, ray_init_kwargs)
        try:
            import ray

            rt.namespace = namespace or ray.get_runtime_context().namespace
            _reserve(rt, new)
        except BaseException:
            _teardown(rt)
            raise
    else:
        rt.groups.update({g.name: g for g in new})
    _runtime = rt


def _check_unchanged(rt: Runtime, settings: dict, ray_init_kwargs: dict) -> None:
    """RuntimeError naming each setting a second ``initialize()`` asks to change (one given
    other than its default and other than the runtime's): it would be silently ignored."""
    signature = inspect.signature(initialize).parameters
    changed = [f"{k}={v!r} (the runtime has {getattr(rt, k)!r})" for k, v in settings.items()
               if v != signature[k].default and v != getattr(rt, k)]
    if ray_init_kwargs:
        changed.append(f"Ray's {', '.join(sorted(ray_init_kwargs))} (Ray is running)")
    if changed:
        raise RuntimeError(f"initialize: already initialised; a second call can add groups but "
                           f"not change {'; '.join(changed)}. Call shutdown() first")


def _extend(rt: Runtime, mode: str, new: list[DeviceGroup]) -> None:
    if mode != rt.mode:
        raise RuntimeError(f"initialize: already initialised in {rt.mode!r} mode; call shutdown() first")
    fresh = []
    for g in new:
        old = rt.groups.get(g.name)
        if old is None:
            fresh.append(g)
        elif old != g:
            raise RuntimeError(
                f"initialize: group '{g.name}' is already declared as {old!r}; "
                f"it cannot be re-declared as {g!r} (call shutdown() first)"
            )
    check_groups([*rt.groups.values(), *fresh])
    if rt.mode == "ray":
        _reserve(rt, fresh)
    else:
        rt.groups.update({g.name: g for g in fresh})


def _reserve(rt: Runtime, groups: list[DeviceGroup]) -> None:
    from .pinned import held_devices, reserve_pinned
    from .placement import check_feasible, probe_slots, remove, reserve

    if not groups:
        return
    for g in groups:
        if g.colocate_with:
            host = rt.groups.get(g.colocate_with) or next(
                (h for h in groups if h.name == g.colocate_with), None)
            if host is None or (host.num_workers, host.gpus_per_worker) != (g.num_workers, g.gpus_per_worker):
                raise ValueError(
                    f"group '{g.name}' colocates with '{g.colocate_with}' but their workers differ; "
                    f"colocated groups need the same number of workers and gpus_per_worker"
                )
    own = [g for g in groups if not g.colocate_with]
    prefix = f"twinkle/{rt.namespace}"
    # Groups that name their devices first (Ray would hand their ids to the others), all on
    # one placement group holding exactly those devices (see pinned.py).
    named = [g for g in own if g.pins_devices]
    check_feasible(groups)
    pool, slots = None, {}
    if named:
        pool, slots = reserve_pinned(named, held=held_devices(rt.slots, rt.groups),
                                     timeout_s=rt.placement_timeout_s, name_prefix=prefix)
    try:
        pgs = reserve([g for g in own if g not in named], timeout_s=rt.placement_timeout_s,
                      name_prefix=prefix)
    except BaseException:
        if pool is not None:
            remove(pool)
        raise
    pgs.update({g.name: pool for g in named})
    for g in groups:
        rt.groups[g.name] = g
    for g in groups:
        key = g.name if g.name in pgs else g.colocate_with
        rt.pgs[g.name] = pgs[key] if key in pgs else rt.pgs[key]
    rt.slots.update(slots)
    for g in groups:
        if g.colocate_with or g.name in slots:
            continue
        rt.slots[g.name] = probe_slots(g, rt.pgs[g.name])
    for g in groups:
        if g.colocate_with:
            rt.slots[g.name] = rt.slots[g.colocate_with]


def gang_for(cls, execute, options, remote_group, args, kwargs):
    """The GangProxy for ``cls(..., remote_group=...)``, or None to build in-process."""
    rt = _runtime
    if "TWINKLE_WORKER" in os.environ and rt is None:
        return None  # inside a worker: Twinkle builds the class in-process
    if rt is None:
        raise RuntimeError(
            f"{cls.__name__}(remote_group='{remote_group}'): twinkle_ray.initialize() has not been "
            f"called (or shutdown() was); call initialize('ray', groups=[...]) first"
        )
    if rt.mode == "local":
        return None
    from ..core.mesh import DeviceMesh
    from .gang import create_gang

    return create_gang(
        cls, execute=execute, **options, group_name=remote_group, args=args, kwargs=kwargs, runtime=rt, mesh_type=DeviceMesh,
    )


def shutdown() -> None:
    """Kill every gang, remove every placement group, stop Ray if we started it.

    Safe to call twice; ``initialize`` may be called again afterwards.
    """
    global _runtime
    rt, _runtime = _runtime, None
    if rt is not None:
        _teardown(rt)


def _teardown(rt: Runtime) -> None:
    for resource in list(rt.resources):  # before the gangs they join
        try:
            resource.close()
        except Exception:
            logger.warning("twinkle_ray.shutdown(): closing %r failed", resource, exc_info=True)
    rt.resources.clear()
    if rt.mode != "ray":
        return
    import ray

    from .placement import remove

    for proxy in list(rt.gangs):  # close() takes each off the table
        proxy.close("twinkle_ray.shutdown() was called")
    rt.gangs.clear()
    if ray.is_initialized():
        kept = {id(rt.pgs[name]) for name in rt.adopted if name in rt.pgs}
        for key, pg in {id(pg): pg for pg in rt.pgs.values()}.items():
            if key not in kept:  # an adopted placement group belongs to its creator
                remove(pg)
    rt.pgs.clear()
    if rt.started_ray and ray.is_initialized():
        ray.shutdown()


def get(value: Any, timeout: float | None = None) -> Any:
    """Materialise a LazyResult or another pending value (a weight sync's handle), or a
    list/tuple of them; identity on plain values. ``timeout`` bounds the whole wait, however
    many values there are.

    >>> get(3)
    3
    """
    import time

    from .lazy import Pending

    if isinstance(value, Pending):
        return value.get(timeout)
    if isinstance(value, list | tuple) and any(isinstance(v, Pending) for v in value):
        deadline = None if timeout is None else time.monotonic() + timeout

        def one(v: Any) -> Any:
            if not isinstance(v, Pending):
                return v
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return v.get(left)

        items = [one(v) for v in value]
        return type(value)(*items) if hasattr(type(value), "_fields") else type(value)(items)
    return value


def get_device_placement(groups: Sequence[str | DeviceGroup] | None = None) -> str:
    """A text picture of the groups: which node and devices each rank has, and the gangs on it.

    ``groups``: the groups to show, by name or as the declared ``DeviceGroup``
    objects (Twinkle passes its group list); default all.

    >>> initialize("local", groups=[DeviceGroup("data", 1, "cpu")])
    >>> print(get_device_placement())
    twinkle_ray topology (local mode: everything runs in-process)
    group 'data': 1 worker(s), cpu, bundle {CPU: 1}
    >>> shutdown()
    """
    rt = _runtime
    if rt is None:
        return "twinkle_ray is not initialised"
    names = [g.name if isinstance(g, DeviceGroup) else g for g in groups] if groups else list(rt.groups)
    lines = [f"twinkle_ray topology ({'local mode: everything runs in-process' if rt.mode == 'local' else 'ray mode'})"]
    for name in names:
        g = rt.group(name)
        b = g.bundles()[0]
        bundle = "{" + ", ".join(f"{k}: {v:g}" for k, v in b.items()) + "}"
        extra = f", colocated with '{g.colocate_with}'" if g.colocate_with else ""
        if g.pins_devices:
            extra += ", devices as named (reserved per node)"
        lines.append(f"group '{name}': {g.num_workers} worker(s), {g.kind}, bundle {bundle}{extra}")
        for rank, s in enumerate(rt.slots.get(name, [])):
            dev = f"{g.resource_name} {list(s.devices)}" if g.resource_name else "cpu"
            lines.append(f"  rank {rank:<3} node {s.node_ip} ({s.node_id[:8]})  {dev:<12} bundle {s.bundle_index}")
        gangs = [p for p in rt.gangs if p.group == name and not p.closed]
        for p in gangs:
            state = "starting" if p.start_under_way is not None else f"backend {p.backend}"
            lines.append(f"  gang {p.label}: {p.n_workers} worker(s), {state}")
    return "\n".join(lines)
