"""The split rules: how the arguments of one call become each worker's ``(args, kwargs)``.

One job: :func:`dispatch` builds every worker's arguments under a dispatch mode, and
:func:`split_arg` cuts one value for one worker (a :class:`Split`) -- the one rule that
dispatch applies to every argument and routing applies to a LazyResult's value.

- ``'slice'``: every top-level ``list`` argument is split contiguously over the workers
  (10 items over 4 workers -> 3, 3, 2, 2); other values go whole to every worker.
- ``'all'`` (and ``'balance'``, whose chunks are handed out while the call runs): every
  worker gets everything.
- ``'slice_dp'``: lists, tuples, numpy arrays and torch tensors are split along dim 0 by
  the worker's *data-parallel rank* (from the device mesh); dicts are split key by key;
  scalars are replicated. Workers with the same data rank (tp / pp / cp peers) get the
  very same objects, so a runtime can serialise a slice once per data rank. The slice of a
  data rank is the contiguous divmod split that ``mesh.get_slice`` defines, computed here
  from the data rank, so it does not depend on whether a mesh's ``get_slice`` takes a data
  rank (Twinkle) or a global rank.
- a callable ``fn(n_workers, i, args, kwargs, device_mesh) -> (args, kwargs)``
  (:func:`dispatch_one`).

When only some workers run a call (``execute='peer'``) the items are cut over those
(:func:`runner_splits`). Every check runs before anything is cut. Pure module: numpy only,
no Ray.

Example: 2 data ranks of a tp=2 mesh; tp peers get the very same part::

    >>> from twinkle_ray.core.mesh import DeviceMesh
    >>> tp2 = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    >>> calls = dispatch('slice_dp', 4, ({'ids': [1, 2, 3]},), {}, device_mesh=tp2)
    >>> [a[0]['ids'] for a, _ in calls], calls[0] is calls[1]
    ([[1, 2], [1, 2], [3], [3]], True)
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .batch import View, batch_len, is_sliceable, span, take
from .modes import check_dispatch, where
from .worker_ranks import worker_data_ranks

__all__ = [
    'Split',
    'dispatch',
    'dispatch_one',
    'is_list',
    'runner_splits',
    'slice_length',
    'split_arg',
    'worker_splits',
]

WorkerArgs = tuple[tuple, dict]  # one worker's (args, kwargs)


def _arg_name(position: int | str) -> str:
    return f'argument {position}' if isinstance(position, int) else f'argument {position!r}'


def _too_small(method: str, group: str, n: int, dp: int, location: str, note: str = '') -> ValueError:
    return ValueError(
        f'{where(method, group)}: batch of {n} items is smaller than the data-parallel size '
        f'{dp} ({location}{note}); pass at least {dp} items or use dispatch=\'all\''
    )


def _named_args(args: tuple, kwargs: dict):
    yield from enumerate(args)
    yield from kwargs.items()


def _cut_call(cut: Split, args: tuple, kwargs: dict) -> WorkerArgs:
    """One worker's ``(args, kwargs)``: every argument cut by :func:`split_arg`."""
    return (tuple(split_arg(cut, v, _arg_name(p)) for p, v in enumerate(args)),
            {k: split_arg(cut, v, _arg_name(k)) for k, v in kwargs.items()})


class Split(NamedTuple):
    """How one worker's part of a sliced argument is cut: part ``index`` of ``parts``.

    ``mode`` is the dispatch mode: ``'slice_dp'`` cuts every list, tuple, array and tensor
    (dicts key by key) by its own length, ``parts`` being the data-parallel size and
    ``index`` the worker's data rank; ``'slice'`` cuts a top-level ``list`` only, over the
    ``parts`` workers. ``slice_len``: under ``'slice'``, the length every list argument of the
    call must have (they are cut the same way), None when no other argument sets it.
    ``method`` and ``group`` are named in errors.

    Example::

        >>> split_arg(Split('slice_dp', 2, 1), {'ids': [1, 2, 3], 't': 0.5}, 'argument 0')
        {'ids': [3], 't': 0.5}
    """

    mode: str
    parts: int
    index: int
    method: str = '?'
    group: str = '?'
    slice_len: int | None = None


def split_arg(split: Split, value: Any, location: str) -> Any:
    """The worker's part of one argument ``value`` (``location`` names it in errors): the one
    rule that :func:`dispatch` applies to every argument, and routing to a LazyResult's value.

    ValueError for a batch smaller than ``split.parts`` (every type), and under ``'slice'``
    for a list whose length is not ``split.slice_len``.
    """
    if split.mode == 'slice':
        if not is_list(value):
            return value
        n = batch_len(value)
        if split.slice_len is not None and n != split.slice_len:
            raise ValueError(
                f"{where(split.method, split.group)}: dispatch='slice' splits every list argument "
                f'the same way, but their lengths differ ({location}: {n}; the others: '
                f'{split.slice_len})')
        if n < split.parts:
            raise _too_small(split.method, split.group, n, split.parts, location,
                             note=f"; dispatch='slice' over {split.parts} workers")
        return take(value, *span(n, split.parts, split.index))
    _check_dp_sizes(value, split.parts, location, split.method, split.group)
    return _split_dp(value, lambda n: span(n, split.parts, split.index))


def is_list(value: Any) -> bool:
    """A ``list`` (or a view of one): what ``'slice'`` cuts.

    >>> is_list([1]), is_list((1,))
    (True, False)
    """
    return isinstance(value, list) or (isinstance(value, View) and value.kind == 'list')


def _check_dp_sizes(value: Any, dp: int, location: str, method: str, group: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _check_dp_sizes(item, dp, f'{location} key {key!r}', method, group)
    elif is_sliceable(value):
        n = batch_len(value)
        if n < dp:
            raise _too_small(method, group, n, dp, location)


def _split_dp(value: Any, window: Callable[[int], tuple[int, int]]) -> Any:
    if isinstance(value, dict):
        split = {k: _split_dp(v, window) for k, v in value.items()}
        # Nothing sliced inside: hand on the caller's dict itself (no copy per worker).
        if all(split[k] is value[k] for k in value):
            return value
        if type(value) is dict:
            return split
        out = copy.copy(value)  # a dict subclass keeps its type (OrderedDict, defaultdict)
        out.update(split)
        return out
    if is_sliceable(value):
        return take(value, *window(batch_len(value)))
    return value


def slice_length(lengths: dict[str, int], method: str = '?', group: str = '?') -> int | None:
    """The one length of the list arguments a ``'slice'`` call cuts (``lengths``: by argument
    name), None without any; ValueError naming each when they differ.

    >>> slice_length({'argument 0': 4, "argument 'b'": 4})
    4
    """
    distinct = set(lengths.values())
    if len(distinct) > 1:
        found = ', '.join(f'{name}: {n}' for name, n in lengths.items())
        raise ValueError(
            f"{where(method, group)}: dispatch='slice' splits every list argument the same way, "
            f'but their lengths differ ({found})'
        )
    return distinct.pop() if distinct else None


def dispatch(
    mode: str | Callable,
    n_workers: int,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    *,
    device_mesh: Any = None,
    gpus_per_worker: int = 1,
    method: str = '?',
    group: str = '?',
    runners: Sequence[int] | None = None,
) -> list[WorkerArgs]:
    """Build the ``(args, kwargs)`` of every worker for one call.

    Args:
        mode: ``'slice'``, ``'all'``, ``'slice_dp'`` or ``fn(n_workers, i, args, kwargs, device_mesh)``.
        n_workers: number of workers in the gang (worker ``i`` is the i-th of them).
        args, kwargs: the call's arguments; never modified.
        device_mesh: the gang's mesh (used by ``'slice_dp'``; ``None`` means plain dp over
            the workers).
        gpus_per_worker: worker ``i`` is global mesh rank ``i * gpus_per_worker``.
        method, group: named in error messages.
        runners: the workers that run the call (``execute='peer'``:
            :func:`~twinkle_ray.core.worker_ranks.call_targets`); every worker when None. The
            arguments are cut over the runners only, so every item runs exactly once (see
            :func:`runner_splits`); the entries of the workers that do not run repeat the
            first runner's.

    Returns:
        ``n_workers`` tuples ``(args_tuple, kwargs_dict)``, in worker order.  Workers that get
        the same data share the same tuple object.

    Raises:
        ValueError: unknown mode; a batch smaller than the data-parallel size (for every
            sliced type, before anything runs); list arguments of different lengths under
            ``'slice'``; workers that fall outside the mesh or leave data ranks without a worker.
        TypeError: a dispatch function that does not return ``(args, kwargs)``.

    Example::

        >>> calls = dispatch('slice', 4, (list(range(10)), 'greedy'), {}, method='sample', group='sampler')
        >>> [len(a[0]) for a, _ in calls], calls[3][0][1]
        ([3, 3, 2, 2], 'greedy')
    """
    check_dispatch(mode)
    if not isinstance(n_workers, numbers.Integral) or n_workers < 1:
        raise ValueError(f'{where(method, group)}: need at least one worker, got n_workers={n_workers!r}')
    if gpus_per_worker < 1:
        raise ValueError(f'{where(method, group)}: gpus_per_worker must be >= 1, got {gpus_per_worker}')
    args = tuple(args)
    kwargs = dict(kwargs or {})

    runners = _check_runners(runners, n_workers, method, group)

    if not isinstance(mode, str):
        return _dispatch_callable(mode, n_workers, runners, args, kwargs, device_mesh, method, group)
    if mode in ('all', 'balance'):  # balance: chunks are handed out while the call runs (core.balance)
        shared = (args, kwargs)
        return [shared] * n_workers
    if mode == 'slice':
        return _dispatch_slice(n_workers, runners, args, kwargs, method, group)
    return _dispatch_slice_dp(n_workers, runners, args, kwargs, device_mesh, gpus_per_worker,
                              method, group)


def _check_runners(runners: Sequence[int] | None, n_workers: int, method: str,
                   group: str) -> list[int]:
    if runners is None:
        return list(range(n_workers))
    runners = [int(r) for r in runners]
    if not runners or len(set(runners)) != len(runners) or not all(0 <= r < n_workers for r in runners):
        raise ValueError(f'{where(method, group)}: the workers that run a call must be distinct '
                         f'ranks of the {n_workers} worker(s), got {runners}')
    return runners


def _fill(n_workers: int, runners: list[int], per_runner: list) -> list:
    """Per-worker entries from the runners' (the others repeat the first runner's)."""
    out = [per_runner[0]] * n_workers
    for r, item in zip(runners, per_runner, strict=True):
        out[r] = item
    return out


def runner_splits(mode: str, n_workers: int, runners: Sequence[int] | None = None, *,
                  device_mesh: Any = None, gpus_per_worker: int = 1, method: str = '?',
                  group: str = '?') -> list[Split]:
    """Each runner's :class:`Split` under ``'slice'`` or ``'slice_dp'``, in ``runners`` order.

    The one rule for who gets which items when only some workers run a call
    (``execute='peer'``), Twinkle's: the caller's items are cut over the runners, as if they
    were the whole gang. ``'slice'``: runner ``j`` of ``k`` gets piece ``j``. ``'slice_dp'``:
    the distinct data ranks of the runners, in ascending order, share the items (piece ``p``
    to the ``p``-th of them); tp/pp peers of a data rank get the same piece. With every worker
    running, this is the plain dispatch rule.

    >>> [(s.parts, s.index) for s in runner_splits('slice', 4, [2, 3])]
    [(2, 0), (2, 1)]
    >>> [(s.parts, s.index) for s in runner_splits('slice_dp', 4, [1, 3])]
    [(2, 0), (2, 1)]
    """
    runners = _check_runners(runners, n_workers, method, group)
    if mode == 'slice':
        return [Split('slice', len(runners), j, method, group) for j in range(len(runners))]
    if mode != 'slice_dp':
        raise ValueError(f"{where(method, group)}: runner_splits cuts under 'slice' or "
                         f"'slice_dp', not {mode!r}")
    _, data_ranks = worker_data_ranks(n_workers, device_mesh, gpus_per_worker, method, group)
    ours = sorted({data_ranks[r] for r in runners})
    return [Split('slice_dp', len(ours), ours.index(data_ranks[r]), method, group) for r in runners]


def worker_splits(mode: Any, n_workers: int, *, device_mesh: Any = None, gpus_per_worker: int = 1,
                  method: str = '?', group: str = '?',
                  runners: Sequence[int] | None = None) -> list[Split | None]:
    """Each worker's :class:`Split` under dispatch ``mode`` (None for a mode that cuts nothing
    by itself: ``'all'``, ``'balance'``, a callable): how a value routed to it is cut.
    ``runners``: the workers that run the call (see :func:`runner_splits`); the others'
    entries repeat the first runner's.

    >>> [s.index for s in worker_splits('slice_dp', 4, device_mesh=None)]
    [0, 1, 2, 3]
    """
    if mode in ('slice', 'slice_dp'):
        runners = _check_runners(runners, n_workers, method, group)
        return _fill(n_workers, runners, runner_splits(
            mode, n_workers, runners, device_mesh=device_mesh, gpus_per_worker=gpus_per_worker,
            method=method, group=group))
    return [None] * n_workers


def _dispatch_callable(fn, n_workers, runners, args, kwargs, device_mesh, method,
                       group) -> list[WorkerArgs]:
    k = len(runners)
    return _fill(n_workers, runners, [dispatch_one(fn, k, j, args, kwargs, device_mesh, method, group)
                                      for j in range(k)])


def dispatch_one(fn: Callable, n_workers: int, i: int, args: tuple, kwargs: dict,
                 device_mesh: Any = None, method: str = '?', group: str = '?') -> WorkerArgs:
    """Worker ``i``'s ``(args, kwargs)`` under a dispatch function ``fn(n_workers, i, args,
    kwargs, device_mesh)``; TypeError naming it unless it returns a tuple and a dict.

    >>> dispatch_one(lambda n, i, a, kw, m: (a[i::n], kw), 2, 1, (0, 1, 2, 3), {})
    ((1, 3), {})
    """
    name = getattr(fn, '__qualname__', None) or repr(fn)
    produced = fn(n_workers, i, args, dict(kwargs), device_mesh)
    if (
        not isinstance(produced, (tuple, list))
        or len(produced) != 2
        or not isinstance(produced[0], (tuple, list))
        or not isinstance(produced[1], dict)
    ):
        raise TypeError(
            f'{where(method, group)}: dispatch function {name} must return (args, kwargs) '
            f'with a tuple and a dict; for worker {i} it returned {type(produced).__name__} '
            f'{_short_repr(produced)}'
        )
    return tuple(produced[0]), dict(produced[1])


def _short_repr(obj: Any, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + '...'


def _dispatch_slice(n_workers, runners, args, kwargs, method, group) -> list[WorkerArgs]:
    lengths = {_arg_name(p): len(v) for p, v in _named_args(args, kwargs) if isinstance(v, list)}
    if not lengths:
        shared = (args, kwargs)
        return [shared] * n_workers
    n = slice_length(lengths, method, group)
    out = []
    for split in runner_splits('slice', n_workers, runners, method=method, group=group):
        cut = split._replace(slice_len=n)
        out.append(_cut_call(cut, args, kwargs))
    return _fill(n_workers, runners, out)


def _dispatch_slice_dp(n_workers, runners, args, kwargs, mesh, gpus_per_worker, method,
                       group) -> list[WorkerArgs]:
    splits = runner_splits('slice_dp', n_workers, runners, device_mesh=mesh,
                           gpus_per_worker=gpus_per_worker, method=method, group=group)
    for position, value in _named_args(args, kwargs):  # every argument checked before any is cut
        _check_dp_sizes(value, splits[0].parts, _arg_name(position), method, group)
    by_split: dict[Split, WorkerArgs] = {}
    out = []
    for cut in splits:
        call = by_split.get(cut)
        if call is None:  # == mesh.get_slice(n, <data rank>): contiguous divmod split by data rank
            call = by_split[cut] = _cut_call(cut, args, kwargs)
        out.append(call)
    return _fill(n_workers, runners, out)
