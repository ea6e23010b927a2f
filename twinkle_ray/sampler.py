"""``twinkle_ray.sampler``: the documented import path of the pure sampler.

The code lives in :mod:`twinkle_ray.core.sampler` (the pure layer); this module
re-exports its public names so ``from twinkle_ray.sampler import ...`` keeps working.

Example::

    from twinkle_ray.sampler import DeviceMeshSampler
    sampler = DeviceMeshSampler(8, batch_size=4, data_world_size=2)
"""

from .core.sampler import *  # noqa: F403  (its __all__, kept in one place)
from .core.sampler import __all__  # noqa: F401
