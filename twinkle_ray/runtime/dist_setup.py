"""How a gang worker joins torch.distributed: the backend it can run, NCCL's error handling,
the rendezvous store of a one-node gang (on loopback), and the gang's seed.

Pure helpers the worker actor (:mod:`~twinkle_ray.runtime.worker`) calls before
``init_process_group``; torch is imported only inside them.

Example::

    os.environ.update(nccl_env(120))                 # before any NCCL communicator exists
    backend = usable_backend("nccl")                 # 'gloo' where CUDA is not usable
    store = loopback_store(rank, world_size, port, 120)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta

import ray

from .net import is_loopback, loopback_listener


def usable_backend(backend: str) -> str:
    """The group's backend if this process can run it, else ``gloo``: ``nccl`` needs a
    usable CUDA device (virtual GPUs have none), ``hccl`` needs ``torch_npu``.

    >>> usable_backend("gloo")
    'gloo'
    """
    if backend == "nccl":
        import torch

        return backend if torch.cuda.is_available() else "gloo"
    if backend == "hccl":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return "gloo"
    return backend


def nccl_env(timeout_s: float) -> dict[str, str]:
    """Environment for torch's NCCL error handling and watchdog in a CUDA gang.

    A collective that cannot complete (a peer died or raised before joining)
    then errors after ``timeout_s`` and the communicator is aborted, instead of
    hanging forever. Set before the process group is created; a user's own
    setting of any of these wins.

    >>> env = nccl_env(120)
    >>> env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]
    ('1', '240')
    """
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # abort the communicator and raise on errors/timeouts
        "TORCH_NCCL_ENABLE_MONITORING": "1",  # the watchdog's heartbeat monitor
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(max(60, 2 * timeout_s))),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    }


def url_host(addr: str) -> str:
    """``addr`` as the host of a URL (an IPv6 address in brackets).

    >>> url_host("::1"), url_host("10.0.0.2")
    ('[::1]', '10.0.0.2')
    """
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def seed_everything(seed: int) -> None:
    """Seed ``random``, numpy and (when imported) torch: the gang's ``seed`` on every rank."""
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


def loopback_store(rank: int, world_size: int, port: int, timeout_s: float):
    """The rendezvous TCPStore of a one-node gang, listening on 127.0.0.1 only.

    torch's TCPStore server binds every interface for a host name; rank 0
    binds the port on loopback itself and hands the socket over
    (``master_listen_fd``). On a loopback-only Ray (the embedded default),
    gloo's pairs go on the loopback interface too (``GLOO_SOCKET_IFNAME``,
    unless set); on a cluster's node gloo keeps its default, as a weight sync
    with another node's gang needs it.
    """
    import torch.distributed as dist

    if is_loopback(ray.util.get_node_ip_address()):
        names = {name for _, name in socket.if_nameindex()}
        lo = next((n for n in ("lo", "lo0") if n in names), None)  # Linux, macOS
        if lo is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    common = dict(host_name="127.0.0.1", port=port, world_size=world_size,
                  timeout=timedelta(seconds=timeout_s))
    if rank != 0:
        return dist.TCPStore(is_master=False, **common)
    listener = loopback_listener("127.0.0.1", port, world_size)
    store = dist.TCPStore(is_master=True, master_listen_fd=listener.fileno(), **common)
    listener.detach()  # the store owns the socket now
    return store
