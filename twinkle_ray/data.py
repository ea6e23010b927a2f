"""DataLoader: global batches for a mesh's data ranks, from a sequence or a Ray Data dataset.

Built as ``@remote_class(execute='first')``: on a group it runs in one worker
(the group's first), and the driver iterates it. Each batch is a LazyResult
that stays in the loader's worker until a gang consumes it; passed to a
``slice_dp`` method of a dp=N gang, every data rank pulls exactly its part
straight from the loader's object store. The end of an epoch is a clean
``StopIteration``.

Batches follow :class:`~twinkle_ray.sampler.DeviceMeshSampler`: ``batch_size``
is the global batch (all data ranks), divisible by the data world size; a
batch is laid out rank-contiguously, so rank ``d``'s part is
``mesh.get_slice(len(batch), d)``. See the sampler for the tail rules.

Sources:

- a sequence (``len`` + indexing), or a zero-argument callable returning one
  (built inside the loader's worker, so the data never passes the driver);
- a Ray Data ``Dataset``: read as a stream (``iter_batches``), so a dataset
  larger than memory works; shuffling is Ray Data's local shuffle buffer
  (seeded per epoch), and the execution order is pinned (``preserve_order``)
  so that a resumed epoch skips exactly the rows already served.

Example::

    import twinkle_ray as twinkle
    from twinkle_ray import DeviceGroup, DeviceMesh
    from twinkle_ray.data import DataLoader

    twinkle.initialize("ray", groups=[DeviceGroup("data", 1, "cpu"), DeviceGroup("actor", 2, "cpu")])
    mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    loader = DataLoader(list(range(100)), batch_size=8, device_mesh=mesh, shuffle=True,
                        remote_group="data")
    for batch in loader:            # LazyResult, still in the loader's worker
        actor.step(batch)           # a slice_dp method: each dp rank gets 4 items
    state = loader.state_dict()     # {'epoch': 1, 'step': 0, ...}
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .core.batch import span
from .core.functions import remote_function
from .core.sampler import DeviceMeshSampler, StreamBatcher, batch_bounds
from .runtime.remote import remote_class

logger = logging.getLogger(__name__)

__all__ = ["DataLoader"]


def _is_ray_dataset(obj: Any) -> bool:
    cls = type(obj)
    return cls.__name__ in ("Dataset", "MaterializedDataset") and cls.__module__.startswith("ray.data")


def _stream_seed(seed: int, epoch: int) -> int:
    import numpy as np

    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


@remote_class(execute="first")
class DataLoader:
    """Global batches of a dataset for a mesh's data ranks; iterable, resumable.

    Args:
        dataset: a sequence, a zero-argument callable returning one, or a Ray Data Dataset.
        batch_size: global batch size; divisible by the data world size.
        device_mesh: the consumers' mesh (its ``data_world_size`` is used), or
        data_world_size: that number directly (default 1).
        shuffle: shuffle each epoch (seeded by ``(seed, epoch)``).
        seed: shuffle seed.
        drop_last: drop each epoch's incomplete last batch.
        collate_fn: applied to each batch (a list of items); default: the list itself.
        data_rank: yield only this data rank's part of each batch (a loader
            built inside a worker of a dp gang); default: the whole global batch.
        shuffle_buffer_size: Ray Data sources: local shuffle buffer (rows)
            when ``shuffle`` (default ``4 * batch_size``).

    The position (epoch, step) is the loader's state: iterating continues from
    it, a finished epoch moves to the next one, ``state_dict()`` /
    ``load_state_dict()`` save and restore it, ``set_epoch(e)`` and
    ``skip(steps)`` move it.

    >>> loader = DataLoader(list("abcdefg"), batch_size=2, data_world_size=2)
    >>> [b for b in loader]          # the 1-item tail merges into the last batch
    [['a', 'b'], ['c', 'd'], ['e', 'f', 'g']]
    >>> loader.state_dict()["epoch"]
    1
    """

    def __init__(
        self,
        dataset: Sequence | Callable[[], Sequence] | Any,
        *,
        batch_size: int,
        device_mesh: Any = None,
        data_world_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list], Any] | None = None,
        data_rank: int | None = None,
        shuffle_buffer_size: int | None = None,
    ):
        if callable(dataset) and not _is_ray_dataset(dataset) and not hasattr(dataset, "__getitem__"):
            dataset = dataset()
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.shuffle = shuffle
        self.seed = int(seed)
        self.shuffle_buffer_size = shuffle_buffer_size or 4 * batch_size
        self._iter: Iterator[list] | None = None
        self.streaming = _is_ray_dataset(dataset)
        if self.streaming:
            self._batcher = StreamBatcher(
                batch_size, device_mesh=device_mesh, data_world_size=data_world_size, drop_last=drop_last
            )
            self.data_world_size = self._batcher.data_world_size
            self.epoch, self.step = 0, 0
            self._sampler = None
            self._pin_order()
        else:
            if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
                raise TypeError(
                    f"DataLoader: dataset must be a sequence (len + indexing), a callable returning "
                    f"one, or a ray.data.Dataset; got {type(dataset).__name__}"
                )
            self._sampler = DeviceMeshSampler(
                len(dataset), batch_size, device_mesh=device_mesh, data_world_size=data_world_size,
                shuffle=shuffle, seed=seed, drop_last=drop_last,
            )
            self.data_world_size = self._sampler.data_world_size
        if data_rank is not None and not 0 <= data_rank < self.data_world_size:
            raise ValueError(f"data_rank {data_rank} is out of range for data world size {self.data_world_size}")
        self.data_rank = data_rank
        # an int (a numpy one too): the sampler's or batcher's, checked there
        self.batch_size = (self._batcher if self._sampler is None else self._sampler).batch_size

    def _pin_order(self) -> None:
        # A resumed epoch skips the rows already served: the stream's order must repeat.
        try:
            self.dataset.context.execution_options.preserve_order = True
        except AttributeError:  # an older Ray without Dataset.context: order as Ray gives it
            logger.warning("DataLoader: cannot pin the Ray Data execution order; resume may not be exact")

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> DataLoader:
        """Restart iteration at the current position (the rest of the current epoch)."""
        self._iter = self._batches()
        return self

    def __next__(self) -> Any:
        """The next batch (collated); StopIteration at the end of the epoch."""
        if self._iter is None:
            self._iter = self._batches()
        try:
            batch = next(self._iter)
        except StopIteration:
            self._iter = None
            raise
        if self.data_rank is not None:
            start, stop = span(len(batch), self.data_world_size, self.data_rank)
            batch = batch[start:stop]
        return self.collate_fn(batch) if self.collate_fn is not None else batch

    def _batches(self) -> Iterator[list]:
        if self._sampler is not None:
            data = self.dataset
            for indices in self._sampler:
                yield [data[i] for i in indices]
            return
        epoch = self.epoch
        rows = self._stream_rows(epoch)
        for batch in self._batcher.batches(rows, skip=self.step * self.batch_size):
            self.step += 1
            yield batch
        if self.epoch == epoch:
            self.epoch, self.step = epoch + 1, 0

    def _stream_rows(self, epoch: int) -> Iterator[dict]:
        """Rows of the Ray Data source, streamed (plain dicts)."""
        kwargs: dict[str, Any] = {"batch_size": max(self.batch_size, 64), "batch_format": "pyarrow"}
        if self.shuffle:
            kwargs["local_shuffle_buffer_size"] = self.shuffle_buffer_size
            kwargs["local_shuffle_seed"] = _stream_seed(self.seed, epoch)
        for table in self.dataset.iter_batches(**kwargs):
            yield from table.to_pylist()

    def __len__(self) -> int:
        """Batches per epoch (a Ray Data source is counted once; that may read it)."""
        if self._sampler is not None:
            return len(self._sampler)
        if not hasattr(self, "_num_batches"):
            n = self.dataset.count()
            self._num_batches = len(batch_bounds(n, self.batch_size, self.data_world_size, self._batcher.drop_last))
        return self._num_batches

    # -- position -------------------------------------------------------------------------------
    @remote_function(sync=True)
    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, step) and the settings that define the order."""
        if self._sampler is not None:
            return self._sampler.state_dict()
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "data_world_size": self.data_world_size,
                "drop_last": self._batcher.drop_last,
                "shuffle_buffer_size": self.shuffle_buffer_size}

    @remote_function(sync=True)
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()`` (the next batch is the one after the saved step)."""
        self._iter = None
        if self._sampler is not None:
            self._sampler.load_state_dict(state)
            return
        checked = [("seed", self.seed), ("shuffle", self.shuffle), ("batch_size", self.batch_size),
                   ("data_world_size", self.data_world_size), ("drop_last", self._batcher.drop_last)]
        if self.shuffle:  # the buffer's size decides the shuffled order
            checked.append(("shuffle_buffer_size", self.shuffle_buffer_size))
        for key, mine in checked:
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume: the saved state has {key}={state[key]!r}, this loader {mine!r}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    @remote_function(sync=True)
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch."""
        self._iter = None
        if self._sampler is not None:
            self._sampler.set_epoch(epoch)
        else:
            if epoch < 0:
                raise ValueError(f"epoch must be >= 0, got {epoch}")
            self.epoch, self.step = int(epoch), 0

    @remote_function(sync=True)
    def skip(self, steps: int) -> None:
        """Move ``steps`` batches on. A sequence source may cross epoch ends; a stream may not:
        skipping past its epoch's last batch is a ValueError (the stream is counted once, see
        ``len()``), and skipping to its end starts the next epoch, as iterating there does."""
        self._iter = None
        if self._sampler is not None:
            self._sampler.skip(steps)
        else:
            if steps < 0:
                raise ValueError(f"cannot skip a negative number of steps ({steps})")
            n = len(self)
            if self.step + steps > n:
                raise ValueError(
                    f"DataLoader.skip({steps}): at step {self.step} of epoch {self.epoch}, a streamed "
                    f"epoch of {n} batch(es) has only {n - self.step} left; a stream is not skipped "
                    f"across an epoch's end (set_epoch() starts another epoch)")
            self.step += steps
            if self.step == n:
                self.epoch, self.step = self.epoch + 1, 0
