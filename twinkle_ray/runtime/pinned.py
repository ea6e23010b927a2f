"""Groups that name their device ids: a node reservation holding exactly those devices.

A ``DeviceGroup`` with a ``ranks`` list (or ``visible_devices``) says which
devices it occupies: device ``r`` is device ``r % gpus_per_node`` on node
``r // gpus_per_node``. Ray gives a placement-group bundle whichever free
devices of a node it likes (the lowest free ids, in practice) and has no
public way to ask for device 5. So, for every node the declared ids are on:

1. single-device placement groups pinned to that node (its ``ray.io/node-id``
   label) are reserved until every declared id is held by one of them; each
   reports the device Ray gave it. An id never reached is held by someone
   else: ``PlacementError`` naming it;
2. the ones holding declared ids are removed, the others stay for now, so the
   node's free devices at or below the highest declared id are exactly the
   declared ones;
3. one bundle per node (that many devices, plus its workers' CPUs), all in one
   placement group shared by every such group of the ``initialize`` call, is
   reserved and checked to hold exactly the declared ids;
4. the other single-device groups are removed: those devices are Ray's again.

Workers run in their node's bundle asking Ray for no devices of their own, and
are pinned to their ids through the visible-devices variable, set before
anything initialises the accelerator. Ray's accounting agrees with that: the
declared devices belong to the runtime's placement group, so no other task is
handed them.

Nodes are numbered among the alive nodes that have the accelerator: the
driver's node first, then by (IP address, node id).

Example::

    pg, slots = reserve_pinned([DeviceGroup("t", [2, 3])], held={}, timeout_s=60)
    slots["t"][1].devices   # (3,)
"""

from __future__ import annotations

import logging
import time
import uuid

import ray
from ray.util.placement_group import PlacementGroup, placement_group

from ..core.group import DeviceGroup
from .errors import PlacementError
from .placement import BundleSlot, bundle_probe, device_ids, remove

logger = logging.getLogger(__name__)

NODE_LABEL = "ray.io/node-id"  # the label Ray gives every node: its node id
SETTLE_S = 2.0  # how long "no free device" is looked at again before it is believed
POOL_ATTEMPTS = 5  # a removed placement group frees its devices a moment later: retry the pool


def accelerator_nodes(resource: str) -> list[dict]:
    """Alive nodes with ``resource`` devices, numbered as explicit device ids count them:
    the driver's node first, then by (IP address, node id)."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(resource, 0) >= 1]
    return sorted(nodes, key=lambda n: (n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"]))


def held_devices(slots: dict[str, list[BundleSlot]], groups: dict[str, DeviceGroup]) -> dict:
    """(node id, resource) -> {device id: group name} for the devices ``slots`` occupy."""
    held: dict[tuple[str, str], dict[int, str]] = {}
    for name, group_slots in slots.items():
        g = groups.get(name)
        if g is None or not g.resource_name or g.colocate_with:
            continue
        for s in group_slots:
            for d in s.devices:
                held.setdefault((s.node_id, g.resource_name), {})[d] = name
    return held


class _Node:
    """What the call needs on one node: the declared ids and the CPUs of their workers."""

    def __init__(self, resource: str, info: dict, index: int):
        self.resource, self.info, self.index = resource, info, index
        self.ids: set[int] = set()
        self.cpus = 0.0
        self.groups: set[str] = set()

    @property
    def node_id(self) -> str:
        return self.info["NodeID"]

    @property
    def where(self) -> str:
        return f"node {self.index} ({self.info['NodeManagerAddress']}, {self.node_id[:8]})"

    def bundle(self) -> dict[str, float]:
        return {self.resource: len(self.ids), **({"CPU": self.cpus} if self.cpus else {})}


def reserve_pinned(
    groups: list[DeviceGroup],
    *,
    held: dict,
    timeout_s: float,
    name_prefix: str = "twinkle",
) -> tuple[PlacementGroup, dict[str, list[BundleSlot]]]:
    """Reserve the devices ``groups`` name; return the placement group and each group's slots
    (rank order = the order of the group's ids).

    ``held`` (see :func:`held_devices`) are devices this runtime's other groups already
    occupy. Raises ``PlacementError`` naming the ids when the declaration cannot be met
    (ids beyond the cluster's nodes, already held, or not reserved within ``timeout_s``);
    nothing stays reserved then.
    """
    deadline = time.monotonic() + timeout_s
    nodes, placements = _assign(groups, held)
    probes: list[PlacementGroup] = []
    pool = None
    try:
        found: dict[int, dict[int, PlacementGroup]] = {}
        for i, node in enumerate(nodes):
            found[i] = _find(node, probes, deadline, name_prefix)
        for per_node in found.values():  # free the declared ids for the pool to take
            for pg in per_node.values():
                probes.remove(pg)
                remove(pg)
        pool = _reserve_pool(nodes, deadline, name_prefix)
    except BaseException:
        if pool is not None:
            remove(pool)
        raise
    finally:
        for pg in probes:
            remove(pg)
    slots = {
        g.name: [
            BundleSlot(b, nodes[b].node_id, nodes[b].info["NodeManagerAddress"], tuple(local),
                       assigned=True)
            for b, local in placements[g.name]
        ]
        for g in groups
    }
    return pool, slots


def _assign(groups: list[DeviceGroup], held: dict) -> tuple[list[_Node], dict[str, list]]:
    """The nodes the declared ids are on, and each worker's (node entry, ids on the node)."""
    by_key: dict[tuple[str, int], _Node] = {}
    placements: dict[str, list] = {}
    cluster: dict[str, list[dict]] = {}
    for g in groups:
        res = g.resource_name
        nodes = cluster.setdefault(res, accelerator_nodes(res))
        if not nodes:
            raise PlacementError(f"group '{g.name}' names {res} devices {g.device_ids} but no "
                                 f"alive node has {res} devices")
        per_node = g.gpus_per_node or int(nodes[0]["Resources"][res])
        rule = f"device r is device r % {per_node} on node r // {per_node}"
        beyond, rows = [], []
        for i in range(g.num_workers):
            try:
                k, local = g.worker_placement(i, per_node)
            except ValueError as e:
                raise PlacementError(f"{e} ({rule})") from None
            if k >= len(nodes) or max(local) >= int(nodes[k]["Resources"][res]):
                beyond.extend(g.worker_devices(i))
                continue
            rows.append((k, local))
        if beyond:
            sizes = ", ".join(f"{int(n['Resources'][res])}" for n in nodes)
            raise PlacementError(
                f"group '{g.name}': device ids {beyond} are beyond the cluster's {res} devices: "
                f"{len(nodes)} node(s) with {sizes} {res} ({rule}; set gpus_per_node to change it)"
            )
        placements[g.name] = []
        for k, local in rows:
            key = (res, k)
            if key not in by_key:
                by_key[key] = _Node(res, nodes[k], k)
            node = by_key[key]
            taken = held.get((node.node_id, res), {})
            clash = sorted(d for d in local if d in taken)
            if clash:
                owners = ", ".join(sorted({f"'{taken[d]}'" for d in clash}))
                raise PlacementError(
                    f"group '{g.name}': {res} devices {clash} on {node.where} are already held by "
                    f"group {owners}"
                )
            node.ids.update(local)
            node.cpus += g.cpus_per_worker
            node.groups.add(g.name)
            placements[g.name].append((key, local))
    nodes = list(by_key.values())
    index = {key: b for b, key in enumerate(by_key)}
    return nodes, {name: [(index[key], local) for key, local in rows]
                   for name, rows in placements.items()}


def _wait(pgs: list[PlacementGroup], deadline: float, what) -> None:
    pending = {pg.ready(): pg for pg in pgs}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PlacementError(what())
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(left, 1.0))
        for ref in ready:
            pending.pop(ref)


def _bundle_ids(pg: PlacementGroup, index: int, resource: str, amount: int) -> list[int]:
    """The device ids Ray gave bundle ``index`` of ``pg`` (a task holding all of them says)."""
    return device_ids(ray.get(bundle_probe(pg, index, resource, amount)), resource)


def _find(node: _Node, probes: list, deadline: float, prefix: str) -> dict[int, PlacementGroup]:
    """Hold single devices of ``node`` until every declared id is held; return id -> its group."""
    res, total = node.resource, int(node.info["Resources"][node.resource])
    missing, found, mine = set(node.ids), {}, 0

    def busy() -> str:
        return (f"{res} devices {sorted(missing)} on {node.where}, named by group(s) "
                f"{', '.join(repr(g) for g in sorted(node.groups))}, are held by another Ray task "
                f"or placement group (none of them came free)")

    while missing:
        free = _free(res, deadline)
        m = min(len(missing), total - mine, free)
        if m <= 0:
            raise PlacementError(busy())
        batch = [placement_group([{res: 1}], name=f"{prefix}/probe/{uuid.uuid4().hex[:12]}",
                                 bundle_label_selector=[{NODE_LABEL: node.node_id}])
                 for _ in range(m)]
        probes.extend(batch)
        mine += m
        _wait(batch, deadline, busy)
        for pg in batch:
            [d] = _bundle_ids(pg, 0, res, 1)
            if d in missing:
                found[d] = pg
                missing.discard(d)
    return found


def _free(resource: str, deadline: float) -> int:
    """Free ``resource`` devices in the cluster; when none, looks again for up to ``SETTLE_S``
    (a placement group removed a moment ago returns its devices a little later)."""
    settle = min(deadline, time.monotonic() + SETTLE_S)
    while True:
        free = int(ray.available_resources().get(resource, 0))
        if free > 0 or time.monotonic() >= settle:
            return free
        time.sleep(0.1)


def _reserve_pool(nodes: list[_Node], deadline: float, prefix: str) -> PlacementGroup:
    """One bundle per node holding its declared ids (checked); retried while freed devices land."""
    bundles = [n.bundle() for n in nodes]
    selectors = [{NODE_LABEL: n.node_id} for n in nodes]
    wrong: list[str] = []
    for attempt in range(POOL_ATTEMPTS):
        groups = "+".join(sorted({g for n in nodes for g in n.groups}))
        pool = placement_group(bundles, strategy="PACK", name=f"{prefix}/{groups}",
                               bundle_label_selector=selectors)
        try:
            _wait([pool], deadline, lambda: "reservation of the named devices " + "; ".join(
                f"{n.resource} {sorted(n.ids)} on {n.where}" for n in nodes) + " not ready in time")
            wrong = []
            for b, n in enumerate(nodes):
                got = _bundle_ids(pool, b, n.resource, len(n.ids))
                if set(got) != n.ids:
                    wrong.append(f"{n.resource} {sorted(n.ids - set(got))} on {n.where} "
                                 f"(Ray gave {got})")
        except BaseException:
            remove(pool)
            raise
        if not wrong:
            return pool
        remove(pool)
        logger.debug("pinned reservation attempt %d got other devices: %s", attempt, wrong)
        time.sleep(0.2 * (attempt + 1))
    raise PlacementError("could not reserve the named devices " + "; ".join(wrong))
