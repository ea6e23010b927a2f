"""twinkle_ray: Ray-native actor framework for multi-group distributed ML.

The API of ModelScope Twinkle's infra, re-built on Ray: a script written for
Twinkle runs with ``import twinkle_ray as twinkle``. The names of Twinkle's
``twinkle`` and ``twinkle.infra`` modules are here and in :mod:`twinkle_ray.infra`;
docs/twinkle.md lists each one and any difference. The layers: the pure
:mod:`twinkle_ray.core` (mesh, dispatch, groups, Platform), :mod:`twinkle_ray.runtime`
(Ray), and the integrations (``data``, ``weights``, ``serve``, ``cli``).

Example::

    import twinkle_ray as twinkle
    from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function

    @remote_class()
    class Worker:
        def __init__(self, device_mesh=None):
            self.mesh = device_mesh

        @remote_function(dispatch="slice_dp", collect="flatten")
        def double(self, xs):
            return [2 * x for x in xs]

    twinkle.initialize("ray", groups=[DeviceGroup("g", 2, "cpu")])
    w = Worker(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="g")
    assert w.double([1, 2, 3])() == [2, 4, 6]
    twinkle.shutdown()
"""

from . import infra
from .core.balance import Completed
from .core.context import get_rank, get_world_size
from .core.functions import remote_function
from .core.group import DeviceGroup
from .core.logs import get_logger
from .core.mesh import DeviceMesh
from .core.platform import GPU, NPU, Platform
from .infra import is_master
from .runtime.errors import (
    CallTimeoutError,
    GangClosedError,
    GangRestartedError,
    GangStuckError,
    PlacementError,
    TurnError,
    WorkerDiedError,
)
from .runtime.net import find_free_port, find_node_ip
from .runtime.remote import remote_class
from .runtime.session import get, get_device_placement, initialize, shutdown
from .runtime.together import start_together

__version__ = "0.1.0"


def __getattr__(name: str):
    # LazyResult is loaded on first use, like Twinkle's lazily loaded names; the pure
    # modules (``import twinkle_ray.core.mesh``) never need it.
    if name == "LazyResult":
        from .runtime.lazy import LazyResult

        return LazyResult
    raise AttributeError(f"module 'twinkle_ray' has no attribute {name!r}")

__all__ = [
    "GPU",
    "NPU",
    "CallTimeoutError",
    "Completed",
    "DeviceGroup",
    "DeviceMesh",
    "GangClosedError",
    "GangRestartedError",
    "GangStuckError",
    "LazyResult",
    "Platform",
    "PlacementError",
    "TurnError",
    "WorkerDiedError",
    "find_free_port",
    "find_node_ip",
    "get",
    "get_device_placement",
    "get_logger",
    "get_rank",
    "get_world_size",
    "infra",
    "initialize",
    "is_master",
    "remote_class",
    "remote_function",
    "shutdown",
    "start_together",
]
