"""DeviceGroup -> Ray placement group: feasibility, reservation, device map.

One placement group per DeviceGroup, one bundle per worker, whole devices.
After the group is ready, one probe task per bundle reports which devices Ray
reserved for that bundle; from that the gang rank order is fixed once, sorted
by (node, first device id) as Ray Train does, and shared by every gang that
lives on the group.

Example::

    pg = reserve([group], timeout_s=60)[group.name]
    slots = probe_slots(group, pg)      # rank-ordered BundleSlot list
    slots[0].node_ip, slots[0].devices  # ('10.0.0.3', [0])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..core.group import DeviceGroup
from .errors import PlacementError
from .progress import Progress

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class BundleSlot:
    """Where one worker of a group runs: its bundle, node and devices.

    ``assigned``: the runtime chose ``devices`` inside a node reservation (a group
    that names its device ids); the worker then asks Ray for no devices of its own
    and is pinned through the visible-devices variable. Otherwise Ray picked the
    bundle's devices and ``devices`` is what it reported.
    """

    bundle_index: int
    node_id: str
    node_ip: str
    devices: tuple[int, ...]
    assigned: bool = False


def _fmt(res: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())) + "}"


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def check_feasible(groups: list[DeviceGroup]) -> None:
    """Raise PlacementError at once if the cluster can never hold ``groups``.

    Checks the sum of all groups against the cluster's total resources, every
    bundle against the largest node, and STRICT_PACK groups against one node.
    A cluster that is only busy passes: that case is the timeout's job.
    """
    nodes = _alive_nodes()
    total: dict[str, float] = {}
    for n in nodes:
        for k, v in n["Resources"].items():
            total[k] = total.get(k, 0.0) + v
    wanted: dict[str, float] = {}
    for g in groups:
        if g.colocate_with:
            continue
        for b in g.bundles():
            for k, v in b.items():
                wanted[k] = wanted.get(k, 0.0) + v
    short = {k: v for k, v in wanted.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        names = ", ".join(f"'{g.name}'" for g in groups)
        raise PlacementError(
            f"the cluster can never hold group(s) {names}: requested {_fmt(wanted)}, "
            f"cluster total {_fmt({k: total.get(k, 0.0) for k in wanted})} "
            f"over {len(nodes)} node(s)" + _cpu_hint(groups, set(short), total.get("CPU", 0.0))
        )
    for g in groups:
        if g.colocate_with:
            continue
        bundles = g.bundles()
        need = bundles[0]
        fits_one = [n for n in nodes if all(n["Resources"].get(k, 0) >= v for k, v in need.items())]
        if not fits_one:
            largest = _largest_node(nodes, need)
            short_here = {k for k, v in need.items() if v > largest.get(k, 0.0) + 1e-9}
            raise PlacementError(
                f"group '{g.name}': one worker needs {_fmt(need)} but no node has that much; "
                f"largest node has {_fmt(largest)}"
                + _cpu_hint([g], short_here, largest.get("CPU", 0.0), per_worker=True)
            )
        if g.strategy == "STRICT_PACK":
            whole = {k: v * len(bundles) for k, v in need.items()}
            if not any(all(n["Resources"].get(k, 0) >= v for k, v in whole.items()) for n in nodes):
                raise PlacementError(
                    f"group '{g.name}' (STRICT_PACK): needs {_fmt(whole)} on one node; "
                    f"largest node has {_fmt(_largest_node(nodes, whole))}"
                )
        if g.strategy == "STRICT_SPREAD" and len(fits_one) < len(bundles):
            raise PlacementError(
                f"group '{g.name}' (STRICT_SPREAD): needs {len(bundles)} nodes with {_fmt(need)}, "
                f"the cluster has {len(fits_one)}"
            )


def _nice_below(x: float) -> float:
    """The largest of a few round CPU amounts that is <= ``x`` (0 when none is)."""
    return next((v for v in (8, 4, 2, 1, 0.5, 0.25, 0.1) if v <= x + 1e-9), 0.0)


def _cpu_hint(groups: list[DeviceGroup], short: set[str], cpus: float, *,
              per_worker: bool = False) -> str:
    """Name the knob when only CPUs are short and accelerator groups ask for them.

    ``cpus`` is what there is (the cluster's total, or the largest node's when
    ``per_worker``). A GPU worker rarely needs a whole CPU of its own, so
    ``cpus_per_worker`` on the accelerator groups is the usual fix; the suggested
    value is what fits after the CPU-only groups take their share.
    """
    if short != {"CPU"}:
        return ""
    accel = [g for g in groups if not g.colocate_with and g.resource_name and g.cpus_per_worker > 0]
    if not accel:
        return ""
    if per_worker:
        fits = cpus
    else:
        cpu_only = sum(g.cpus_per_worker * g.num_workers for g in groups
                       if not g.colocate_with and not g.resource_name)
        fits = (cpus - cpu_only) / sum(g.num_workers for g in accel)
    names = ", ".join(f"'{g.name}' (cpus_per_worker={g.cpus_per_worker:g})" for g in accel)
    return (
        f". Only CPUs are short: lower cpus_per_worker on {names}, "
        f"e.g. DeviceGroup(..., cpus_per_worker={_nice_below(fits):g})"
    )


def _largest_node(nodes: list[dict], like: dict) -> dict:
    key = next(iter(k for k in like if k != "CPU"), "CPU")
    best = max(nodes, key=lambda n: n["Resources"].get(key, 0), default={"Resources": {}})
    return {k: best["Resources"].get(k, 0.0) for k in like}


def reserve(
    groups: list[DeviceGroup], *, timeout_s: float, name_prefix: str = "twinkle"
) -> dict[str, PlacementGroup]:
    """Create one placement group per group and wait until all are ready.

    Progress is logged (WARNING, so it shows by default) when the wait passes
    ``progress_after_s()`` (15 s unless ``TWINKLE_PROGRESS_AFTER_S`` says
    otherwise). On timeout every placement group made here is removed and
    PlacementError names the groups still pending.
    """
    check_feasible(groups)
    pgs: dict[str, PlacementGroup] = {}
    for g in groups:
        if g.colocate_with:
            continue
        pgs[g.name] = placement_group(
            g.bundles(), strategy=g.strategy, name=f"{name_prefix}/{g.name}"
        )
    try:
        _wait_ready(pgs, groups, timeout_s)
    except BaseException:
        for pg in pgs.values():
            remove_placement_group(pg)
        raise
    for g in groups:
        if g.colocate_with:
            pgs[g.name] = pgs[g.colocate_with]
    return pgs


def _wait_ready(pgs: dict[str, PlacementGroup], groups: list[DeviceGroup], timeout_s: float):
    progress = Progress(log=logger)
    pending = {pg.ready(): name for name, pg in pgs.items()}
    by_name = {g.name: g for g in groups}
    while pending:
        left = timeout_s - progress.elapsed()
        if left <= 0:
            waiting = ", ".join(
                f"'{n}' ({len(by_name[n].bundles())} x {_fmt(by_name[n].bundles()[0])})"
                for n in pending.values()
            )
            raise PlacementError(
                f"placement of group(s) {waiting} not ready after {timeout_s:g}s: the cluster "
                f"is busy (available now: {_fmt(ray.available_resources())}); "
                f"nothing stays reserved"
            )
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(left, 1.0))
        for ref in ready:
            pending.pop(ref)
        if pending:
            names = ", ".join(f"'{n}'" for n in pending.values())
            progress.note(lambda s, names=names: f"waiting for placement of {names}: {s:.0f}s of "
                                                 f"{timeout_s:.0f}s")


def resource_options(resource_name: str | None, amount: float, cpus: float) -> dict:
    """Ray ``.options()`` asking for ``amount`` of an accelerator and ``cpus`` CPUs."""
    opts: dict = {"num_cpus": cpus}
    if resource_name == "GPU":
        opts["num_gpus"] = amount
    elif resource_name:
        opts["resources"] = {resource_name: amount}
    return opts


@ray.remote(num_cpus=0)
def _probe_bundle() -> tuple[str, dict]:
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), ctx.get_accelerator_ids()


def bundle_probe(pg: PlacementGroup, index: int, resource: str | None, amount: float):
    """A task on bundle ``index`` of ``pg`` holding ``amount`` of ``resource``; its result is
    (node id, the accelerator ids Ray gave it)."""
    return _probe_bundle.options(
        **resource_options(resource, amount, 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
    ).remote()


def device_ids(probed: tuple[str, dict], resource: str) -> list[int]:
    """The sorted device ids of ``resource`` in a :func:`bundle_probe` result."""
    return sorted(int(d) for d in probed[1].get(resource, []))


def probe_slots(
    group: DeviceGroup, pg: PlacementGroup, bundle_indices: Sequence[int] | None = None
) -> list[BundleSlot]:
    """Return one BundleSlot per worker, in gang-rank order.

    Rank order is (node, first device id); nodes are numbered in order of
    their first bundle. CPU groups have no devices and keep bundle order
    within a node. ``bundle_indices`` names the bundles of ``pg`` the workers
    use (default ``0..n-1``; a Serve replica's gang uses ``1..n``).
    """
    n = group.num_workers
    index = list(range(n)) if bundle_indices is None else [int(b) for b in bundle_indices]
    if len(index) != n:
        raise ValueError(
            f"group '{group.name}' has {n} worker(s) but {len(index)} bundle indices were given"
        )
    table = placement_group_table(pg)
    bundle_nodes = {i: table["bundles_to_node_id"][b] for i, b in enumerate(index)}
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    devices: list[tuple[int, ...]] = [()] * n
    if group.resource_name:
        refs = [bundle_probe(pg, index[i], group.resource_name, group.gpus_per_worker)
                for i in range(n)]
        for i, probed in enumerate(ray.get(refs)):
            devices[i] = tuple(device_ids(probed, group.resource_name))
    slots = [
        BundleSlot(index[i], bundle_nodes[i], ips.get(bundle_nodes[i], "?"), devices[i])
        for i in range(n)
    ]
    return rank_order(slots)


def rank_order(slots: list[BundleSlot]) -> list[BundleSlot]:
    """Ray-placed slots in gang-rank order: (node, first device id); nodes numbered in order
    of their first bundle, CPU slots keep bundle order within a node."""
    node_order: dict[str, int] = {}
    for s in sorted(slots, key=lambda s: s.bundle_index):
        node_order.setdefault(s.node_id, len(node_order))
    return sorted(slots, key=lambda s: (node_order[s.node_id], s.devices[:1] or (s.bundle_index,)))


def check_named_nodes(group: DeviceGroup, slots: list[BundleSlot]) -> None:
    """Raise PlacementError at once when a node holding devices ``group`` named is gone: a
    node reservation is tied to its node, so waiting for it to be placed again is futile."""
    alive = {n["NodeID"] for n in _alive_nodes()}
    gone = sorted({s.node_ip for s in slots if s.assigned and s.node_id not in alive})
    if gone:
        raise PlacementError(
            f"group '{group.name}' names devices on node(s) {', '.join(gone)}, which are gone; "
            f"named devices do not move to another node: declare the group again "
            f"(shutdown() and initialize()) to place it on the nodes there are now"
        )


async def refresh_slots(
    group: DeviceGroup, pg: PlacementGroup, slots: list[BundleSlot], *, timeout_s: float
) -> list[BundleSlot]:
    """Where ``slots`` are now: awaited by every (re)build of a gang, so that a rebuild after
    a node loss starts on the node its bundles were moved to, with their new devices.

    Waits up to ``timeout_s`` for ``pg`` to be placed (Ray re-places the bundles of a
    lost node when capacity exists), then reads each bundle's node and address afresh. A
    bundle Ray placed itself that moved is probed for its new devices, and the ranks are
    ordered again by (node, first device). Devices the group named stay with their node's
    reservation, which is tied to that node.

    Raises PlacementError naming the group when the placement group is not placed in time,
    or the node of its named devices is gone.
    """
    import asyncio

    check_named_nodes(group, slots)
    try:
        await asyncio.wait_for(pg.ready(), timeout_s)
    except asyncio.TimeoutError:
        need = group.bundles()[0]
        raise PlacementError(
            f"group '{group.name}': its placement group is not placed again after {timeout_s:g}s "
            f"({len(slots)} x {_fmt(need)} wanted; available now: "
            f"{_fmt(ray.available_resources())})"
        ) from None
    table = placement_group_table(pg)
    where = table["bundles_to_node_id"]
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    res = group.resource_name
    # A bundle Ray placed that moved gets new devices; a node reservation never moves.
    moved = sorted({s.bundle_index for s in slots
                    if where[s.bundle_index] != s.node_id and not s.assigned})
    probed: dict[int, tuple[int, ...]] = {}
    if moved and res:
        got = await asyncio.wait_for(asyncio.gather(
            *[bundle_probe(pg, b, res, group.gpus_per_worker) for b in moved]), timeout_s)
        probed = {b: tuple(device_ids(p, res)) for b, p in zip(moved, got, strict=True)}
    fresh = [
        BundleSlot(s.bundle_index, where[s.bundle_index], ips.get(where[s.bundle_index], "?"),
                   probed.get(s.bundle_index, s.devices), s.assigned)
        for s in slots
    ]
    if any(s.assigned for s in fresh):
        return fresh  # the group's own order: worker i owns its i-th devices
    return rank_order(fresh)


def remove(pg: PlacementGroup) -> None:
    """Remove a placement group, ignoring one that is already gone."""
    try:
        remove_placement_group(pg)
    except Exception:  # already removed, or Ray is shutting down
        logger.debug("placement group already removed", exc_info=True)
