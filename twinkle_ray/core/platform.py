"""Platform: where this process stands (rank, world size, node) and which accelerator it uses.

Twinkle's name for these questions. Everything in twinkle_ray that needs "my rank"
asks :meth:`Platform.get_rank` when it needs it (a DeviceMesh asks
:meth:`Platform.get_mesh_rank`, which differs only in a worker that owns several
devices), so a test can pretend to be any rank of a mesh with
``unittest.mock.patch.object(Platform, 'get_rank', return_value=r)``.

Ranks come from ``torch.distributed`` when it is initialised, else from the
environment every twinkle_ray worker receives (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``), else a single-process world
(rank 0 of 1; Twinkle answers -1 there, see docs/twinkle.md). This module never
imports torch: it only looks at ``torch.distributed`` when something else imported it.

The device-type helpers (``visible_device_env``, ``device_prefix``,
``device_backend``, ``get_local_device``) answer for the platform named by their
``platform`` argument (``'gpu'``/``'cuda'``, ``'npu'``, ``'cpu'``, any case), for
the subclass they are called on (:class:`GPU`, :class:`NPU`), or for the platform
detected on this machine (``npu-smi`` on the PATH means NPU, else GPU, as Twinkle).

Example::

    >>> from unittest.mock import patch
    >>> from twinkle_ray.core.mesh import DeviceMesh
    >>> mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    >>> with patch.object(Platform, "get_rank", return_value=3):
    ...     mesh.dp_rank, mesh.tp_rank
    (1, 1)
    >>> GPU.visible_device_env(), NPU.device_backend(), Platform.get_local_device(1, platform="cuda")
    ('CUDA_VISIBLE_DEVICES', 'hccl', 'cuda:1')
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import ClassVar

from .accelerators import ACCELERATORS, normalize_device_type

__all__ = ["CPU", "GPU", "NPU", "Platform", "is_master"]

#: kind -> torch device prefix.
_DEVICE_PREFIX = {"gpu": "cuda", "npu": "npu", "cpu": "cpu"}


def _initialised_dist():
    """``torch.distributed`` if it is imported and initialised, else ``None``."""
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


def _in_gang_worker() -> bool:
    """Whether this process is a twinkle_ray gang worker (its runtime set the gang's env)."""
    return bool(os.environ.get("TWINKLE_WORKER")) and "RANK" in os.environ


class Platform:
    """Rank and device questions about the current process (all methods are class-level).

    Subclasses :class:`GPU` and :class:`NPU` answer the device-type questions for
    their own accelerator; the rank questions are the same for all.
    """

    #: The accelerator kind a subclass stands for; None on :class:`Platform` (detected).
    kind: ClassVar[str | None] = None

    # ----------------------------------------------------------------- ranks
    @staticmethod
    def get_rank() -> int:
        """Global rank of this process in its gang.

        Inside a twinkle_ray gang worker, the gang's ``RANK`` (set by the runtime):
        an engine inside the worker may run a torch.distributed world of its own
        (an in-process vLLM engine is rank 0 of 1 in every sampler worker).
        Elsewhere ``torch.distributed.get_rank()`` when it is initialised, else
        the ``RANK`` environment variable, else ``0``.

        Example::

            >>> import os
            >>> os.environ["RANK"] = "3"
            >>> Platform.get_rank()
            3
            >>> del os.environ["RANK"]
            >>> Platform.get_rank()  # a driver outside any gang
            0
        """
        if _in_gang_worker():
            return _int_from_env("RANK", 0)
        dist = _initialised_dist()
        if dist is not None:
            return int(dist.get_rank())
        return _int_from_env("RANK", 0)

    @staticmethod
    def get_mesh_rank(mesh_world_size: int | None = None) -> int:
        """The rank a device mesh of ``mesh_world_size`` ranks sees as this process's.

        A gang worker that owns several devices (``gpus_per_worker`` g > 1, e.g. a
        vLLM engine with TP=2) is gang rank ``i`` but covers mesh ranks
        ``i*g ... i*g + g-1``; the dispatcher routes it as the first, ``i*g``
        (``dispatch.worker_global_rank``), and so does its own mesh when the mesh
        spans the gang's devices (``mesh_world_size`` is the gang's world size
        times g, or not given). Anywhere else, :meth:`get_rank`.

        Example::

            >>> import os
            >>> env = {"TWINKLE_WORKER": "sampler/VLLM/1", "RANK": "1", "WORLD_SIZE": "2",
            ...        "TWINKLE_GPUS_PER_WORKER": "2"}
            >>> os.environ.update(env)
            >>> Platform.get_rank(), Platform.get_mesh_rank(4), Platform.get_mesh_rank(2)
            (1, 2, 1)
            >>> for k in env: del os.environ[k]
        """
        rank = Platform.get_rank()
        if _in_gang_worker():
            per = _int_from_env("TWINKLE_GPUS_PER_WORKER", 1)
            spans = mesh_world_size is None or mesh_world_size == Platform.get_world_size() * per
            if per > 1 and spans:
                return rank * per
        return rank

    @staticmethod
    def get_world_size() -> int:
        """Number of processes in this process's gang.

        The gang's ``WORLD_SIZE`` inside a gang worker (see :meth:`get_rank`);
        elsewhere ``torch.distributed.get_world_size()`` when initialised, else
        ``WORLD_SIZE``, else ``1``.
        """
        if _in_gang_worker():
            return _int_from_env("WORLD_SIZE", 1)
        dist = _initialised_dist()
        if dist is not None:
            return int(dist.get_world_size())
        return _int_from_env("WORLD_SIZE", 1)

    @staticmethod
    def get_local_rank() -> int:
        """Rank of this process among its gang's processes on this node (``LOCAL_RANK``, else 0)."""
        return _int_from_env("LOCAL_RANK", 0)

    @staticmethod
    def get_local_world_size() -> int:
        """Number of this gang's processes on this node (``LOCAL_WORLD_SIZE``, else 1)."""
        return _int_from_env("LOCAL_WORLD_SIZE", 1)

    @staticmethod
    def get_node_rank() -> int:
        """Index of this node among the gang's nodes (``NODE_RANK``, else 0)."""
        return _int_from_env("NODE_RANK", 0)

    @staticmethod
    def is_master() -> bool:
        """Whether this process is rank 0 of its gang (a driver is).

        Example::

            >>> Platform.is_master()
            True
        """
        return Platform.get_rank() == 0

    @staticmethod
    def is_local_master() -> bool:
        """Whether this process is local rank 0 on its node (a driver is)."""
        return Platform.get_local_rank() == 0

    @staticmethod
    def is_last_rank() -> bool:
        """Whether this process is the last rank of its gang (a driver is)."""
        return Platform.get_rank() == Platform.get_world_size() - 1

    # ----------------------------------------------------------- devices
    @staticmethod
    def get_platform_names() -> list[str]:
        """Names :meth:`get_platform` accepts (any case; ``'CUDA'`` means GPU).

        Example::

            >>> Platform.get_platform_names()
            ['GPU', 'NPU', 'CPU']
        """
        return ["GPU", "NPU", "CPU"]

    @classmethod
    def get_platform(cls, platform: str | None = None) -> type[Platform]:
        """The Platform class for ``platform``; without one, the subclass called on or the
        platform detected on this machine (``npu-smi`` on the PATH: NPU, else GPU).

        Raises ``ValueError`` for an unknown name.

        Example::

            >>> Platform.get_platform("cuda") is GPU, NPU.get_platform() is NPU
            (True, True)
        """
        if platform is None:
            if cls.kind is not None:
                return cls
            return NPU if shutil.which("npu-smi") else GPU
        try:
            kind = normalize_device_type(platform)
        except ValueError:
            raise ValueError(
                f"unsupported platform {platform!r}; known: "
                f"{', '.join(Platform.get_platform_names())} (any case) or 'cuda'"
            ) from None
        return _BY_KIND[kind]

    @classmethod
    def visible_device_env(cls, platform: str | None = None) -> str | None:
        """The environment variable that pins a process to its devices (None for CPU)."""
        return ACCELERATORS[cls.get_platform(platform).kind].visible_devices_env

    @classmethod
    def device_prefix(cls, platform: str | None = None) -> str:
        """torch's device type: ``'cuda'``, ``'npu'`` or ``'cpu'``."""
        return _DEVICE_PREFIX[cls.get_platform(platform).kind]

    @classmethod
    def device_backend(cls, platform: str | None = None) -> str:
        """torch.distributed backend for the platform: ``'nccl'``, ``'hccl'`` or ``'gloo'``."""
        return ACCELERATORS[cls.get_platform(platform).kind].backend

    @classmethod
    def get_local_device(cls, idx: int | None = None, *, platform: str | None = None) -> str:
        """torch device string of local device ``idx``.

        Default: index 0 inside a twinkle_ray gang worker (it sees exactly its own
        devices, so its first one is index 0), else this process's local rank (a
        torchrun-style process that sees every device of its node).

        Example::

            >>> GPU.get_local_device(2), Platform.get_local_device(0, platform="cpu")
            ('cuda:2', 'cpu')
        """
        target = cls.get_platform(platform)
        if target.kind == "cpu":
            return "cpu"
        if idx is None:
            idx = 0 if _in_gang_worker() else Platform.get_local_rank()
        return f"{_DEVICE_PREFIX[target.kind]}:{max(int(idx), 0)}"


class GPU(Platform):
    """NVIDIA GPUs: ``CUDA_VISIBLE_DEVICES``, device prefix ``'cuda'``, backend ``'nccl'``."""

    kind = "gpu"


class NPU(Platform):
    """Ascend NPUs: ``ASCEND_RT_VISIBLE_DEVICES``, device prefix ``'npu'``, backend ``'hccl'``."""

    kind = "npu"


class CPU(Platform):
    """CPU only: no visible-device variable, device ``'cpu'``, backend ``'gloo'``."""

    kind = "cpu"


_BY_KIND: dict[str, type[Platform]] = {"gpu": GPU, "npu": NPU, "cpu": CPU}


def is_master() -> bool:
    """Whether this process is rank 0 of its gang (``Platform.is_master()``; a driver is).

    Inside a worker it is the gang rank (``RANK``, or torch.distributed's rank);
    Twinkle counts a process without a rank (-1 there) as master too.

    Example::

        >>> is_master()
        True
    """
    return Platform.is_master()
