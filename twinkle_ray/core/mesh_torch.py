"""The bridge to torch: the ``torch.distributed.device_mesh.DeviceMesh`` a
:class:`~twinkle_ray.core.mesh.DeviceMesh` stands for, built with torch's own machinery.

Pure at import: torch is imported inside :func:`build_torch_mesh`, which runs only in a
process whose torch.distributed world is up (a gang worker), so ``import twinkle_ray.core``
stays free of torch.

Example (inside an initialised 8-rank world)::

    >>> tm = build_torch_mesh(DeviceMesh.from_sizes(pp_size=4, tp_size=2), "cpu")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .mesh import DeviceMesh

__all__ = ["build_torch_mesh", "torch_device_type"]


def torch_device_type(device_type: str) -> str:
    """torch's name for a device type: ``'gpu'`` is ``'cuda'``, the rest lower-cased."""
    kind = device_type.lower()
    return "cuda" if kind == "gpu" else kind


def build_torch_mesh(mesh: DeviceMesh, device_type: str | None = None) -> Any:
    """:meth:`DeviceMesh.to_torch <twinkle_ray.core.mesh.DeviceMesh.to_torch>`: collective, on
    every rank of the torch.distributed world; ``RuntimeError`` when that world is not up or
    is smaller than the mesh."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "DeviceMesh.to_torch() needs an initialised torch.distributed world "
            "(torch.distributed.init_process_group, or a twinkle_ray worker); it is not"
        )
    world = dist.get_world_size()
    if int(mesh.mesh.max()) >= world:
        raise RuntimeError(
            f"mesh uses rank {int(mesh.mesh.max())} but the torch.distributed world "
            f"has only {world} ranks"
        )
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.device_mesh import init_device_mesh

    kind = torch_device_type(device_type or mesh.device_type)
    if kind == "cuda" and not torch.cuda.is_available():
        kind = "cpu"
    if np.array_equal(mesh.mesh.ravel(), np.arange(mesh.mesh.size)):
        torch_mesh = init_device_mesh(kind, mesh.shape, mesh_dim_names=mesh.mesh_dim_names)
    else:
        torch_mesh = TorchDeviceMesh(
            kind, torch.as_tensor(mesh.mesh), mesh_dim_names=mesh.mesh_dim_names
        )
    for name, dims in mesh.flattened.items():
        torch_mesh[dims]._flatten(name)
    return torch_mesh
