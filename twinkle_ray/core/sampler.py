"""DeviceMeshSampler: global batches of dataset indices for a mesh's data ranks.

Pure module (numpy only, no Ray, no torch): it decides *which items* form each
step's batch and which data-parallel rank gets which of them.

Batch-size convention (the same as Twinkle's DataLoader): ``batch_size`` is
the **global** batch, all data ranks together, and must be divisible by the
data world size; every data rank gets ``batch_size // data_world_size`` items
of a full batch. A global batch is laid out rank-contiguously: rank ``d``'s
part is ``batch[span(len(batch), dws, d)]``, the divmod split that
``DeviceMesh.get_slice`` and ``slice_dp`` dispatch use. So a loader can hand
the whole global batch to a gang and ``slice_dp`` routing gives every data
rank exactly its part.

The tail of an epoch (``n % batch_size`` items):

- ``drop_last=True``: dropped.
- ``drop_last=False`` and at least ``data_world_size`` items: one smaller last
  batch, split divmod-style (the first ranks get one item more).
- ``drop_last=False`` and fewer than ``data_world_size`` items: they are
  merged into the previous batch (which is then up to ``dws - 1`` items
  larger), because a batch smaller than the data world size cannot be
  dispatched. Every item is still seen exactly once per epoch.

Shuffling is a permutation drawn from ``(seed, epoch)``: reproducible, new
each epoch. The position (epoch, step) is the sampler's state; iteration
continues from it, so ``state_dict()`` / ``load_state_dict()`` resume exactly.

Example::

    >>> s = DeviceMeshSampler(10, batch_size=4, data_world_size=2)
    >>> list(s)
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    >>> s.rank_part([8, 9], 1)
    [9]
    >>> s.epoch, s.step           # a finished epoch moves to the next one
    (1, 0)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from .batch import span
from .mesh_checks import is_int

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["DeviceMeshSampler", "StreamBatcher", "batch_bounds"]


def _data_world_size(data_world_size: int | None, device_mesh: Any) -> int:
    if device_mesh is not None:
        dws = int(device_mesh.data_world_size)
        if data_world_size is not None and data_world_size != dws:
            raise ValueError(
                f"data_world_size={data_world_size} disagrees with the device mesh's "
                f"data_world_size={dws}; pass one or the other"
            )
        return dws
    dws = 1 if data_world_size is None else data_world_size
    if not is_int(dws) or dws < 1:
        raise ValueError(f"data_world_size must be a positive integer, got {dws!r}")
    return int(dws)


def _check_batch_size(batch_size: int, dws: int) -> None:
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if batch_size % dws:
        raise ValueError(
            f"batch_size={batch_size} (the global batch) must be divisible by the data world "
            f"size {dws}; e.g. batch_size={dws * max(1, batch_size // dws)} gives every data rank "
            f"{max(1, batch_size // dws)} item(s)"
        )


def batch_bounds(n: int, batch_size: int, data_world_size: int, drop_last: bool) -> list[tuple[int, int]]:
    """``[start, stop)`` of every batch of one epoch over ``n`` items (see the module doc).

    >>> batch_bounds(10, 4, 2, drop_last=False)
    [(0, 4), (4, 8), (8, 10)]
    >>> batch_bounds(9, 4, 2, drop_last=False)     # a 1-item tail merges into the last batch
    [(0, 4), (4, 9)]
    >>> batch_bounds(9, 4, 2, drop_last=True)
    [(0, 4), (4, 8)]
    """
    full, rest = divmod(n, batch_size)
    bounds = [(i * batch_size, (i + 1) * batch_size) for i in range(full)]
    if rest and not drop_last:
        if rest >= data_world_size:
            bounds.append((full * batch_size, n))
        elif bounds:
            bounds[-1] = (bounds[-1][0], n)
        else:
            raise ValueError(
                f"only {n} item(s): fewer than the data world size {data_world_size}, so not even "
                f"one batch can be split over the data ranks"
            )
    return bounds


class DeviceMeshSampler:
    """Index batches for ``num_items`` items, laid out for a mesh's data ranks.

    Args:
        num_items: dataset length.
        batch_size: global batch size (all data ranks); divisible by the data world size.
        device_mesh: a mesh whose ``data_world_size`` is used (or pass ``data_world_size``).
        shuffle: draw a fresh permutation per epoch from ``(seed, epoch)``.
        seed: shuffle seed.
        drop_last: drop the epoch's incomplete last batch.

    Iterating yields lists of indices (global batches) from the current
    position; ``rank_part(batch, d)`` / ``rank_batches(d)`` give one data
    rank's view. Every index appears exactly once per epoch across all data
    ranks (minus the dropped tail with ``drop_last``).

    >>> s = DeviceMeshSampler(6, batch_size=2, data_world_size=2, shuffle=True, seed=1)
    >>> first = next(iter(s)); state = s.state_dict()
    >>> t = DeviceMeshSampler(6, batch_size=2, data_world_size=2, shuffle=True, seed=1)
    >>> t.load_state_dict(state)
    >>> list(t) == list(s)
    True
    """

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        *,
        device_mesh: Any = None,
        data_world_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ):
        if not is_int(num_items) or num_items < 0:
            raise ValueError(f"num_items must be a non-negative integer, got {num_items!r}")
        self.data_world_size = _data_world_size(data_world_size, device_mesh)
        _check_batch_size(batch_size, self.data_world_size)
        num_items, batch_size = int(num_items), int(batch_size)
        self.device_mesh = device_mesh
        self.num_items = num_items
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self._bounds = batch_bounds(num_items, batch_size, self.data_world_size, drop_last)
        if not self._bounds:
            logger.warning(
                "DeviceMeshSampler: %d item(s) with batch_size=%d and drop_last=%s give no batch",
                num_items, batch_size, drop_last,
            )
        self.epoch = 0
        self.step = 0
        self._order: tuple[int, np.ndarray] | None = None

    # -- one epoch ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._bounds)

    @property
    def per_rank_batch_size(self) -> int:
        """Items each data rank gets from a full batch."""
        return self.batch_size // self.data_world_size

    def order(self, epoch: int) -> np.ndarray:
        """The item order of ``epoch`` (a permutation when shuffling)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        if self.shuffle:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            order = rng.permutation(self.num_items)
        else:
            order = np.arange(self.num_items)
        self._order = (epoch, order)
        return order

    def batch(self, epoch: int, step: int) -> list[int]:
        """The global batch ``step`` of ``epoch`` (indices, rank-contiguous)."""
        start, stop = self._bounds[step]
        return self.order(epoch)[start:stop].tolist()

    def current_data_rank(self) -> int:
        """The data rank of this process: ``device_mesh.data_rank`` (the mesh's one rule,
        Twinkle's ``dp_rank * fsdp_world_size + fsdp_rank`` on a ``from_sizes`` mesh),
        0 when the data world size is 1.

        Raises ``ValueError`` without a mesh (or outside it) when there are several data ranks.
        """
        if self.data_world_size == 1:
            return 0
        rank = None if self.device_mesh is None else self.device_mesh.data_rank
        if rank is None:
            raise ValueError(
                f"DeviceMeshSampler: which of the {self.data_world_size} data ranks is this "
                f"process? "
                + ("Pass data_rank= (the sampler has no device_mesh)" if self.device_mesh is None
                   else "This process's rank is not in the device mesh; pass data_rank=")
            )
        return int(rank)

    def rank_part(self, batch: Sequence[T], data_rank: int | None = None) -> list[T]:
        """Data rank ``data_rank``'s part of a global batch (== ``mesh.get_slice``).

        Without ``data_rank``: this process's (:meth:`current_data_rank`), as
        Twinkle's sampler slices ``batch[device_mesh.get_slice(len(batch))]``.
        """
        if data_rank is None:
            data_rank = self.current_data_rank()
        if not 0 <= data_rank < self.data_world_size:
            raise ValueError(f"data rank {data_rank} is out of range for data world size {self.data_world_size}")
        start, stop = span(len(batch), self.data_world_size, data_rank)
        return list(batch[start:stop])

    def rank_batches(self, data_rank: int | None = None, epoch: int | None = None) -> Iterator[list[int]]:
        """One data rank's batches of ``epoch`` (default: the current one), from step 0.

        ``data_rank`` defaults to this process's (:meth:`current_data_rank`).
        Does not move the sampler's position.
        """
        if data_rank is None:
            data_rank = self.current_data_rank()
        e = self.epoch if epoch is None else epoch
        for step in range(len(self)):
            yield self.rank_part(self.batch(e, step), data_rank)

    # -- position -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        """Global batches from the current (epoch, step) to the end of that epoch.

        The position moves as batches are handed out; the end of the epoch
        moves it to (epoch + 1, 0).
        """
        self._normalise()
        epoch = self.epoch
        while self.epoch == epoch and self.step < len(self):
            batch = self.batch(epoch, self.step)
            self.step += 1
            yield batch
        if self.epoch == epoch:
            self.epoch, self.step = epoch + 1, 0

    def _normalise(self) -> None:
        if self.step >= len(self) and len(self):
            self.epoch, self.step = self.epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (like torch's ``DistributedSampler.set_epoch``)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch, self.step = int(epoch), 0

    def skip(self, steps: int) -> None:
        """Move the position ``steps`` batches on, across epoch ends."""
        if steps < 0:
            raise ValueError(f"cannot skip a negative number of steps ({steps})")
        n = len(self)
        if n == 0:
            return
        total = self.epoch * n + self.step + steps
        self.epoch, self.step = divmod(total, n)

    def state_dict(self) -> dict[str, Any]:
        """The position and the settings that define the order (for checking on load)."""
        self._normalise()
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "data_world_size": self.data_world_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``; raises ValueError if it describes another order."""
        for key in ("seed", "shuffle", "num_items", "batch_size", "data_world_size", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume: the saved state has {key}={state[key]!r} but this sampler "
                    f"has {key}={getattr(self, key)!r}"
                )
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._normalise()

    def __repr__(self) -> str:
        return (
            f"DeviceMeshSampler(num_items={self.num_items}, batch_size={self.batch_size}, "
            f"data_world_size={self.data_world_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch}, step={self.step})"
        )


class StreamBatcher:
    """Global batches from a stream of unknown length, with the same tail rules.

    For sources that cannot be indexed (a Ray Data dataset read in a
    stream): items are grouped ``batch_size`` at a time; one batch is held
    back so that a tail smaller than the data world size can be merged into
    it. ``skip`` items are discarded first (resuming inside an epoch).

    >>> list(StreamBatcher(4, data_world_size=2).batches(range(9)))
    [[0, 1, 2, 3], [4, 5, 6, 7, 8]]
    >>> list(StreamBatcher(4, data_world_size=2, drop_last=True).batches(range(9)))
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """

    def __init__(
        self,
        batch_size: int,
        *,
        device_mesh: Any = None,
        data_world_size: int | None = None,
        drop_last: bool = False,
    ):
        self.data_world_size = _data_world_size(data_world_size, device_mesh)
        _check_batch_size(batch_size, self.data_world_size)
        self.batch_size = int(batch_size)
        self.drop_last = drop_last

    def batches(self, items: Iterable[T], skip: int = 0) -> Iterator[list[T]]:
        """Yield global batches of ``items`` after discarding the first ``skip`` items."""
        it = iter(items)
        for _ in range(skip):
            if next(it, _END) is _END:
                return
        held: list[T] | None = None
        current: list[T] = []
        for item in it:
            current.append(item)
            if len(current) == self.batch_size:
                if held is not None:
                    yield held
                held, current = current, []
        if current and not self.drop_last:
            if len(current) >= self.data_world_size:
                if held is not None:
                    yield held
                held = current
            elif held is not None:
                held = held + current
            else:
                raise ValueError(
                    f"only {len(current)} item(s) left: fewer than the data world size "
                    f"{self.data_world_size}, so they cannot be split over the data ranks"
                )
        if held is not None:
            yield held


_END = object()
