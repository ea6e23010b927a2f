"""The accelerator kinds a group or a process can use: their Ray resource, pin variable and backend.

Pure module (no Ray import). One table, read by :class:`~twinkle_ray.core.group.DeviceGroup`
(which devices a group reserves) and by :class:`~twinkle_ray.core.platform.Platform` (which
accelerator this process uses), so a kind is added in one place.

Example::

    >>> normalize_device_type('CUDA'), ACCELERATORS['gpu'].backend
    ('gpu', 'nccl')
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

__all__ = ['ACCELERATORS', 'DEVICE_TYPE_ALIASES', 'Accelerator', 'normalize_device_type']


class Accelerator(NamedTuple):
    """What the runtime needs to know about one accelerator kind."""

    resource_name: str | None  # Ray resource name; None for CPU-only
    visible_devices_env: str | None  # env variable that pins a process to its devices
    backend: str  # torch.distributed backend


#: kind -> accelerator facts (names as Ray's ``ray._private.accelerators`` spells them).
ACCELERATORS: Mapping[str, Accelerator] = MappingProxyType({
    'gpu': Accelerator('GPU', 'CUDA_VISIBLE_DEVICES', 'nccl'),
    'npu': Accelerator('NPU', 'ASCEND_RT_VISIBLE_DEVICES', 'hccl'),
    'cpu': Accelerator(None, None, 'gloo'),
})

#: accepted ``device_type`` spellings (lower-cased) -> kind.
DEVICE_TYPE_ALIASES: Mapping[str, str] = MappingProxyType({
    'cuda': 'gpu',
    'gpu': 'gpu',
    'npu': 'npu',
    'cpu': 'cpu',
})

def normalize_device_type(device_type: str) -> str:
    """Map a ``device_type`` spelling (any case) to its kind: ``'gpu'``, ``'npu'`` or ``'cpu'``.

    Example::

        >>> normalize_device_type('CUDA'), normalize_device_type('cpu')
        ('gpu', 'cpu')
    """
    if isinstance(device_type, str):
        kind = DEVICE_TYPE_ALIASES.get(device_type.strip().lower())
        if kind is not None:
            return kind
    known = ', '.join(repr(k) for k in DEVICE_TYPE_ALIASES)
    raise ValueError(f'unknown device_type {device_type!r}; known (any case): {known}')
