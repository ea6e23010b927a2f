"""adopt_placement_group: a group on a placement group someone else owns.

A process that already holds a placement group (a Ray Serve replica created
with ``placement_group_bundles``) declares a DeviceGroup on some of its
bundles instead of reserving one. The runtime records the group as adopted:
``shutdown()`` kills its gangs but never removes the placement group.

Example::

    adopt_placement_group(DeviceGroup("sampler", 2), pg, bundle_indices=[1, 2])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.group import DeviceGroup, check_groups


def adopt_placement_group(
    group: DeviceGroup,
    pg: Any,
    bundle_indices: Sequence[int] | None = None,
    *,
    timeout_s: float | None = None,
) -> None:
    """Declare ``group`` on an existing placement group instead of reserving one.

    For a process that already owns a placement group, e.g. a Ray Serve
    replica created with ``placement_group_bundles`` (see twinkle_ray.serve):
    worker i of the group runs on bundle ``bundle_indices[i]`` of ``pg``
    (default ``0..n-1``). Each of those bundles must hold one worker's bundle
    (``group.bundles()[0]``). The runtime never removes an adopted placement
    group; ``shutdown()`` only kills the gangs on it. Call ``initialize('ray')``
    first.

    Example (inside a Serve replica whose bundle 0 holds the replica)::

        twinkle_ray.initialize("ray")
        pg = ray.util.get_current_placement_group()
        adopt_placement_group(DeviceGroup("sampler", 2), pg, bundle_indices=[1, 2])
        sampler = Sampler(remote_group="sampler")
    """
    from .placement import probe_slots
    from .session import current

    rt = current()
    if rt is None or rt.mode != "ray":
        raise RuntimeError("adopt_placement_group: call twinkle_ray.initialize('ray') first")
    if group.colocate_with:
        raise ValueError(
            f"adopt_placement_group: group '{group.name}' has colocate_with set; an adopted "
            f"group brings its own placement group"
        )
    if group.name in rt.groups:
        raise RuntimeError(f"adopt_placement_group: group '{group.name}' is already declared")
    check_groups([*rt.groups.values(), group])
    n = group.num_workers
    index = list(range(n)) if bundle_indices is None else [int(b) for b in bundle_indices]
    specs = list(pg.bundle_specs)
    if len(index) != n or len(set(index)) != n or any(not 0 <= b < len(specs) for b in index):
        raise ValueError(
            f"adopt_placement_group: group '{group.name}' has {n} worker(s); bundle_indices "
            f"{index} must name {n} distinct bundles of a placement group with {len(specs)}"
        )
    need = group.bundles()[0]
    for b in index:
        short = {k: v for k, v in need.items() if specs[b].get(k, 0.0) + 1e-9 < v}
        if short:
            raise ValueError(
                f"adopt_placement_group: bundle {b} {specs[b]} cannot hold one worker of group "
                f"'{group.name}', which needs {need}"
            )
    wait = rt.placement_timeout_s if timeout_s is None else timeout_s
    if not pg.wait(wait):
        from .errors import PlacementError

        raise PlacementError(
            f"adopt_placement_group: placement group of group '{group.name}' not ready after {wait:g}s"
        )
    slots = probe_slots(group, pg, index)
    rt.groups[group.name] = group
    rt.pgs[group.name] = pg
    rt.slots[group.name] = slots
    rt.adopted.add(group.name)
