"""twinkle_ray: Ray-native actor framework for multi-group distributed ML.

The API of ModelScope Twinkle's infra, re-built on Ray: a script written for
Twinkle runs with ``import twinkle_ray as twinkle``.

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

from .core.context import get_rank, get_world_size
from .core.functions import remote_function
from .core.group import DeviceGroup
from .core.mesh import DeviceMesh
from .runtime.errors import CallTimeoutError, GangStuckError, PlacementError, WorkerDiedError
from .runtime.remote import remote_class
from .runtime.session import get, get_device_placement, initialize, shutdown

__version__ = "0.1.0"


def __getattr__(name: str):
    # LazyResult needs Ray; importing it lazily keeps ``import twinkle_ray.mesh`` (and the
    # other pure modules) free of Ray for code that only wants the mesh maths.
    if name == "LazyResult":
        from .runtime.lazy import LazyResult

        return LazyResult
    raise AttributeError(f"module 'twinkle_ray' has no attribute {name!r}")

__all__ = [
    "CallTimeoutError",
    "GangStuckError",
    "DeviceGroup",
    "DeviceMesh",
    "LazyResult",
    "PlacementError",
    "WorkerDiedError",
    "get",
    "get_device_placement",
    "get_rank",
    "get_world_size",
    "initialize",
    "remote_class",
    "remote_function",
    "shutdown",
]
