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

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .core.group import DeviceGroup
from .core.mesh import DeviceMesh

logger = logging.getLogger(__name__)

DEFAULT_REPLICA_RESOURCES: dict[str, float] = {"CPU": 1.0}
MAX_BODY_BYTES = 1 << 20


MAX_JSON_DEPTH = 32
MAX_ERROR_CHARS = 500


class BadRequest(ValueError):
    """A request that is not acceptable; ``status`` is the HTTP code to answer (4xx).

    ``headers`` go into the answer (``Allow`` for a 405). Messages are cut to
    ``MAX_ERROR_CHARS`` so an error never echoes a whole body back.
    """

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None):
        if len(message) > MAX_ERROR_CHARS:
            message = message[: MAX_ERROR_CHARS - 3] + "..."
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.status, self.headers))


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

    from .runtime.errors import PlacementError

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


def per_item_spec(spec: Any, name: str = "?") -> Any:
    """The spec :meth:`ReplicaGang.call` runs a method with, so that its value holds one answer
    per input item, in input order, on any mesh (dp, dp x tp, fsdp x dp, pp).

    A ``slice_dp`` method runs each data rank's slice on every worker of that data rank (its
    tp/pp peers too), and ``collect='flatten'`` joins every worker's answers in worker order: on
    a mesh that is not plain dp that repeats slices (tp peers), orders them by global rank, not
    data rank (fsdp x dp), or mixes in the other pipeline stages' outputs. The collect that
    reads one output per data rank, in data-rank order, from the last pipeline stage is
    ``'last_pp'`` (the routing rule's own); it is what the call is collected with, lazily (an
    eager method's value would already be joined). ``dispatch='balance'`` already joins in
    input order. Other dispatch modes give no per-item answers: ValueError naming the method.

    >>> from twinkle_ray.core.functions import RemoteFunction
    >>> s = per_item_spec(RemoteFunction(None, dispatch="slice_dp", collect="flatten", sync=True))
    >>> s.collect, s.sync, s.lazy_collect
    ('last_pp', False, True)
    """
    import copy

    if spec.dispatch == "balance":
        out = copy.copy(spec)
    elif spec.dispatch == "slice_dp" and spec.collect in ("flatten", "last_pp"):
        out = copy.copy(spec)
        out.collect = "last_pp"
    else:
        raise ValueError(
            f"ReplicaGang.call: {name}() has dispatch={spec.dispatch!r}, collect={spec.collect!r}; "
            f"a served method takes a list and returns one answer per item (dispatch='slice_dp' "
            f"or 'balance', collect='flatten')")
    out.sync, out.lazy_collect = False, True
    return out


def _replica_namespace() -> str:
    """A namespace of our own per replica, so gang names never clash between replicas."""
    try:
        from ray import serve

        rid = serve.get_replica_context().replica_id
        return f"twinkle-serve-{rid.deployment_id.name}-{rid.unique_id}"
    except Exception:  # not inside a Serve replica (a test, a plain actor)
        return f"twinkle-serve-{uuid.uuid4().hex[:8]}"


class GangUnavailable(RuntimeError):
    """The replica's gang died and could not be rebuilt; Serve's health check now fails.

    Raised by :meth:`ReplicaGang.call` and :meth:`ReplicaGang.check_health`;
    ``cause`` is the last WorkerDiedError or the rebuild's own error. Serve
    replaces the replica (a fresh placement group and gang) after its health
    check threshold.
    """

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause

    def __reduce__(self):
        return (type(self), (self.args[0], self.cause))


class ReplicaGang:
    """The gang a Serve replica owns, started on the replica's own placement group.

    ``cls`` is a ``@remote_class``; ``args``/``kwargs`` go to its constructor.
    Must be built inside an actor scheduled with ``deployment_options(group)``
    (bundle 0 = the replica, bundles 1..n = the workers). The gang's
    dispatcher and workers are owned by the replica and die with it.

    ``data_world_size`` is the DeviceMesh's (found among the constructor
    arguments), else the number of workers.

    **A dead worker is healed inside the replica, by the gang's own restart
    policy.** The replica sets its limits on the gang's dispatcher (at most
    ``max_rebuilds`` automatic rebuilds within ``rebuild_window_s``; they
    replace the class's ``max_restarts``), and the dispatcher rebuilds the
    gang on the same bundles when a worker dies: there is one policy, one
    count of rebuilds, and the rebuilds show in ``twinkle_gang_restarts_total``.
    Calls arriving meanwhile wait for the rebuild; a call that was in flight
    at the death (it raised ``WorkerDiedError``) is run again on the new gang,
    up to ``retries`` times, so the methods called through :meth:`call` must
    be safe to repeat (sampling is; pass ``retries=0`` otherwise). A dead
    dispatcher (the workers die with it) is respawned by the replica with its gang,
    as the gang's creator respawns it (within the same limits, also for a class
    without ``max_restarts``), restoring the state last saved to files. Only when
    the dispatcher gives up (a rebuild failed, or the budget is spent) or a
    rebuild takes longer than ``rebuild_timeout_s`` does the gang count as
    unavailable: calls and ``check_health`` raise :class:`GangUnavailable`
    (saying why) and Serve replaces the replica. ``heal=False`` turns all of
    this off (no automatic rebuild; a death fails ``check_health`` at once).

    Example::

        self.gang = ReplicaGang(GROUP, Sampler, device_mesh=mesh)
        out = await self.gang.call(self.gang.proxy.generate, prompts)
    """

    def __init__(self, group: DeviceGroup, cls: type, *args: Any, namespace: str | None = None,
                 heal: bool = True, retries: int = 2, rebuild_timeout_s: float = 120.0,
                 max_rebuilds: int = 5, rebuild_window_s: float = 600.0, **kwargs: Any):
        from ray.util import get_current_placement_group

        import twinkle_ray

        from .runtime.adopt import adopt_placement_group
        from .runtime.session import current

        if retries < 0 or max_rebuilds < 0 or rebuild_timeout_s <= 0 or rebuild_window_s <= 0:
            raise ValueError(
                f"ReplicaGang('{group.name}'): retries and max_rebuilds must be >= 0 and the "
                f"timeouts positive, got retries={retries}, max_rebuilds={max_rebuilds}, "
                f"rebuild_timeout_s={rebuild_timeout_s}, rebuild_window_s={rebuild_window_s}"
            )
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
        self.heal = heal
        self.retries = retries
        self.rebuild_timeout_s = rebuild_timeout_s
        self.max_rebuilds = max_rebuilds
        self.rebuild_window_s = rebuild_window_s
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
        self.policy = self.proxy.set_restart_policy(max_rebuilds if heal else 0, rebuild_window_s)
        self._unavailable: GangUnavailable | None = None
        logger.info("replica gang %r started in namespace %s (%s)", self.proxy, self.namespace,
                    self.policy)

    # -- health and healing ----------------------------------------------------------------------
    @property
    def rebuilding(self) -> bool:
        """True while the gang's dispatcher rebuilds it."""
        try:
            return bool(self.proxy.topology().get("rebuilding"))
        except Exception:  # noqa: BLE001 — the dispatcher is gone: nothing is being rebuilt
            return False

    async def check_health(self, timeout: float = 10.0) -> None:
        """For Serve's ``check_health``: raise unless the gang can serve calls now.

        A rebuild under way is waited for up to ``timeout``; a gang still being
        rebuilt after that is not healthy: GangUnavailable says so, but only for
        this check (once the rebuild is done, the next check passes; every
        rebuild ends within ``start_timeout_s``). A gang that is down and not
        being rebuilt makes the replica unavailable for good: Serve replaces it.
        """
        from .runtime.errors import CallTimeoutError, WorkerDiedError

        if self._unavailable is not None:
            raise self._unavailable
        try:
            await asyncio.to_thread(self.proxy.check_health, timeout, self.heal)
            return
        except WorkerDiedError as e:
            if not self.heal:
                raise
            why: BaseException = e
        except CallTimeoutError as e:  # a rebuild under way took longer than ``timeout``
            why = e
        except Exception as e:  # noqa: BLE001 — the dispatcher is gone
            self._give_up(f"its gang on group '{self.group.name}' cannot be reached: "
                          f"{type(e).__name__}: {e}", e)
        desc = await asyncio.to_thread(self._describe)
        if desc.get("rebuilding"):
            raise GangUnavailable(f"replica not ready: its gang on group '{self.group.name}' is "
                                  f"being rebuilt ({type(why).__name__}: {why})", why)
        self._give_up(f"its gang on group '{self.group.name}' is down and not being rebuilt: "
                      f"{why}", why)

    def _describe(self) -> dict:
        try:
            return dict(self.proxy.topology())
        except Exception:  # noqa: BLE001 — the dispatcher is gone
            logger.debug("topology of %r failed", self.proxy, exc_info=True)
            return {}

    async def _await_rebuild(self, death: BaseException) -> None:
        """Wait for the dispatcher's rebuild after ``death``; GangUnavailable if it gives up."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await asyncio.wait_for(
                asyncio.to_thread(self.proxy.check_health, self.rebuild_timeout_s, True),
                self.rebuild_timeout_s + 5.0)
        except Exception as e:  # noqa: BLE001 — anything here means: no gang to serve with
            self._give_up(f"its gang on group '{self.group.name}' was not rebuilt after "
                          f"{death}: {type(e).__name__}: {e}", e)
        logger.warning("replica gang %r ready again after %.1fs", self.proxy, loop.time() - t0)

    def _give_up(self, why: str, cause: BaseException) -> None:
        self._unavailable = GangUnavailable(
            f"replica unavailable: {why}; Serve's health check now fails and Serve replaces "
            f"the replica", cause)
        logger.error("%s", self._unavailable)
        raise self._unavailable

    # -- calls ---------------------------------------------------------------------------------
    async def call(self, method: Callable, items: Sequence, *, pad: Any = None,
                   timeout: float | None = None, retries: int | None = None) -> list:
        """Run a ``slice_dp``/``collect='flatten'`` method on ``items``; await its results.

        A batch smaller than the gang's data-parallel size is padded with
        ``pad`` (the method must pass pads through) and trimmed afterwards, so
        a lone request still works. Blocking fetches run in a thread, so the
        replica's event loop keeps serving. A call made while the gang is
        being rebuilt waits for the rebuild; one that meets a dead worker is
        run again on the rebuilt gang (``retries``, default the gang's).
        Raises :class:`GangUnavailable` when the gang is not rebuilt.
        """
        from .runtime.errors import WorkerDiedError

        retries = self.retries if retries is None else retries
        attempt = 0
        while True:
            if self._unavailable is not None:
                raise self._unavailable
            try:
                return await self._call_once(method, items, pad, timeout)
            except WorkerDiedError as e:
                if not self.heal:
                    raise
                await self._await_rebuild(e)
                if attempt >= retries:
                    raise
                attempt += 1
                logger.info("call on replica gang %r met a dead worker; retry %d of %d on the "
                            "rebuilt gang", self.proxy, attempt, retries)

    async def _call_once(self, method: Callable, items: Sequence, pad: Any,
                         timeout: float | None) -> list:
        from .runtime.proxy import RemoteMethod

        items = list(items)
        dp = self.data_world_size
        padded = items + [pad] * max(0, dp - len(items))
        if isinstance(method, RemoteMethod):  # one answer per item, in item order (any mesh)
            method = RemoteMethod(method.proxy, method.name, per_item_spec(method.spec, method.name))
        result = method(padded)
        get = getattr(result, "get", None)
        values = list(await asyncio.to_thread(get, timeout) if get is not None else result)
        if len(values) != len(padded):
            name = getattr(method, "name", getattr(method, "__name__", repr(method)))
            raise RuntimeError(
                f"ReplicaGang('{self.group.name}'): {name}() gave {len(values)} answer(s) for "
                f"{len(padded)} item(s); a method served through ReplicaGang.call returns one "
                f"answer per item of its slice")
        return values[: len(items)]

    def topology(self) -> dict:
        """The gang's ranks, nodes and devices, plus the replica's namespace."""
        return {"namespace": self.namespace, **self.proxy.topology()}

    def close(self) -> None:
        """Kill this replica's gang and forget its group (the placement group stays Serve's).

        Other gangs of the process, and the twinkle_ray runtime, are left alone. Idempotent.
        """
        from .runtime.session import current

        self.proxy.close("ReplicaGang.close() was called")
        rt = current()
        if rt is None:
            return
        rt.forget_adopted(self.group.name)


# -- JSON over HTTP --------------------------------------------------------------------------------
def _json_depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, without recursion; stops counting past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    """A JSON number as a float; ValueError for one out of a float's range (``1e999`` would
    parse to infinity, which JSON cannot carry back).

    >>> _finite_float("1.5")
    1.5
    """
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range (a float cannot hold it)")
    return value


def _float_range_int(text: str) -> int:
    """A JSON integer as an int; ValueError for one out of a float's range (a handler's
    ``float(x)`` would raise OverflowError: a 500), as for ``1e999``.

    >>> _float_range_int("12")
    12
    """
    value = int(text)  # ValueError past 4300 digits (Python's own limit)
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"the number {text[:40]}... ({len(text)} characters) is out of range "
                         f"(a float cannot hold it)") from None
    return value


async def read_json(request: Any, *, max_bytes: int = MAX_BODY_BYTES,
                    max_depth: int = MAX_JSON_DEPTH, methods: Sequence[str] = ("POST",)) -> dict:
    """The JSON object in an HTTP request's body, or BadRequest (never unpickles anything).

    ``request`` is a Starlette request (what Serve passes to ``__call__``).
    Every way a request can be wrong is a :class:`BadRequest` whose
    ``status`` is the 4xx to answer: a method not in ``methods`` (405, with
    an ``Allow`` header), a ``Content-Length`` over ``max_bytes`` (413, before
    any of the body is read; a body without one is read only up to
    ``max_bytes``), a body that is not UTF-8 JSON (``NaN``/``Infinity`` are not
    JSON, nor a number out of a float's range such as ``1e999`` or a 400-digit integer),
    nested deeper than
    ``max_depth``, or not an object (400).
    """
    method = str(getattr(request, "method", "POST")).upper()
    allowed = [m.upper() for m in methods]
    if allowed and method not in allowed:
        raise BadRequest(f"method {method} is not allowed here; send {' or '.join(allowed)} with "
                         f"a JSON object as the body", status=405,
                         headers={"Allow": ", ".join(allowed)})
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
            if size < 0:
                raise ValueError
        except ValueError:
            raise BadRequest(f"Content-Length {declared[:40]!r} is not a byte count") from None
        if size > max_bytes:
            raise BadRequest(f"request body of {size} bytes exceeds {max_bytes}", status=413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise BadRequest(f"request body exceeds {max_bytes} bytes", status=413)
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant,
                          parse_float=_finite_float, parse_int=_float_range_int)
    except RecursionError:
        raise BadRequest(f"request body is nested too deeply (more than {max_depth} levels)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, 1e999, a 400-digit integer
        raise BadRequest(f"request body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(data).__name__}")
    if _json_depth(data, max_depth) > max_depth:
        raise BadRequest(f"request body is nested too deeply (more than {max_depth} levels)")
    return data


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Any:
    """A JSON HTTP response (what a Serve ``__call__`` returns), ASCII-escaped.

    Escaping keeps any string a client sent (a lone surrogate included) encodable,
    so an error message quoting the client can never turn into a 500.
    """
    from starlette.responses import Response

    body = json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return Response(body.encode("ascii"), status_code=status, headers=headers,
                    media_type="application/json")


UNAVAILABLE_MESSAGE = "replica unavailable: its gang is down or being rebuilt; retry later"


def error_response(error: BaseException) -> Any:
    """The JSON error response for ``error``: a BadRequest's own 4xx, 503 for a gang that is
    dead or being rebuilt, else 500.

    Only a BadRequest's message (about the client's own request) reaches the client. A 503 or
    500 answers a short fixed text and a ``request_id``; the error itself (node addresses and
    ids, Ray's death text, another request's exception) goes to the replica's log under that id.

    Example::

        try:
            return json_response(await self.gang.call(self.gang.proxy.generate, prompts))
        except Exception as e:
            return error_response(e)  # {"error": "replica unavailable: ...", "request_id": ...}
    """
    from .runtime.errors import WorkerDiedError

    if isinstance(error, BadRequest):
        return json_response({"error": str(error)}, error.status, error.headers)
    request_id = uuid.uuid4().hex[:16]
    if isinstance(error, GangUnavailable | WorkerDiedError):
        logger.warning("request %s answered 503: %s: %s", request_id, type(error).__name__, error)
        return json_response({"error": UNAVAILABLE_MESSAGE, "request_id": request_id}, 503,
                             {"Retry-After": "1"})
    logger.error("request %s failed", request_id, exc_info=error)
    return json_response({"error": f"internal error ({type(error).__name__}); see the replica's "
                                   f"log", "request_id": request_id}, 500)
