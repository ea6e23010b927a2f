"""Joining a Ray cluster, or starting a private one on loopback, for ``initialize``.

With an address (or ``RAY_ADDRESS``) the driver attaches to that cluster and
the resource keywords are left to it; without one a private local Ray is
started whose every server listens on 127.0.0.1.

Example::

    started = connect(None, "my-namespace", {"num_cpus": 4})   # True: this call started Ray
"""

from __future__ import annotations

import logging
import os
import sys

from .net import is_loopback

logger = logging.getLogger(__name__)

_RESOURCE_KWARGS = ("num_cpus", "num_gpus", "resources", "object_store_memory", "labels")


def connect(address: str | None, namespace: str | None, kwargs: dict) -> bool:
    """Connect to or start Ray; True if this call started it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        import ray

        dropped = [k for k in _RESOURCE_KWARGS if k in kwargs]
        if dropped:
            logger.info("attaching to Ray at %s: ignoring %s (the cluster declares resources)",
                        address, ", ".join(dropped))
        rest = {k: v for k, v in kwargs.items() if k not in _RESOURCE_KWARGS}
        ray.init(address=address, namespace=namespace, **rest)
        return False
    start_embedded(namespace, kwargs)
    return True


# Ray 2.60 has no public ray.init argument that keeps a local instance on loopback: its node
# address (and so the address every GCS, raylet, worker and agent server binds) is the machine's
# external address on Linux, and ``_node_ip_address='127.0.0.1'`` is private and turned back into
# the external address. What Ray does on macOS and Windows ("local Ray only") is switched on for
# Linux by this environment variable, read once when ``ray`` is imported.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def start_embedded(namespace: str | None, kwargs: dict) -> None:
    """Start a private local Ray whose every server listens on 127.0.0.1, whatever was imported first.

    ``address='local'`` starts a new instance whatever ``/tmp/ray/ray_current_cluster`` names
    (a stopped ``ray start`` cluster leaves it behind). ``LOOPBACK_ENV=0`` is set while Ray is
    started (the processes it starts inherit it and read it themselves), unless the caller set it.

    Ray reads ``LOOPBACK_ENV`` into a module constant when ``ray`` is first imported; a script that
    imported ray (or anything importing it) before ``initialize()`` has that constant fixed already.
    Ray has no public means to change it afterwards, nor a public ``ray.init`` argument for the node
    address (``_node_ip_address='127.0.0.1'`` is private *and* turned back into the external
    address), so, only in that case and only while ``ray.init`` runs, the constant Ray itself reads
    (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``, a private Ray attribute -- no Ray function
    is replaced) is set as the environment variable would have set it, then restored.
    """
    saved = os.environ.get(LOOPBACK_ENV)
    if saved is None:
        os.environ[LOOPBACK_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")  # imported before us: already read
    flipped = saved is None and constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False)
    try:
        import ray

        if flipped:
            constants.ENABLE_RAY_CLUSTER = False  # private Ray attribute: see the docstring
        node_ip = ray.util.get_node_ip_address()
        if not is_loopback(node_ip):
            logger.warning("twinkle_ray: the embedded Ray will listen on %s, not only on 127.0.0.1 (%s=%s)",
                           node_ip, LOOPBACK_ENV, os.environ.get(LOOPBACK_ENV))
        kwargs.setdefault("dashboard_host", "127.0.0.1")
        kwargs.setdefault("log_to_driver", True)
        ray.init(address="local", namespace=namespace, **kwargs)
    finally:
        if flipped:
            constants.ENABLE_RAY_CLUSTER = True
        if saved is None:
            os.environ.pop(LOOPBACK_ENV, None)
