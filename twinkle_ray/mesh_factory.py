"""``twinkle_ray.mesh_factory``: the documented import path of the mesh factories.

The code lives in :mod:`twinkle_ray.core.mesh_factory` (the pure layer); this
module re-exports its public names so ``from twinkle_ray.mesh_factory import ...``
keeps working.

Example::

    from twinkle_ray.mesh_factory import create_fsdp2_mesh
    mesh = create_fsdp2_mesh(world_size=8, tp_size=2)
"""

from .core.mesh_factory import *  # noqa: F403  (its __all__, kept in one place)
from .core.mesh_factory import __all__  # noqa: F401
