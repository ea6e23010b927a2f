"""Deploying a gang per replica: a DeviceGroup as a Serve deployment's placement-group bundles.

One job: what Serve is asked for. A DeviceGroup becomes the replica's
``placement_group_bundles`` (:func:`replica_bundles`): bundle 0 holds the replica actor
itself, bundles ``1..n`` one gang worker each. Serve reserves the whole placement group
before it starts a replica, so it schedules whole gangs, never half of one.
:func:`deployment_options` gives the ``@serve.deployment`` keywords;
:func:`check_cluster_fits` refuses at once a cluster that can never hold the replicas.

Example::

    >>> from twinkle_ray import DeviceGroup
    >>> deployment_options(DeviceGroup("s", 2, "cpu"))["placement_group_bundles"]
    [{'CPU': 1.0}, {'CPU': 1.0}, {'CPU': 1.0}]
"""

from __future__ import annotations

from typing import Any

from ..core.group import DeviceGroup

__all__ = ["DEFAULT_REPLICA_RESOURCES", "check_cluster_fits", "deployment_options", "replica_bundles"]

DEFAULT_REPLICA_RESOURCES: dict[str, float] = {"CPU": 1.0}


def replica_bundles(
    group: DeviceGroup, replica_resources: dict[str, float] | None = None
) -> list[dict[str, float]]:
    """The placement-group bundles of one replica: the replica's own, then one per worker.

    >>> replica_bundles(DeviceGroup("s", 2, "cpu"))
    [{'CPU': 1.0}, {'CPU': 1.0}, {'CPU': 1.0}]
    """
    own = dict(DEFAULT_REPLICA_RESOURCES if replica_resources is None else replica_resources)
    if not own or any(v <= 0 for v in own.values()):
        raise ValueError(f"replica_resources must be positive amounts, got {own!r}")
    return [own, *group.bundles()]


def deployment_options(
    group: DeviceGroup,
    *,
    replica_resources: dict[str, float] | None = None,
    health_check_period_s: float = 2.0,
    health_check_timeout_s: float = 30.0,
    **extra: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``@serve.deployment`` / ``.options`` so each replica holds one gang.

    The replica actor asks for exactly its bundle 0 (``ray_actor_options``);
    the placement-group strategy is the group's. ``extra`` is passed through
    (``num_replicas``, ``max_ongoing_requests``, ...).

    >>> opts = deployment_options(DeviceGroup("s", 2, "cpu"), num_replicas=2)
    >>> opts["placement_group_bundles"], opts["ray_actor_options"], opts["num_replicas"]
    ([{'CPU': 1.0}, {'CPU': 1.0}, {'CPU': 1.0}], {'num_cpus': 1.0}, 2)
    """
    if group.colocate_with:
        raise ValueError(f"group '{group.name}': a Serve replica's gang cannot colocate_with")
    bundles = replica_bundles(group, replica_resources)
    own = dict(bundles[0])
    actor: dict[str, Any] = {"num_cpus": own.pop("CPU", 0.0)}
    if "GPU" in own:
        actor["num_gpus"] = own.pop("GPU")
    if own:
        actor["resources"] = own
    return {
        "placement_group_bundles": bundles,
        "placement_group_strategy": group.strategy,
        "ray_actor_options": actor,
        "health_check_period_s": health_check_period_s,
        "health_check_timeout_s": health_check_timeout_s,
        **extra,
    }


def check_cluster_fits(
    group: DeviceGroup,
    *,
    num_replicas: int = 1,
    replica_resources: dict[str, float] | None = None,
) -> None:
    """Raise PlacementError at once if the running cluster can never hold the replicas.

    Serve would otherwise wait for the resources forever (logging every 30 s).
    A cluster that is only busy passes.
    """
    import ray

    from ..runtime.errors import PlacementError

    bundles = replica_bundles(group, replica_resources)
    wanted: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            wanted[k] = wanted.get(k, 0.0) + v * num_replicas
    total = ray.cluster_resources()
    short = {k: v for k, v in wanted.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        have = ", ".join(f"{k}: {total.get(k, 0.0):g}" for k in wanted)
        need = ", ".join(f"{k}: {v:g}" for k, v in wanted.items())
        raise PlacementError(
            f"{num_replicas} replica(s) of a gang on group '{group.name}' need {{{need}}} "
            f"(per replica: {bundles}); the cluster has {{{have}}}"
        )
