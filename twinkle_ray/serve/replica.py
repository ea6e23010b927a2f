"""The gang a Serve replica owns, and the replica's policy for it: heal, wait, retry, give up.

One job: :class:`ReplicaGang` adopts the replica's placement group (no second reservation),
starts the gang's dispatcher and workers on bundles ``1..n`` and heals it: when a worker
dies, the replica rebuilds its gang on the same bundles while requests wait, and re-runs the
calls the death interrupted. Only a gang that cannot be rebuilt fails Serve's health check
(:class:`GangUnavailable`), and then Serve replaces the replica, gang and all.
:func:`per_item_spec` is how a served method is run so that its value holds one answer per
input item on any mesh.

Example::

    >>> from twinkle_ray.core.functions import RemoteFunction
    >>> per_item_spec(RemoteFunction(None, dispatch="slice_dp", collect="flatten")).collect
    'last_pp'
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..core.group import DeviceGroup
from ..core.mesh import DeviceMesh

__all__ = ["GangUnavailable", "ReplicaGang", "per_item_spec"]

logger = logging.getLogger(__name__)


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

        from ..runtime.adopt import adopt_placement_group
        from ..runtime.session import current

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
        from ..runtime.errors import CallTimeoutError, WorkerDiedError

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
        from ..runtime.errors import WorkerDiedError

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
        from ..runtime.proxy import RemoteMethod

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
        from ..runtime.session import current

        self.proxy.close("ReplicaGang.close() was called")
        rt = current()
        if rt is None:
            return
        rt.forget_adopted(self.group.name)
