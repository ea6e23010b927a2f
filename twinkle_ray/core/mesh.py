"""DeviceMesh: the layout of a gang's ranks over named parallel dimensions.

A :class:`DeviceMesh` is an n-d numpy array of global ranks with one name per
axis (``'pp'``, ``'dp'``, ``'tp'``, ...). It is plain data: it pickles across
Ray, needs no process group, and answers every question the dispatcher asks
(which data slice a rank gets, which ranks form a tensor-parallel group, whose
results to collect). Inside a worker whose torch.distributed world is up,
:meth:`DeviceMesh.to_torch` builds the matching
``torch.distributed.device_mesh.DeviceMesh`` with torch's own machinery.

Group membership follows torch exactly: the groups of dimension ``d`` are the
rows of ``mesh.swapdims(-1, d).reshape(-1, mesh.shape[d])``, listed in torch
2.13's order (row-major over the other coordinates).

What a mesh is built from is checked in :mod:`twinkle_ray.core.mesh_checks`; the torch
bridge is :mod:`twinkle_ray.core.mesh_torch`. This module stays one piece over 400 lines
(most of it docstrings and their examples): every method is a query over the one array of
ranks and its names, and the one data-rank rule that routing and the samplers share sits
beside the coordinate maths it reads.

Example::

    >>> mesh = DeviceMesh(mesh=np.arange(8).reshape(4, 2), mesh_dim_names=("pp", "tp"))
    >>> mesh.get_group_ranks("pp", rank=5)
    [1, 3, 5, 7]
    >>> mesh.get_group_ranks("tp", rank=5)
    [4, 5]
    >>> mesh.get_dim_groups("tp")
    [[0, 1], [2, 3], [4, 5], [6, 7]]
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from .batch import span
from .mesh_checks import (
    KNOWN_DIMS,
    check_dim_names,
    check_flattened,
    check_positive,
    check_ranks,
    is_int,
    product_expr,
    sizes_in_order,
)
from .mesh_torch import build_torch_mesh
from .platform import Platform

__all__ = ["DeviceMesh", "KNOWN_DIMS", "DATA_DIMS", "TWINKLE_DATA_ORDER"]

#: Dimensions whose index splits the data (see :meth:`DeviceMesh.data_dims_order` for the
#: order in which they make up the data rank).
DATA_DIMS: tuple[str, ...] = ("fsdp", "dp", "dp_replicate", "dp_shard")
#: Twinkle's data dims, outermost first as its data rank reads them:
#: ``data_rank = dp_rank * fsdp_world_size + fsdp_rank``.
TWINKLE_DATA_ORDER: tuple[str, ...] = ("dp", "fsdp")
_SIZE_ATTRS = ("ep_size", "etp_size", "vpp_size", "ulysses_size")


def _coord_property(dim: str) -> property:
    def getter(self: DeviceMesh) -> int | None:
        return self._current_local_rank(dim)

    getter.__doc__ = (
        f"The current rank's coordinate on ``{dim!r}`` (a flattened dimension gives its "
        f"flattened index); ``None`` when the mesh has no ``{dim!r}`` or the rank is not in it."
    )
    return property(getter)


def _size_property(dim: str) -> property:
    def getter(self: DeviceMesh) -> int:
        return self.get_dim_size(dim) if self.has_dim(dim) else 1

    getter.__doc__ = f"Size of ``{dim!r}``; ``1`` when the mesh has no such dimension."
    return property(getter)


@dataclass(eq=False, repr=False)
class DeviceMesh:
    """Named n-d layout of global ranks, Twinkle-compatible and free of torch and Ray.

    Args:
        mesh: array of distinct non-negative global ranks, one axis per dimension.
        mesh_dim_names: one name per axis, from :data:`KNOWN_DIMS`.
        ep_size: expert-parallel size (an attribute, not a mesh dimension).
        etp_size: expert-tensor-parallel size (an attribute, not a mesh dimension).
        vpp_size: virtual-pipeline size (an attribute, not a mesh dimension).
        ulysses_size: Ulysses sequence-parallel size (an attribute, not a mesh
            dimension); groups that many consecutive data ranks into one data rank.
        sequence_parallel: Megatron sequence parallelism on or off.
        device_type: ``'cuda'`` (``'gpu'`` is accepted), ``'cpu'``, ``'npu'``, ...
        flattened: extra names for groups that span several root dimensions,
            ``name -> dims`` with ``dims`` in mesh order, as torch's
            ``mesh[dims]._flatten(name)`` makes them. Every method taking a
            dimension name accepts these too.

    The current rank (when a method is given ``rank=None``, and for every
    ``<dim>_rank`` property) is asked of
    ``Platform.get_mesh_rank(world_size)`` (:class:`~twinkle_ray.core.platform.Platform`)
    at call time: ``Platform.get_rank()``, except in a gang worker that owns several
    devices, which is the mesh rank of its first device (see ``get_mesh_rank``), as
    the dispatcher routes it. ``patch.object(Platform, 'get_rank', return_value=r)``
    shows what rank ``r`` sees.

    Example::

        >>> mesh = DeviceMesh.from_sizes(dp_size=2, pp_size=2, tp_size=2)
        >>> mesh
        DeviceMesh(mesh_dim_names=('pp', 'dp', 'tp'), shape=(2, 2, 2), mesh=[[[0, 1], [2, 3]], [[4, 5], [6, 7]]], device_type='cuda')
        >>> [mesh.get_data_rank_from_global_rank(r) for r in range(8)]
        [0, 0, 1, 1, 0, 0, 1, 1]
        >>> mesh.get_slice(10, rank=1)  # the slice of data rank 1
        slice(5, 10, None)
        >>> mesh.get_pp_last_ranks(), mesh.get_collect_ranks()
        ([4, 5, 6, 7], [4, 6])
    """

    mesh: np.ndarray
    mesh_dim_names: tuple[str, ...]
    _: KW_ONLY
    ep_size: int | None = None
    etp_size: int | None = None
    vpp_size: int | None = None
    ulysses_size: int | None = None
    sequence_parallel: bool = False
    device_type: str = "cuda"
    flattened: dict[str, tuple[str, ...]] = field(default_factory=dict)

    # ------------------------------------------------------------------ build
    def __post_init__(self) -> None:
        self.mesh = check_ranks(self.mesh)
        self.mesh_dim_names = check_dim_names(self.mesh_dim_names, self.mesh.shape)
        for attr in _SIZE_ATTRS:
            value = getattr(self, attr)
            if value is not None:
                setattr(self, attr, check_positive(attr, value))
        self.flattened = check_flattened(self.flattened, self.mesh_dim_names)
        ulysses = self.ulysses_size or 1
        if self._data_size % ulysses:
            raise ValueError(
                f"ulysses_size ({ulysses}) must divide the data world size "
                f"({product_expr(self._data_sizes) if self._data_sizes else 1})"
            )

    @classmethod
    def from_sizes(
        cls,
        *,
        world_size: int = 1,
        dp_size: int | None = 1,
        fsdp_size: int | None = None,
        tp_size: int | None = None,
        pp_size: int | None = None,
        ulysses_size: int | None = None,
        cp_size: int | None = None,
        ep_size: int | None = None,
        etp_size: int | None = None,
        vpp_size: int | None = None,
        device_type: str = "cuda",
        sequence_parallel: bool = False,
    ) -> DeviceMesh:
        """Build the mesh of ranks ``0..N-1`` with dims ordered fsdp, pp, dp, cp, tp.

        Only the dimensions given appear, outermost first; ``dp`` is always
        present. ``ulysses``, ``ep``, ``etp``, ``vpp`` and ``sequence_parallel``
        are kept as attributes, not dimensions.

        ``world_size=1`` (the default) means "the product of the sizes". A
        larger ``world_size`` must equal that product, except that
        ``dp_size=None`` asks for dp to be inferred as ``world_size`` divided
        by the other sizes.

        Example::

            >>> DeviceMesh.from_sizes(fsdp_size=2, dp_size=2, tp_size=2).mesh_dim_names
            ('fsdp', 'dp', 'tp')
            >>> DeviceMesh.from_sizes(world_size=8, dp_size=None, tp_size=2).mesh.shape
            (4, 2)
            >>> DeviceMesh.from_sizes(world_size=8, dp_size=2, tp_size=2)
            Traceback (most recent call last):
            ...
            ValueError: world_size (8) does not equal the product of the mesh sizes (dp_size=2 * tp_size=2 = 4); ...
        """
        ordered = sizes_in_order(world_size=world_size, dp_size=dp_size, fsdp_size=fsdp_size,
                                 pp_size=pp_size, cp_size=cp_size, tp_size=tp_size)
        total = math.prod(ordered.values())
        return cls(
            mesh=np.arange(total).reshape(tuple(ordered.values())),
            mesh_dim_names=tuple(ordered),
            ep_size=ep_size,
            etp_size=etp_size,
            vpp_size=vpp_size,
            ulysses_size=ulysses_size,
            sequence_parallel=sequence_parallel,
            device_type=device_type,
        )

    # ------------------------------------------------------------- protocol
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (
            self.mesh.shape == other.mesh.shape
            and bool(np.array_equal(self.mesh, other.mesh))
            and self.mesh_dim_names == other.mesh_dim_names
            and self.device_type == other.device_type
            and self.sequence_parallel == other.sequence_parallel
            and self.flattened == other.flattened
            and all(getattr(self, a) == getattr(other, a) for a in _SIZE_ATTRS)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, like a dataclass with eq

    def __repr__(self) -> str:
        parts = [f"mesh_dim_names={self.mesh_dim_names!r}", f"shape={self.mesh.shape}"]
        if self.mesh.size <= 64:
            parts.append(f"mesh={self.mesh.tolist()}")
        parts.append(f"device_type={self.device_type!r}")
        parts += [f"{a}={getattr(self, a)}" for a in _SIZE_ATTRS if getattr(self, a) is not None]
        if self.sequence_parallel:
            parts.append("sequence_parallel=True")
        if self.flattened:
            parts.append(f"flattened={self.flattened!r}")
        return f"DeviceMesh({', '.join(parts)})"

    # ---------------------------------------------------------- dimensions
    @property
    def world_size(self) -> int:
        """Number of ranks in the mesh."""
        return int(self.mesh.size)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the mesh, one size per root dimension."""
        return tuple(self.mesh.shape)

    @property
    def ndim(self) -> int:
        """Number of root dimensions."""
        return self.mesh.ndim

    def has_dim(self, dim: str) -> bool:
        """Whether ``dim`` is a root or flattened dimension of this mesh."""
        return dim in self.mesh_dim_names or dim in self.flattened

    def _axes(self, dim: str) -> tuple[int, ...]:
        """Axis indices behind a root or flattened dimension name."""
        if dim in self.mesh_dim_names:
            return (self.mesh_dim_names.index(dim),)
        if dim in self.flattened:
            return tuple(self.mesh_dim_names.index(d) for d in self.flattened[dim])
        known = list(self.mesh_dim_names) + list(self.flattened)
        raise ValueError(f"unknown dim name {dim!r}; this mesh has {known}")

    def get_dim_size(self, dim: str) -> int:
        """Size of a root or flattened dimension; ``ValueError`` if there is none.

        Example::

            >>> DeviceMesh.from_sizes(pp_size=2, dp_size=4).get_dim_size("dp")
            4
        """
        return math.prod(self.mesh.shape[a] for a in self._axes(dim))

    # -------------------------------------------------------------- ranks
    def _current_rank(self) -> int:
        """This process's rank in the mesh (see the class docstring)."""
        return Platform.get_mesh_rank(self.world_size)

    def get_coordinate(self, rank: int | None = None) -> tuple[int, ...] | None:
        """Coordinate of ``rank`` (default: the current rank), ``None`` if not in the mesh.

        Example::

            >>> DeviceMesh(mesh=np.arange(8).reshape(4, 2), mesh_dim_names=("pp", "tp")).get_coordinate(5)
            (2, 1)
        """
        rank = self._current_rank() if rank is None else rank
        hits = np.argwhere(self.mesh == rank)
        return tuple(int(c) for c in hits[0]) if len(hits) else None

    def _require_coordinate(self, rank: int | None) -> tuple[int, ...]:
        rank = self._current_rank() if rank is None else rank
        coord = self.get_coordinate(rank)
        if coord is None:
            raise ValueError(
                f"rank {rank} is not in this mesh of {self.world_size} ranks "
                f"(shape {self.shape}, ranks {sorted(self.mesh.ravel().tolist())})"
            )
        return coord

    def _index_on(self, axes: tuple[int, ...], coord: tuple[int, ...]) -> int:
        if not axes:
            return 0
        sizes = tuple(self.mesh.shape[a] for a in axes)
        return int(np.ravel_multi_index(tuple(coord[a] for a in axes), sizes))

    def get_local_rank(self, dim: str, rank: int | None = None) -> int:
        """Index of ``rank`` (default: current) within its group of ``dim``.

        Raises ``ValueError`` for an unknown dim or a rank outside the mesh.

        Example::

            >>> m = DeviceMesh(mesh=np.arange(8).reshape(2, 2, 2), mesh_dim_names=("dp", "cp", "tp"),
            ...                flattened={"dp_cp": ("dp", "cp")})
            >>> m.get_local_rank("cp", rank=6), m.get_local_rank("dp_cp", rank=6)
            (1, 3)
        """
        axes = self._axes(dim)
        return self._index_on(axes, self._require_coordinate(rank))

    def _current_local_rank(self, dim: str) -> int | None:
        if not self.has_dim(dim):
            return None
        coord = self.get_coordinate()
        return None if coord is None else self._index_on(self._axes(dim), coord)

    fsdp_rank = _coord_property("fsdp")
    pp_rank = _coord_property("pp")
    dp_rank = _coord_property("dp")
    cp_rank = _coord_property("cp")
    tp_rank = _coord_property("tp")
    ep_rank = _coord_property("ep")

    fsdp_world_size = _size_property("fsdp")
    pp_world_size = _size_property("pp")
    dp_world_size = _size_property("dp")
    cp_world_size = _size_property("cp")
    tp_world_size = _size_property("tp")

    @property
    def ep_world_size(self) -> int:
        """Size of the ``'ep'`` dimension if there is one, else ``ep_size`` (or 1)."""
        return self.get_dim_size("ep") if self.has_dim("ep") else (self.ep_size or 1)

    @property
    def etp_world_size(self) -> int:
        """``etp_size`` if set, else the tensor-parallel size."""
        return self.etp_size if self.etp_size is not None else self.tp_world_size

    # ----------------------------------------------------------- groups
    def get_dim_groups(self, dim: str) -> list[list[int]]:
        """Every group of ``dim`` (root or flattened), as torch builds them.

        Each inner list is one process group in local-rank order; the groups
        are listed row-major over the coordinates of the other dimensions.

        Example::

            >>> m = DeviceMesh(mesh=np.arange(8).reshape(2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
            >>> m.get_dim_groups("dp")
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        """
        axes = self._axes(dim)
        rest = [a for a in range(self.ndim) if a not in axes]
        size = math.prod(self.mesh.shape[a] for a in axes)
        return np.transpose(self.mesh, rest + list(axes)).reshape(-1, size).tolist()

    def get_group_ranks(self, dim: str, rank: int | None = None) -> list[int]:
        """The group of ``dim`` that holds ``rank`` (default: the current rank).

        Example::

            >>> m = DeviceMesh(mesh=np.arange(8).reshape(4, 2), mesh_dim_names=("pp", "tp"))
            >>> m.get_group_ranks("pp", rank=5), m.get_group_ranks("tp", rank=5)
            ([1, 3, 5, 7], [4, 5])
        """
        axes = self._axes(dim)
        coord = self._require_coordinate(rank)
        index = tuple(slice(None) if a in axes else coord[a] for a in range(self.ndim))
        return self.mesh[index].ravel().tolist()

    # ------------------------------------------------------------- data
    @property
    def _data_sizes(self) -> dict[str, int]:
        return {
            n: int(self.mesh.shape[i]) for i, n in enumerate(self.mesh_dim_names) if n in DATA_DIMS
        }

    @property
    def _data_size(self) -> int:
        return math.prod(self._data_sizes.values())

    @property
    def data_dims_order(self) -> tuple[str, ...]:
        """The data dims of this mesh, outermost first, in the order that makes the data rank.

        The data rank of a rank is the row-major index of its coordinates on these
        dims (in this order), divided by ``ulysses_size``. Which order depends on the
        kind of mesh:

        - **Twinkle meshes** (data dims ``dp`` and/or ``fsdp``: :meth:`from_sizes` and
          meshes built by hand with Twinkle's names): ``('dp', 'fsdp')``, i.e. Twinkle's
          rule ``data_rank = dp_rank * fsdp_world_size + fsdp_rank``, whatever the mesh
          order. ``from_sizes`` puts ``fsdp`` outermost, so this is *not* torch's
          flatten order of ``mesh['fsdp', 'dp']``; it is what Twinkle scripts compute
          with ``mesh.data_rank`` to slice their own data, so our routing agrees with
          them row for row.
        - **NeMo-style meshes** (any of ``dp_replicate`` / ``dp_shard``:
          :mod:`twinkle_ray.mesh_factory`): the data dims in mesh order, which is
          torch's flatten order: the data rank is the local rank in the flattened
          ``'dp'`` group that FSDP2/HSDP training code reads.

        Example::

            >>> DeviceMesh.from_sizes(fsdp_size=3, dp_size=2).data_dims_order
            ('dp', 'fsdp')
            >>> m = DeviceMesh.from_sizes(fsdp_size=3, dp_size=2)
            >>> [m.get_data_rank_from_global_rank(r) for r in range(6)]
            [0, 3, 1, 4, 2, 5]
        """
        present = tuple(n for n in self.mesh_dim_names if n in DATA_DIMS)
        if set(present) <= set(TWINKLE_DATA_ORDER):
            return tuple(n for n in TWINKLE_DATA_ORDER if n in present)
        return present

    def _data_rank_of(self, coord: tuple[int, ...]) -> int:
        """The one data-rank rule (see :attr:`data_dims_order`) for a coordinate.

        ``data_rank``, ``get_data_rank_from_global_rank``, ``get_slice``,
        ``get_collect_ranks`` and, through them, ``slice_dp`` routing (eager and
        lazy) and the samplers all come here.
        """
        axes = tuple(self.mesh_dim_names.index(n) for n in self.data_dims_order)
        return self._index_on(axes, coord) // (self.ulysses_size or 1)

    @property
    def data_world_size(self) -> int:
        """Number of distinct data slices: product of the data dims, divided by ulysses.

        The data dims are those of :data:`DATA_DIMS` present in the mesh
        (``dp`` and ``fsdp`` for :meth:`from_sizes`; ``dp_replicate`` and
        ``dp_shard`` for an FSDP2/HSDP mesh); 1 if there are none.
        """
        return self._data_size // (self.ulysses_size or 1)

    @property
    def data_rank(self) -> int | None:
        """Data rank of the current rank; ``None`` if the current rank is not in the mesh.

        Twinkle's rule for Twinkle meshes (``dp_rank * fsdp_world_size + fsdp_rank``),
        torch's flatten order for NeMo-style meshes (see :attr:`data_dims_order`),
        divided by ``ulysses_size``; tp/pp/cp peers share it.
        """
        coord = self.get_coordinate()
        return None if coord is None else self._data_rank_of(coord)

    def get_data_rank_from_global_rank(self, global_rank: int) -> int:
        """Data rank of ``global_rank``; ``ValueError`` if it is not in the mesh.

        Example::

            >>> m = DeviceMesh.from_sizes(dp_size=4, ulysses_size=2)
            >>> [m.get_data_rank_from_global_rank(r) for r in range(4)]
            [0, 0, 1, 1]
        """
        return self._data_rank_of(self._require_coordinate(global_rank))

    def get_slice(self, total_length: int, rank: int | None = None) -> slice:
        """The contiguous part of ``total_length`` items that belongs to a data rank.

        ``rank`` is a **data rank** (as in Twinkle:
        ``mesh.get_slice(n, mesh.get_data_rank_from_global_rank(g))``); by
        default the current rank's data rank. Items are split as ``divmod``
        does: the first ``total_length % data_world_size`` data ranks get one
        extra item. With a data world size of 1 every rank gets everything.

        Example::

            >>> m = DeviceMesh.from_sizes(dp_size=4)
            >>> [m.get_slice(10, r) for r in range(4)]
            [slice(0, 3, None), slice(3, 6, None), slice(6, 8, None), slice(8, 10, None)]
        """
        if not is_int(total_length) or total_length < 0:
            raise ValueError(f"total_length must be a non-negative integer, got {total_length!r}")
        world = self.data_world_size
        if rank is None:
            if world == 1:
                return slice(0, total_length)
            rank = self.get_data_rank_from_global_rank(self._current_rank())
        elif not is_int(rank) or not 0 <= rank < world:
            raise ValueError(f"data rank {rank!r} is out of range for data_world_size {world}")
        return slice(*span(total_length, world, rank))

    # ------------------------------------------------------- pipelines
    def get_pp_stage_ranks(self, stage: int) -> list[int]:
        """Sorted ranks of pipeline stage ``stage`` (all ranks when there is no pp).

        Example::

            >>> DeviceMesh.from_sizes(pp_size=2, dp_size=2).get_pp_stage_ranks(1)
            [2, 3]
        """
        size = self.pp_world_size
        if not is_int(stage) or not 0 <= stage < size:
            raise ValueError(f"pp stage {stage!r} is out of range for pp size {size}")
        if not self.has_dim("pp"):
            return sorted(self.mesh.ravel().tolist())
        return sorted(np.take(self.mesh, stage, axis=self._axes("pp")[0]).ravel().tolist())

    def get_pp_first_ranks(self) -> list[int]:
        """Sorted ranks of the first pipeline stage."""
        return self.get_pp_stage_ranks(0)

    def get_pp_last_ranks(self) -> list[int]:
        """Sorted ranks of the last pipeline stage (all ranks when there is no pp)."""
        return self.get_pp_stage_ranks(self.pp_world_size - 1)

    def is_pp_first_rank(self, rank: int | None = None) -> bool:
        """Whether ``rank`` (default: current) is in the first pipeline stage."""
        return (self._current_rank() if rank is None else rank) in self.get_pp_first_ranks()

    def is_pp_last_rank(self, rank: int | None = None) -> bool:
        """Whether ``rank`` (default: current) is in the last pipeline stage."""
        return (self._current_rank() if rank is None else rank) in self.get_pp_last_ranks()

    def get_tp_last_ranks(self) -> list[int]:
        """Sorted ranks that are last in their tensor-parallel group (all when no tp)."""
        if not self.has_dim("tp"):
            return sorted(self.mesh.ravel().tolist())
        return sorted(np.take(self.mesh, -1, axis=self._axes("tp")[0]).ravel().tolist())

    def is_tp_last_rank(self, rank: int | None = None) -> bool:
        """Whether ``rank`` (default: current) is last in its tp group; False outside the mesh."""
        return (self._current_rank() if rank is None else rank) in self.get_tp_last_ranks()

    def get_collect_ranks(self) -> list[int]:
        """One global rank per data rank whose result stands for its data slice.

        For each data rank, the smallest rank in the last pipeline stage (tp,
        cp and ulysses peers hold the same result). Ordered by data rank, so the
        results of these ranks in this order are the batch in data order (with
        Twinkle's data-rank rule that is not always ascending: see
        :attr:`data_dims_order`).

        Example::

            >>> DeviceMesh.from_sizes(dp_size=2, pp_size=2, tp_size=2).get_collect_ranks()
            [4, 6]
            >>> DeviceMesh.from_sizes(fsdp_size=2, dp_size=2).get_collect_ranks()
            [0, 2, 1, 3]
        """
        last = set(self.get_pp_last_ranks())
        best: dict[int, tuple[bool, int]] = {}
        for rank in self.mesh.ravel().tolist():
            key = (rank not in last, rank)
            data_rank = self.get_data_rank_from_global_rank(rank)
            if data_rank not in best or key < best[data_rank]:
                best[data_rank] = key
        return [best[d][1] for d in sorted(best)]

    # ------------------------------------------------------------- torch
    def to_torch(self, device_type: str | None = None) -> Any:
        """Build the matching ``torch.distributed.device_mesh.DeviceMesh``.

        Collective: every rank of the torch.distributed world must call it, on
        an equal mesh. Torch creates the per-dimension process groups itself;
        each name in :attr:`flattened` is made with ``mesh[dims]._flatten(name)``.
        ``device_type`` overrides the mesh's own; ``'gpu'`` means ``'cuda'``,
        and ``'cuda'`` falls back to ``'cpu'`` when CUDA is not available.

        Raises ``RuntimeError`` if torch.distributed is not initialised.

        Example (inside an initialised 8-rank world)::

            >>> tm = DeviceMesh.from_sizes(pp_size=4, tp_size=2, device_type="cpu").to_torch()  # doctest: +SKIP
            >>> dist.get_process_group_ranks(tm.get_group("tp"))  # on rank 5  # doctest: +SKIP
            [4, 5]
        """
        return build_torch_mesh(self, device_type)

    def to_torch_device_mesh(self) -> Any:
        """Twinkle's name for :meth:`to_torch`."""
        return self.to_torch()
