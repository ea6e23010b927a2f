"""NeMo-Automodel-style mesh factories that return pure :class:`DeviceMesh` objects.

Three layouts, with NeMo's names, sizes, checks and error messages, but no
process group: the results are numpy meshes that pickle across Ray, and
``mesh.to_torch()`` turns them into torch meshes inside a worker.

- FSDP2 / HSDP: ``(pp, dp_replicate, dp_shard, cp, tp)`` with the flattened
  dims ``dp`` (dp_replicate, dp_shard), ``dp_shard_cp`` (dp_shard, cp) and
  ``dp_cp`` (dp_replicate, dp_shard, cp).
- MegatronFSDP: ``(dp, cp, tp)``, with ``dp_cp`` flattened only when cp > 1.
- MoE: ``(ep_shard, ep)`` over the non-pipeline ranks of a stage.

The data rank of these meshes is the flattened ``dp`` index, so
``get_slice`` and ``get_collect_ranks`` work on them as on any mesh.

Example::

    >>> mesh = create_fsdp2_mesh(world_size=8, tp_size=2, dp_replicate_size=2)
    >>> mesh.shape, mesh.get_dim_size("dp")
    ((1, 2, 2, 1, 2), 4)
    >>> mesh.get_group_ranks("dp", rank=5), mesh.get_data_rank_from_global_rank(5)
    ([1, 3, 5, 7], 2)
"""

from __future__ import annotations

import math

import numpy as np

from .mesh import DeviceMesh

__all__ = [
    "FSDP2_DIMS",
    "MEGATRON_FSDP_DIMS",
    "MOE_DIMS",
    "create_device_mesh",
    "create_fsdp2_mesh",
    "create_megatron_fsdp_mesh",
    "create_moe_mesh",
]

FSDP2_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
MEGATRON_FSDP_DIMS: tuple[str, ...] = ("dp", "cp", "tp")
MOE_DIMS: tuple[str, ...] = ("ep_shard", "ep")
STRATEGIES: tuple[str, ...] = ("fsdp2", "megatron_fsdp", "ddp")


def _degree(name: str, value: int | None) -> int:
    """A parallel degree: ``None`` means 1; anything else must be a positive int."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _infer_dp_size(dp_size: int | None, world_size: int, factors: dict[str, int]) -> int:
    """dp as given, or ``world_size / prod(factors)`` when ``None`` or <= 0 (NeMo's rule)."""
    if dp_size is not None and dp_size > 0:
        return _degree("dp_size", dp_size)
    non_dp = math.prod(factors.values())
    if world_size % non_dp:
        names = " * ".join(f"{n}_size" for n in factors)
        values = " * ".join(str(v) for v in factors.values())
        raise ValueError(
            f"world_size ({world_size}) must be divisible by ({names}) ({values} = {non_dp})"
        )
    return world_size // non_dp


def _check_fits(world_size: int, shape: tuple[int, ...], dims: tuple[str, ...]) -> int:
    total = math.prod(shape)
    if total > world_size:
        sizes = " * ".join(f"{d}={s}" for d, s in zip(dims, shape, strict=True))
        raise ValueError(
            f"the mesh ({sizes} = {total} ranks) is bigger than world_size ({world_size})"
        )
    return total


def create_fsdp2_mesh(
    *,
    world_size: int,
    dp_size: int | None = None,
    dp_replicate_size: int | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    device_type: str = "cuda",
) -> DeviceMesh:
    """FSDP2 / HSDP mesh ``(pp, dp_replicate, dp_shard, cp, tp)``.

    ``dp_size`` None or <= 0 is inferred as ``world_size / (tp * cp * pp)``;
    ``dp_replicate_size`` None or <= 0 means 1 and must divide dp, with
    ``dp_shard = dp / dp_replicate``. An explicit ``dp_size`` is taken as
    given (as NeMo does); a mesh smaller than the world covers ranks
    ``0..N-1`` only, and one bigger than the world is a ``ValueError``.

    Example::

        >>> m = create_fsdp2_mesh(world_size=8, cp_size=2, tp_size=2)
        >>> m.shape, m.get_group_ranks("dp_shard_cp", rank=3), m.get_group_ranks("dp", rank=3)
        ((1, 1, 2, 2, 2), [1, 3, 5, 7], [3, 7])
        >>> create_fsdp2_mesh(world_size=8, tp_size=3)
        Traceback (most recent call last):
        ...
        ValueError: world_size (8) must be divisible by (tp_size * cp_size * pp_size) (3 * 1 * 1 = 3)
    """
    world_size = _degree("world_size", world_size)
    tp, cp, pp = (
        _degree("tp_size", tp_size),
        _degree("cp_size", cp_size),
        _degree("pp_size", pp_size),
    )
    dp = _infer_dp_size(dp_size, world_size, {"tp": tp, "cp": cp, "pp": pp})
    replicate = dp_replicate_size if dp_replicate_size is not None and dp_replicate_size > 0 else 1
    replicate = _degree("dp_replicate_size", replicate)
    if dp % replicate:
        raise ValueError(
            f"dp_size must be a multiple of dp_replicate_size "
            f"(dp_size={dp}, dp_replicate_size={replicate})"
        )
    if replicate > 1 and replicate >= dp:
        raise ValueError(
            f"dp_replicate_size={replicate} must be less than dp_size={dp} "
            f"since DDP usecase is not supported by FSDP2"
        )
    shape = (pp, replicate, dp // replicate, cp, tp)
    total = _check_fits(world_size, shape, FSDP2_DIMS)
    return DeviceMesh(
        mesh=np.arange(total).reshape(shape),
        mesh_dim_names=FSDP2_DIMS,
        device_type=device_type,
        flattened={
            "dp": ("dp_replicate", "dp_shard"),
            "dp_shard_cp": ("dp_shard", "cp"),
            "dp_cp": ("dp_replicate", "dp_shard", "cp"),
        },
    )


def create_megatron_fsdp_mesh(
    *,
    world_size: int,
    dp_size: int | None = None,
    tp_size: int = 1,
    cp_size: int = 1,
    device_type: str = "cuda",
) -> DeviceMesh:
    """MegatronFSDP mesh ``(dp, cp, tp)``; ``dp_cp`` is flattened only when cp > 1.

    ``dp_size`` None or <= 0 is inferred as ``world_size / (tp * cp)``.

    Example::

        >>> m = create_megatron_fsdp_mesh(world_size=8, tp_size=2, cp_size=2)
        >>> m.shape, m.get_group_ranks("dp_cp", rank=0)
        ((2, 2, 2), [0, 2, 4, 6])
        >>> create_megatron_fsdp_mesh(world_size=8, tp_size=2).flattened
        {}
    """
    world_size = _degree("world_size", world_size)
    tp, cp = _degree("tp_size", tp_size), _degree("cp_size", cp_size)
    dp = _infer_dp_size(dp_size, world_size, {"tp": tp, "cp": cp})
    shape = (dp, cp, tp)
    total = _check_fits(world_size, shape, MEGATRON_FSDP_DIMS)
    return DeviceMesh(
        mesh=np.arange(total).reshape(shape),
        mesh_dim_names=MEGATRON_FSDP_DIMS,
        device_type=device_type,
        flattened={"dp_cp": ("dp", "cp")} if cp > 1 else {},
    )


def create_moe_mesh(
    *,
    world_size: int,
    ep_size: int,
    dp_size: int | None = None,
    dp_replicate_size: int | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    device_type: str = "cuda",
    stage: int | None = None,
) -> DeviceMesh:
    """Expert-parallel mesh ``(ep_shard, ep)`` beside the FSDP2 mesh of the same sizes.

    The non-pipeline ranks of a stage (``dp * cp * tp`` of them, in FSDP2
    order) are laid out as ``(ep_shard, ep)`` with ``ep_shard = dp*cp*tp / ep``,
    as NeMo does at HEAD. With one pipeline stage that is the whole mesh. With
    several, ``stage=s`` gives stage ``s``'s 2-D mesh (NeMo's per-rank view),
    and ``stage=None`` gives all stages at once as ``(pp, ep_shard, ep)``, the
    same groups in one object every rank of a gang can share.

    Example::

        >>> create_moe_mesh(world_size=8, ep_size=4).mesh.tolist()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> create_moe_mesh(world_size=8, pp_size=2, ep_size=2, stage=1).mesh.tolist()
        [[4, 5], [6, 7]]
        >>> create_moe_mesh(world_size=8, ep_size=3)
        Traceback (most recent call last):
        ...
        ValueError: non_pp_size=8 must be a multiple of ep_size=3
    """
    ep = _degree("ep_size", ep_size)
    main = create_fsdp2_mesh(
        world_size=world_size,
        dp_size=dp_size,
        dp_replicate_size=dp_replicate_size,
        tp_size=tp_size,
        pp_size=pp_size,
        cp_size=cp_size,
        device_type=device_type,
    )
    pp = main.shape[0]
    non_pp = main.world_size // pp
    if non_pp % ep:
        raise ValueError(f"non_pp_size={non_pp} must be a multiple of ep_size={ep}")
    stages = main.mesh.reshape(pp, non_pp // ep, ep)
    if stage is not None:
        if (
            isinstance(stage, bool)
            or not isinstance(stage, (int, np.integer))
            or not 0 <= stage < pp
        ):
            raise ValueError(f"stage {stage!r} is out of range for pp_size={pp}")
        return DeviceMesh(mesh=stages[stage], mesh_dim_names=MOE_DIMS, device_type=device_type)
    if pp == 1:
        return DeviceMesh(mesh=stages[0], mesh_dim_names=MOE_DIMS, device_type=device_type)
    return DeviceMesh(mesh=stages, mesh_dim_names=("pp", *MOE_DIMS), device_type=device_type)


def create_device_mesh(
    strategy: str,
    *,
    world_size: int,
    dp_size: int | None = None,
    dp_replicate_size: int | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    device_type: str = "cuda",
) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """``(device_mesh, moe_mesh)`` for a strategy, like NeMo's ``create_device_mesh``.

    ``strategy`` is ``'fsdp2'`` (moe_mesh when ep_size > 1, else None),
    ``'megatron_fsdp'`` (no pp, ep or dp_replicate; moe_mesh None) or
    ``'ddp'`` (no tp; returns ``(None, None)``: DDP uses no mesh).

    Example::

        >>> mesh, moe = create_device_mesh("fsdp2", world_size=8, tp_size=2, ep_size=4)
        >>> mesh.shape, moe.shape
        ((1, 1, 4, 1, 2), (2, 4))
        >>> create_device_mesh("ddp", world_size=8)
        (None, None)
    """
    kind = strategy.lower() if isinstance(strategy, str) else strategy
    if kind not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if kind != "fsdp2" and dp_replicate_size is not None and dp_replicate_size > 1:
        raise ValueError(
            f"dp_replicate_size is only supported with FSDP2Config "
            f"(strategy={kind!r}, dp_replicate_size={dp_replicate_size})"
        )
    if kind == "ddp":
        if tp_size is not None and tp_size > 1:
            raise ValueError(f"ddp does not support tensor parallelism (tp_size={tp_size})")
        return None, None
    if kind == "megatron_fsdp":
        if (pp_size or 1) > 1 or (ep_size or 1) > 1:
            raise ValueError(
                f"megatron_fsdp does not support pipeline/expert parallelism "
                f"(pp_size={pp_size}, ep_size={ep_size})"
            )
        mesh = create_megatron_fsdp_mesh(
            world_size=world_size,
            dp_size=dp_size,
            tp_size=tp_size,
            cp_size=cp_size,
            device_type=device_type,
        )
        return mesh, None
    sizes = dict(
        world_size=world_size,
        dp_size=dp_size,
        dp_replicate_size=dp_replicate_size,
        tp_size=tp_size,
        pp_size=pp_size,
        cp_size=cp_size,
        device_type=device_type,
    )
    mesh = create_fsdp2_mesh(**sizes)
    moe = create_moe_mesh(ep_size=ep_size, **sizes) if _degree("ep_size", ep_size) > 1 else None
    return mesh, moe
