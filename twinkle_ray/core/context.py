"""Where the current process stands in its gang: its rank and the gang's size.

Both helpers prefer ``torch.distributed`` when it is initialised, then the
``RANK`` / ``WORLD_SIZE`` environment variables that every twinkle_ray worker
receives, and fall back to a single-process world (rank 0 of 1) on a driver.

This module never imports torch: it only looks at ``torch.distributed`` when
something else has already imported it.
"""

from __future__ import annotations

import os
import sys

__all__ = ["get_rank", "get_world_size"]


def _initialised_dist():
    """Return ``torch.distributed`` if it is imported and initialised, else ``None``."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return dist
    except (AttributeError, RuntimeError):
        return None
    return None


def _int_from_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def get_rank() -> int:
    """Rank of this process in its gang.

    Order of precedence: ``torch.distributed.get_rank()`` when torch.distributed
    is initialised, else the ``RANK`` environment variable, else ``0``.

    Example::

        >>> import os
        >>> os.environ["RANK"] = "3"
        >>> get_rank()
        3
        >>> del os.environ["RANK"]
        >>> get_rank()  # a driver outside any gang
        0
    """
    dist = _initialised_dist()
    if dist is not None:
        return int(dist.get_rank())
    return _int_from_env("RANK", 0)


def get_world_size() -> int:
    """Number of processes in this process's gang.

    Order of precedence: ``torch.distributed.get_world_size()`` when
    torch.distributed is initialised, else the ``WORLD_SIZE`` environment
    variable, else ``1``.

    Example::

        >>> import os
        >>> os.environ["WORLD_SIZE"] = "8"
        >>> get_world_size()
        8
        >>> del os.environ["WORLD_SIZE"]
        >>> get_world_size()
        1
    """
    dist = _initialised_dist()
    if dist is not None:
        return int(dist.get_world_size())
    return _int_from_env("WORLD_SIZE", 1)
