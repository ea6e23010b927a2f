"""``twinkle_ray.utils``: Twinkle's ``twinkle.utils`` import path for the names it shares.

Scripts and tests written for Twinkle import some names from there
(``from twinkle.utils.platform import DeviceMesh, Platform``); with
``import twinkle_ray as twinkle`` aliased, these resolve to the same objects as
``twinkle_ray.<name>``. Imports are absolute (see :mod:`twinkle_ray.infra`).

Example::

    from twinkle_ray.utils import DeviceMesh, Platform
"""

from __future__ import annotations

from twinkle_ray.core.group import DeviceGroup
from twinkle_ray.core.logs import get_logger
from twinkle_ray.core.mesh import DeviceMesh
from twinkle_ray.core.platform import GPU, NPU, Platform
from twinkle_ray.runtime.net import find_free_port, find_node_ip

__all__ = [
    "GPU",
    "NPU",
    "DeviceGroup",
    "DeviceMesh",
    "Platform",
    "find_free_port",
    "find_node_ip",
    "get_logger",
]
