"""The worker actor: hosts one instance of the user's class in a gang.

The user's class needs no ``@ray.remote``; the worker builds it after setting
the gang's environment (devices, RANK, MASTER_ADDR, ...) and, when asked,
initialising torch.distributed. Calls arrive through ``run``, which resolves
routed LazyResult pieces (fetched from the producers' object stores) before
calling the method.

Example (what the dispatcher does)::

    w = make_worker(info, slot, pg, owns_bundle=True)
    ray.get(w.start.remote(master_addr, port, dist, ...))
    out, meta = w.run.options(num_returns=2).remote("forward", batch)
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .dispatch import batch_len
from .lazy import END_OF_ITERATION, resolve_routed
from .placement import resource_options

logger = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    """Everything a worker needs to know about its place in the gang."""

    group: str
    cls_name: str
    name: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    devices: tuple[int, ...]
    visible_devices_env: str | None
    kind: str
    env: dict[str, str] = field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "TWINKLE_GROUP": self.group,
            "TWINKLE_WORKER": self.name,
        }
        if self.visible_devices_env:
            env[self.visible_devices_env] = ",".join(str(d) for d in self.devices)
        env.update(self.env)
        return env


class GangWorker:
    """One member of a gang. Created by the dispatcher, never by users."""

    def __init__(self, info: WorkerInfo):
        os.environ.update(info.environ())
        self.info = info
        self.instance: Any = None

    def endpoint(self) -> tuple[str, int]:
        """This node's IP and a free TCP port on it (for MASTER_PORT)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(
        self,
        master_port: int,
        distributed: bool,
        dist_timeout_s: float,
        seed: int | None,
        cls: type,
        args: tuple,
        kwargs: dict,
    ) -> str | None:
        """Join torch.distributed (all ranks call this concurrently), then build the instance.

        Returns the torch.distributed backend used, or None.
        """
        os.environ["MASTER_PORT"] = str(master_port)
        backend = None
        if distributed:
            backend = self._init_distributed(dist_timeout_s)
        if seed is not None:
            _seed_everything(seed)
        # Constructor arguments travel nested in a tuple, so Ray does not resolve the
        # ObjectRefs that put_large made of large ones: resolve_routed fetches them.
        args = tuple(resolve_routed(a) for a in args)
        kwargs = {k: resolve_routed(v) for k, v in kwargs.items()}
        self.instance = cls(*args, **kwargs)
        return backend

    def _init_distributed(self, timeout_s: float) -> str:
        import torch
        import torch.distributed as dist

        backend = "gloo"
        if self.info.kind == "gpu" and torch.cuda.is_available():
            backend = "nccl"
            torch.cuda.set_device(0)
        elif self.info.kind == "npu":
            try:
                import torch_npu  # noqa: F401

                backend = "hccl"
            except ImportError:
                backend = "gloo"
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{_url_host(self.info.master_addr)}:{os.environ['MASTER_PORT']}",
            rank=self.info.rank,
            world_size=self.info.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        return backend

    def run(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Call ``method`` on the instance; return (result, meta).

        meta is the result's batch length (used to route it lazily), None when
        it has none, or END_OF_ITERATION when ``__next__`` is exhausted.
        """
        args = tuple(resolve_routed(a) for a in args)
        kwargs = {k: resolve_routed(v) for k, v in kwargs.items()}
        try:
            result = getattr(self.instance, method)(*args, **kwargs)
        except StopIteration:
            if method == "__next__":
                return None, END_OF_ITERATION
            raise
        if result is self.instance:  # e.g. __iter__ returning self: keep it here
            return None, None
        return result, _meta(result)

    def run_value(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``run`` without the length record: for calls whose outputs are never sliced by length."""
        return self.run(method, *args, **kwargs)[0]

    @ray.method(concurrency_group="control")
    def watch(self) -> None:
        """Never returns; its ref fails when this actor dies (the dispatcher's health signal)."""
        threading.Event().wait()

    def stop(self) -> None:
        """Leave torch.distributed cleanly before the actor is killed."""
        try:
            import sys

            dist = sys.modules.get("torch.distributed")
            if dist is not None and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # best effort at teardown
            logger.debug("destroy_process_group failed", exc_info=True)


def _meta(result: Any) -> int | None:
    """The result's batch length for lazy routing; None when it is not one batch."""
    try:
        return batch_len(result)
    except (TypeError, ValueError):  # e.g. a dict whose values differ in length
        return None


def _url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def _seed_everything(seed: int) -> None:
    import sys

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # numpy is a dependency, but stay robust
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


_RemoteGangWorker = ray.remote(concurrency_groups={"control": 2})(GangWorker)


def make_worker(
    info: WorkerInfo,
    pg,
    bundle_index: int,
    *,
    resource_name: str | None,
    amount: float,
    cpus: float,
    namespace: str | None,
):
    """Create the worker actor for ``info`` on ``bundle_index`` of ``pg``.

    The first gang on a group takes the bundle's devices (``amount`` > 0) and
    Ray pins them; later gangs on the same devices ask for 0 and get the same
    devices through ``info.devices``.
    """
    return _RemoteGangWorker.options(
        name=info.name,
        namespace=namespace,
        max_restarts=0,
        max_concurrency=1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle_index
        ),
        **resource_options(resource_name if amount else None, amount, cpus),
    ).remote(info)
