"""Where the current process stands in its gang: its rank and the gang's size.

``get_rank()`` and ``get_world_size()`` are the public names (``twinkle_ray.get_rank``);
both delegate to :class:`~twinkle_ray.core.platform.Platform` at call time, the one place
that reads the rank: inside a gang worker the ``RANK`` / ``WORLD_SIZE`` the runtime
gave it (an engine in the worker may run a torch.distributed world of its own),
elsewhere ``torch.distributed`` when it is initialised, then those environment
variables, and a single-process world (rank 0 of 1) on a driver. Patching ``Platform.get_rank`` changes
what these return too.

This module never imports torch: it only looks at ``torch.distributed`` when
something else has already imported it.
"""

from __future__ import annotations

from .platform import Platform

__all__ = ["get_rank", "get_world_size"]


def get_rank() -> int:
    """Rank of this process in its gang (``Platform.get_rank()``).

    Order of precedence: the gang's ``RANK`` inside a gang worker (an engine in
    the worker may run its own torch.distributed world), else
    ``torch.distributed.get_rank()`` when it is initialised, else the ``RANK``
    environment variable, else ``0``.

    Example::

        >>> import os
        >>> os.environ["RANK"] = "3"
        >>> get_rank()
        3
        >>> del os.environ["RANK"]
        >>> get_rank()  # a driver outside any gang
        0
    """
    return Platform.get_rank()


def get_world_size() -> int:
    """Number of processes in this process's gang (``Platform.get_world_size()``).

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
    return Platform.get_world_size()
