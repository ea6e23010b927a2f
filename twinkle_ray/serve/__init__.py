"""Ray Serve integration: every replica owns one gang.

A DeviceGroup becomes the replica's ``placement_group_bundles``: bundle 0
holds the replica actor itself, bundles ``1..n`` one gang worker each. Serve
reserves the whole placement group before it starts a replica, so it
schedules whole gangs, never half of one. Inside the replica,
:class:`ReplicaGang` adopts that placement group (no second reservation),
starts the gang's dispatcher and workers on bundles ``1..n`` and heals it:
when a worker dies, the replica rebuilds its gang on the same bundles while
requests wait, and re-runs the calls the death interrupted. Only a gang
that cannot be rebuilt fails Serve's health check, and then Serve replaces
the replica, gang and all. Requests and responses are JSON
(:func:`read_json`, :func:`json_response`, :func:`error_response`): every bad
request gets a 4xx with a JSON error; nothing here unpickles bytes from an
HTTP client.

One module per job:

- :mod:`~twinkle_ray.serve.deployment`: :func:`deployment_options`, :func:`replica_bundles`,
  :func:`check_cluster_fits` (what Serve is asked for);
- :mod:`~twinkle_ray.serve.replica`: :class:`ReplicaGang`, :class:`GangUnavailable`,
  :func:`per_item_spec` (the replica's gang and its heal / retry / give-up policy);
- :mod:`~twinkle_ray.serve.http_json`: :func:`read_json`, :func:`json_response`,
  :func:`error_response`, :class:`BadRequest` (JSON over HTTP).

Example::

    from ray import serve
    from twinkle_ray import DeviceGroup
    from twinkle_ray.serve import ReplicaGang, deployment_options, error_response, read_json

    GROUP = DeviceGroup("sampler", ranks=2, device_type="cuda")

    @serve.deployment(**deployment_options(GROUP))
    class Server:
        def __init__(self):
            self.gang = ReplicaGang(GROUP, Sampler, device_mesh=DeviceMesh.from_sizes(dp_size=2))

        async def __call__(self, request):
            try:
                body = await read_json(request)
                return await self.gang.call(self.gang.proxy.generate, [body["prompt"]])
            except Exception as e:  # 4xx for a bad request, 503 while the gang is unavailable
                return error_response(e)

        async def check_health(self):
            await self.gang.check_health()

    serve.run(Server.bind(), route_prefix="/sample")
"""

from .deployment import (
    DEFAULT_REPLICA_RESOURCES,
    check_cluster_fits,
    deployment_options,
    replica_bundles,
)
from .http_json import (
    MAX_BODY_BYTES,
    MAX_ERROR_CHARS,
    MAX_JSON_DEPTH,
    UNAVAILABLE_MESSAGE,
    BadRequest,
    error_response,
    json_response,
    read_json,
)
from .replica import GangUnavailable, ReplicaGang, per_item_spec

__all__ = [
    "DEFAULT_REPLICA_RESOURCES",
    "MAX_BODY_BYTES",
    "MAX_ERROR_CHARS",
    "MAX_JSON_DEPTH",
    "UNAVAILABLE_MESSAGE",
    "BadRequest",
    "GangUnavailable",
    "ReplicaGang",
    "check_cluster_fits",
    "deployment_options",
    "error_response",
    "json_response",
    "per_item_spec",
    "read_json",
    "replica_bundles",
]
