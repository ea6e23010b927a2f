"""What a :class:`~twinkle_ray.core.mesh.DeviceMesh` is built from, checked: its ranks, its
dimension names, its flattened names, and the sizes ``from_sizes`` lays out.

Pure (numpy only). Every check raises ``ValueError`` naming the argument and what it got, before
a mesh exists; :mod:`twinkle_ray.core.mesh` keeps the queries over a mesh that passed them.

Example::

    >>> sizes_in_order(world_size=8, dp_size=None, tp_size=2)
    {'dp': 4, 'tp': 2}
    >>> check_dim_names(("dp", "tp"), (4, 2))
    ('dp', 'tp')
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = ["KNOWN_DIMS", "FROM_SIZES_ORDER", "check_ranks", "check_dim_names", "check_flattened",
           "check_positive", "is_int", "sizes_in_order"]

#: Root dimension names a mesh may use (Twinkle's, plus NeMo's FSDP2/MoE names).
KNOWN_DIMS: frozenset[str] = frozenset(
    {"fsdp", "pp", "dp", "cp", "tp", "ep", "ep_fsdp", "ep_shard", "dp_replicate", "dp_shard"}
)
#: Dimension order of :meth:`DeviceMesh.from_sizes`, outermost first.
FROM_SIZES_ORDER: tuple[str, ...] = ("fsdp", "pp", "dp", "cp", "tp")


def is_int(value: Any) -> bool:
    """An integer: Python's or numpy's (as DeviceMesh, DeviceGroup and the samplers take), not a
    bool. The one such check of the core.

    >>> is_int(np.int64(3)), is_int(3), is_int(True), is_int(np.bool_(True)), is_int(3.0)
    (True, True, False, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_positive(name: str, value: Any) -> int:
    """``value`` as an int; ``ValueError`` naming ``name`` unless it is a positive integer."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def product_expr(sizes: dict[str, int]) -> str:
    """``{'pp': 2, 'tp': 2}`` -> ``'pp_size=2 * tp_size=2 = 4'``."""
    terms = " * ".join(f"{name}_size={size}" for name, size in sizes.items())
    return f"{terms} = {math.prod(sizes.values())}"


def check_ranks(mesh: Any) -> np.ndarray:
    """The mesh's ranks as a fresh int64 array: at least one dimension, no empty one, distinct
    non-negative integers."""
    raw = np.asarray(mesh)
    if raw.ndim == 0:
        raise ValueError(f"mesh must have at least one dimension, got a scalar {raw!r}")
    if raw.size and not np.issubdtype(raw.dtype, np.integer):
        raise ValueError(f"mesh must hold integer ranks, got dtype {raw.dtype}")
    if 0 in raw.shape:
        raise ValueError(f"mesh sizes must be positive, got shape {raw.shape}")
    ranks = raw.astype(np.int64, copy=True)
    if ranks.min() < 0:
        raise ValueError(f"mesh ranks must be non-negative, got {int(ranks.min())}")
    if len(np.unique(ranks)) != ranks.size:
        raise ValueError(f"mesh ranks must be distinct, got {ranks.tolist()}")
    return ranks


def check_dim_names(names: Any, shape: tuple[int, ...]) -> tuple[str, ...]:
    """One distinct name from :data:`KNOWN_DIMS` per axis of a mesh of ``shape``."""
    if isinstance(names, str) or names is None:
        raise ValueError(f"mesh_dim_names must be a tuple of names, got {names!r}")
    names = tuple(names)
    if len(names) != len(shape):
        raise ValueError(
            f"mesh_dim_names {names} has {len(names)} names but the mesh has "
            f"{len(shape)} dimensions (shape {tuple(shape)})"
        )
    unknown = [n for n in names if n not in KNOWN_DIMS]
    if unknown:
        raise ValueError(f"unknown dim names {unknown} in {names}; known: {sorted(KNOWN_DIMS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names must be distinct, got {names}")
    return names


def check_flattened(flattened: dict, names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """``name -> dims``: each a new name over distinct root dims, in mesh order."""
    checked: dict[str, tuple[str, ...]] = {}
    for name, dims in dict(flattened).items():
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if name in names:
            raise ValueError(f"flattened name {name!r} is already a root dim of {names}")
        missing = [d for d in dims if d not in names]
        if not dims or missing:
            raise ValueError(
                f"flattened {name!r} -> {dims}: unknown dim names {missing}; mesh has {names}"
            )
        order = [names.index(d) for d in dims]
        if order != sorted(set(order)):
            raise ValueError(
                f"flattened {name!r} -> {dims}: dims must be distinct and in mesh order {names}"
            )
        checked[name] = dims
    return checked


def sizes_in_order(*, world_size: int = 1, dp_size: int | None = 1, **given: int | None) -> dict[str, int]:
    """``from_sizes``' layout: ``{dim: size}`` of the dims given (``fsdp``, ``pp``, ``cp``,
    ``tp`` as ``<dim>_size``, and ``dp`` always), outermost first.

    ``world_size=1`` means "the product of the sizes"; a larger one must equal it, except that
    ``dp_size=None`` infers dp as ``world_size`` divided by the other sizes.
    """
    world_size = check_positive("world_size", world_size)
    others = {
        key[: -len("_size")]: check_positive(key, s) for key, s in given.items() if s is not None
    }
    if dp_size is None:
        other_product = math.prod(others.values())
        if world_size == 1:
            dp_size = 1
        elif world_size % other_product:
            raise ValueError(
                f"cannot infer dp_size: world_size ({world_size}) is not divisible by "
                f"({product_expr(others)})"
            )
        else:
            dp_size = world_size // other_product
    sizes = {**others, "dp": check_positive("dp_size", dp_size)}
    ordered = {name: sizes[name] for name in FROM_SIZES_ORDER if name in sizes}
    total = math.prod(ordered.values())
    if world_size != 1 and world_size != total:
        raise ValueError(
            f"world_size ({world_size}) does not equal the product of the mesh sizes "
            f"({product_expr(ordered)}); pass dp_size=None to infer dp from world_size"
        )
    return ordered
