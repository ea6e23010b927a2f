"""What each end holds: a trainer rank's :class:`Slab` s and a receiver's :class:`Want` s.

A slab is a tensor a trainer rank holds locally that is rows ``[start, start + n)`` along ``dim`` of
a full tensor the receivers know by ``name`` (all of it: ``dim=0, start=0``). A tensor-parallel shard
is one slab; a fused Megatron QKV shard is several (a view per q/k/v block, each naming its HF
tensor: :func:`fused_slabs`). A want is the part of a full tensor a receiver keeps: all of it for an
unsharded sampler, its own rows along ``dim`` for a tensor-parallel one.

>>> import torch
>>> s = Slab("w", torch.zeros(2, 4), full_shape=(4, 4), dim=0, start=2)
>>> s.meta()
['w', 'float32', [4, 4], 0, 2, 2]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Slab", "TensorSource", "Want", "fused_slabs", "is_dtensor", "module_slabs", "module_wants", "unwrap"]


@dataclass
class Slab:
    """``tensor`` holds rows ``[start, start + tensor.shape[dim])`` along ``dim`` of ``name``."""

    name: str
    tensor: Any
    full_shape: Sequence[int] | None = None  # None: the tensor is the full one
    dim: int = 0
    start: int = 0

    def meta(self) -> list:
        """What the plan needs: [name, dtype, full shape, dim, start, length] (small, picklable)."""
        full = list(self.full_shape) if self.full_shape is not None else list(self.tensor.shape)
        length = int(self.tensor.shape[self.dim]) if self.tensor.dim() else 1
        return [self.name, str(self.tensor.dtype).removeprefix("torch."), [int(x) for x in full],
                int(self.dim), int(self.start), length]


@dataclass
class Want:
    """A receiver keeps rows ``[start, start + length)`` along ``dim`` of ``name`` (length None: all)."""

    name: str
    full_shape: Sequence[int]
    dtype: str = "float32"
    dim: int = 0
    start: int = 0
    length: int | None = None

    def meta(self) -> list:
        full = [int(x) for x in self.full_shape]
        length = self.length if self.length is not None else (full[self.dim] if full else 1)
        return [self.name, str(self.dtype).removeprefix("torch."), full, int(self.dim), int(self.start),
                int(length)]


def is_dtensor(tensor: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2 / tensor-parallel shard), without importing it."""
    cls = type(tensor)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def unwrap(module: Any) -> Any:
    """The wrapped model of DDP / FSDP1 (names without the 'module.' prefix); others as they are."""
    if type(module).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
        return module.module
    return module


def _shard_of(t: Any) -> tuple[Any, int, int] | None:
    """(local tensor, dim, start) of a DTensor sharded on one dim; None when replicated."""
    from torch.distributed.tensor import Shard

    shards = [(i, p.dim) for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    local = t.to_local()
    if not shards:
        return None
    if len(shards) > 1:
        raise NotImplementedError(f"weight sync: a DTensor sharded on several mesh dims {t.placements}; "
                                  f"override weight_sync_shards()/weight_sync_wants()")
    mesh_dim, dim = shards[0]
    full = int(t.shape[dim])
    n = t.device_mesh.size(mesh_dim)
    per = -(-full // n)  # torch's Shard: ceil chunks, the last ones short
    start = min(per * t.device_mesh.get_local_rank(mesh_dim), full)
    return local, dim, start


def module_slabs(module: Any) -> list[Slab]:
    """A module's state dict as slabs: plain tensors whole, DTensor shards as their local rows."""
    out = []
    for name, t in unwrap(module).state_dict(keep_vars=False).items():
        if is_dtensor(t):
            got = _shard_of(t)
            if got is None:
                out.append(Slab(name, t.to_local().detach()))
            else:
                local, dim, start = got
                out.append(Slab(name, local.detach(), tuple(t.shape), dim, start))
        else:
            out.append(Slab(name, t.detach()))
    return out


def module_wants(module: Any) -> tuple[list[Want], dict[str, Any]]:
    """What a module keeps (wants) and where it lands (name -> the tensor to copy into, in place)."""
    wants, targets = [], {}
    for name, t in unwrap(module).state_dict(keep_vars=True).items():
        dtype = str(t.dtype).removeprefix("torch.")
        if is_dtensor(t):
            got = _shard_of(t)
            local = t.to_local()
            if got is None:
                wants.append(Want(name, tuple(t.shape), dtype))
            else:
                _, dim, start = got
                wants.append(Want(name, tuple(t.shape), dtype, dim, start, int(local.shape[dim])))
            targets[name] = local
        else:
            wants.append(Want(name, tuple(t.shape), dtype))
            targets[name] = t
    return wants, targets


def fused_slabs(tensor: Any, blocks: Sequence[tuple[str, Sequence[int], int, int]], dim: int = 0) -> list[Slab]:
    """Slabs of a fused local tensor: ``blocks`` lists, in local order along ``dim``, (name, full shape
    of that tensor, start in it, length); each slab is a view (no copy on dim 0).

    A Megatron QKV shard of TP rank r holding, per head group, q rows then k rows then v rows::

        fused_slabs(qkv, [("q", q_shape, q0, nq), ("k", k_shape, k0, nk), ("v", v_shape, v0, nv), ...])

    >>> import torch
    >>> [s.meta() for s in fused_slabs(torch.zeros(6, 2), [("a", (4, 2), 2, 2), ("b", (8, 2), 0, 4)])]
    [['a', 'float32', [4, 2], 0, 2, 2], ['b', 'float32', [8, 2], 0, 0, 4]]
    """
    out, offset = [], 0
    for name, full_shape, start, length in blocks:
        out.append(Slab(name, tensor.narrow(dim, offset, length), tuple(full_shape), dim, start))
        offset += length
    if offset != tensor.shape[dim]:
        raise ValueError(f"weight sync: fused blocks cover {offset} of {tensor.shape[dim]} rows along dim {dim}")
    return out


class TensorSource:
    """A lazy, re-iterable source of named tensors (metadata first): what an older
    ``weight_sync_tensors()`` may return (vLLM's ``WeightSource`` contract).

    >>> import torch
    >>> src = TensorSource([("w", torch.float32, (2,))], lambda: iter([("w", torch.ones(2))]))
    >>> [m[0] for m in src.metadata()], [n for n, _ in src]
    (['w'], ['w'])
    """

    def __init__(self, specs: Any, produce: Any):
        self._specs = [(str(n), d, tuple(int(x) for x in s)) for n, d, s in specs]
        self._produce = produce

    def metadata(self) -> list[tuple[str, Any, tuple[int, ...]]]:
        return list(self._specs)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self._produce())

    def __len__(self) -> int:
        return len(self._specs)
