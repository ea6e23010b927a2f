"""``twinkle_ray.utils.platform``: Twinkle's ``twinkle.utils.platform`` import path.

The same objects as ``twinkle_ray.DeviceMesh``, ``twinkle_ray.Platform``, ... (see
:mod:`twinkle_ray.utils`).

Example::

    from twinkle_ray.utils.platform import DeviceMesh, Platform
"""

from __future__ import annotations

from twinkle_ray.core.group import DeviceGroup
from twinkle_ray.core.mesh import DeviceMesh
from twinkle_ray.core.platform import GPU, NPU, Platform
from twinkle_ray.infra import is_master

__all__ = ["GPU", "NPU", "DeviceGroup", "DeviceMesh", "Platform", "is_master"]
