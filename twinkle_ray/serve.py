"""Ray Serve integration: every replica owns one gang.

A DeviceGroup becomes the replica's ``placement_group_bundles``: bundle 0
holds the replica actor itself, bundles ``1..n`` one gang worker each. Serve
reserves the whole placement group before it starts a replica, so it
schedules whole gangs, never half of one. Inside the replica,
:class:`ReplicaGang` adopts that placement group (no second reservation),
starts the gang's dispatcher and workers on bundles ``1..n`` and reports the
gang's health to Serve: when a worker dies, ``check_health`` raises
``WorkerDiedError`` and Serve replaces the replica, gang and all. Requests and
responses are JSON (:func:`read_json`); nothing here unpickles bytes from an
HTTP client.

Example::

    from ray import serve
    from twinkle_ray import DeviceGroup
    from twinkle_ray.serve import ReplicaGang, deployment_options, read_json

    GROUP = DeviceGroup("sampler", ranks=2, device_type="cuda")

    @serve.deployment(**deployment_options(GROUP))
    class Server:
        def __init__(self):
            self.gang = ReplicaGang(GROUP, Sampler, device_mesh=DeviceMesh.from_sizes(dp_size=2))

        async def __call__(self, request):
            body = await read_json(request)
            return await self.gang.call(self.gang.proxy.generate, [body["prompt"]])

        async def check_health(self):
            await self.gang.check_health()

    serve.run(Server.bind(), route_prefix="/sample")
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .group import DeviceGroup
from .mesh import DeviceMesh

logger = logging.getLogger(__name__)

DEFAULT_REPLICA_RESOURCES: dict[str, float] = {"CPU": 1.0}
MAX_BODY_BYTES = 1 << 20


class BadRequest(ValueError):
    """A request body that is not acceptable JSON; ``status`` is the HTTP code to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


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

    from .errors import PlacementError

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


def _replica_namespace() -> str:
    """A namespace of our own per replica, so gang names never clash between replicas."""
    try:
        from ray import serve

        rid = serve.get_replica_context().replica_id
        return f"twinkle-serve-{rid.deployment_id.name}-{rid.unique_id}"
    except Exception:  # not inside a Serve replica (a test, a plain actor)
        return f"twinkle-serve-{uuid.uuid4().hex[:8]}"


class ReplicaGang:
    """The gang a Serve replica owns, started on the replica's own placement group.

    ``cls`` is a ``@remote_class``; ``args``/``kwargs`` go to its constructor.
    Must be built inside an actor scheduled with ``deployment_options(group)``
    (bundle 0 = the replica, bundles 1..n = the workers). The gang's
    dispatcher and workers are owned by the replica and die with it.

    ``data_world_size`` is the DeviceMesh's (found among the constructor
    arguments), else the number of workers.

    Example::

        self.gang = ReplicaGang(GROUP, Sampler, device_mesh=mesh)
        out = await self.gang.call(self.gang.proxy.generate, prompts)
    """

    def __init__(self, group: DeviceGroup, cls: type, *args: Any, namespace: str | None = None,
                 **kwargs: Any):
        from ray.util import get_current_placement_group

        import twinkle_ray

        from .runtime import adopt_placement_group, current

        pg = get_current_placement_group()
        if pg is None:
            raise RuntimeError(
                f"ReplicaGang('{group.name}'): this process is not in a placement group; deploy "
                f"with @serve.deployment(**deployment_options(group))"
            )
        n_bundles = len(pg.bundle_specs)
        if n_bundles != group.num_workers + 1:
            raise ValueError(
                f"ReplicaGang('{group.name}'): the replica's placement group has {n_bundles} "
                f"bundle(s); group '{group.name}' needs {group.num_workers + 1} (the replica's "
                f"own, then one per worker) — use deployment_options(group)"
            )
        self.group = group
        self.namespace = namespace or _replica_namespace()
        rt = current()
        if rt is None:
            twinkle_ray.initialize("ray", namespace=self.namespace)
        elif rt.mode != "ray":
            raise RuntimeError("ReplicaGang: twinkle_ray is initialised in local mode")
        else:
            self.namespace = rt.namespace
        adopt_placement_group(group, pg, range(1, group.num_workers + 1))
        mesh = next((v for v in (*args, *kwargs.values()) if isinstance(v, DeviceMesh)), None)
        self.data_world_size = mesh.data_world_size if mesh is not None else group.num_workers
        self.proxy = cls(*args, remote_group=group.name, **kwargs)
        logger.info("replica gang %r started in namespace %s", self.proxy, self.namespace)

    async def check_health(self, timeout: float = 10.0) -> None:
        """Raise WorkerDiedError if a worker of the gang died; for Serve's ``check_health``."""
        await asyncio.to_thread(self.proxy.check_health, timeout)

    async def call(self, method: Callable, items: Sequence, *, pad: Any = None,
                   timeout: float | None = None) -> list:
        """Run a ``slice_dp``/``collect='flatten'`` method on ``items``; await its results.

        A batch smaller than the gang's data-parallel size is padded with
        ``pad`` (the method must pass pads through) and trimmed afterwards, so
        a lone request still works. Blocking fetches run in a thread, so the
        replica's event loop keeps serving.
        """
        items = list(items)
        dp = self.data_world_size
        padded = items + [pad] * max(0, dp - len(items))
        result = method(padded)
        get = getattr(result, "get", None)
        values = await asyncio.to_thread(get, timeout) if get is not None else result
        return list(values)[: len(items)]

    def topology(self) -> dict:
        """The gang's ranks, nodes and devices, plus the replica's namespace."""
        return {"namespace": self.namespace, **self.proxy.topology()}

    def close(self) -> None:
        """Kill the gang (the placement group stays Serve's). Idempotent."""
        import twinkle_ray

        twinkle_ray.shutdown()


async def read_json(request: Any, *, max_bytes: int = MAX_BODY_BYTES) -> dict:
    """The JSON object in an HTTP request's body, or BadRequest (never unpickles anything).

    ``request`` is a Starlette request (what Serve passes to ``__call__``).
    """
    body = await request.body()
    if len(body) > max_bytes:
        raise BadRequest(f"request body of {len(body)} bytes exceeds {max_bytes}", status=413)
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"request body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(data).__name__}")
    return data


def json_response(content: Any, status: int = 200) -> Any:
    """A Starlette JSONResponse (what a Serve ``__call__`` returns for an error status)."""
    from starlette.responses import JSONResponse

    return JSONResponse(content, status_code=status)
