"""How call arguments reach the workers of a gang and how their results come back.

Pure module: numpy only, no Ray. torch is never imported here; a value is a tensor
only if torch is already imported by the caller (``sys.modules``), so the module
works (and stays cheap to import) on machines without torch.

Dispatch modes (how ``(args, kwargs)`` of one call become one ``(args, kwargs)`` per
worker):

- ``'slice'``: every top-level ``list`` argument is split contiguously over the workers
  (10 items over 4 workers -> 3, 3, 2, 2); other values go whole to every worker.
- ``'all'``: every worker gets everything.
- ``'slice_dp'``: lists, tuples, numpy arrays and torch tensors are split along dim 0 by
  the worker's *data-parallel rank* (from the device mesh); dicts are split key by key;
  scalars are replicated.  Workers with the same data rank (tp / pp / cp peers) get the
  very same objects, so a runtime can serialise a slice once per data rank.
- a callable ``fn(n_workers, i, args, kwargs, device_mesh) -> (args, kwargs)``.

Collect modes (how the per-worker results of one call become one value): ``'none'``,
``'flatten'``, ``'mean'``, ``'sum'``, ``'first'``, ``'last_pp'``, ``'last_pp_first'`` or a
callable ``fn(results, device_mesh)``.  Results that are all tuples of one length (a method with
several return values) are collected element-wise.

The device mesh is duck-typed; what is used of it: ``data_world_size``, ``world_size``,
``get_data_rank_from_global_rank(g)`` and ``get_pp_last_ranks()``.  The slice of a data
rank is the contiguous divmod split that ``mesh.get_slice`` defines (the first
``n % data_world_size`` data ranks get one more item); it is computed here from the data
rank, so it does not depend on whether a mesh's ``get_slice`` takes a data rank (Twinkle)
or a global rank.
"""

from __future__ import annotations

import copy
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    'COLLECT_MODES',
    'DISPATCH_MODES',
    'EXECUTE_MODES',
    'Split',
    'View',
    'batch_len',
    'call_targets',
    'check_collect',
    'check_dispatch',
    'check_execute',
    'collect',
    'collect_sources',
    'concat',
    'dispatch',
    'dispatch_one',
    'elementwise',
    'peer_workers',
    'runner_splits',
    'slice_length',
    'split_arg',
    'worker_splits',
    'split_sizes',
    'take',
    'worker_global_rank',
]

DISPATCH_MODES = ('slice', 'all', 'slice_dp', 'balance')
EXECUTE_MODES = ('all', 'first', 'peer')
COLLECT_MODES = ('none', 'flatten', 'mean', 'sum', 'first', 'last_pp', 'last_pp_first')

WorkerArgs = tuple[tuple, dict]  # one worker's (args, kwargs)


# --------------------------------------------------------------------------- checks


def _check_mode(kind: str, mode: Any, allowed: tuple[str, ...], allow_callable: bool) -> None:
    if isinstance(mode, str):
        if mode in allowed:
            return
    elif allow_callable and callable(mode):
        return
    choices = ', '.join(repr(m) for m in allowed)
    extra = ' or a callable' if allow_callable else ''
    raise ValueError(f'unknown {kind} mode {mode!r}; expected one of {choices}{extra}')


def check_dispatch(mode: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is a known dispatch mode or a callable.

    Example::

        >>> check_dispatch('slice_dp')
        >>> check_dispatch('split')
        Traceback (most recent call last):
        ValueError: unknown dispatch mode 'split'; expected one of 'slice', 'all', 'slice_dp', 'balance' or a callable
    """
    _check_mode('dispatch', mode, DISPATCH_MODES, allow_callable=True)


def check_execute(mode: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of :data:`EXECUTE_MODES`.

    Example::

        >>> check_execute('first')
    """
    _check_mode('execute', mode, EXECUTE_MODES, allow_callable=False)


def check_collect(mode: Any) -> None:
    """Raise ``ValueError`` unless ``mode`` is a known collect mode or a callable.

    Example::

        >>> check_collect('last_pp')
        >>> check_collect(lambda results, mesh: results[-1])
    """
    _check_mode('collect', mode, COLLECT_MODES, allow_callable=True)


def call_targets(execute: str, caller: tuple[int, int] | None, n: int, device_mesh: Any = None,
                 gpus_per_worker: int = 1) -> list[int]:
    """The gang ranks that run a call with this ``execute`` mode on a gang of ``n``.

    ``'peer'``, when a worker of another gang calls (rank, world size ``caller``): whole
    data-parallel groups of this gang (every worker of a data rank: its tp/pp peers run a
    call together or not at all). :func:`peer_workers`' count rule picks the caller's data
    ranks among the data ranks the workers cover (ascending); every worker of those data
    ranks runs. Without a mesh every worker is its own data rank. Every worker otherwise.

    >>> call_targets("first", None, 4), call_targets("all", None, 2), call_targets("peer", (1, 2), 4)
    ([0], [0, 1], [2, 3])
    >>> from twinkle_ray.core.mesh import DeviceMesh
    >>> tp2 = DeviceMesh.from_sizes(dp_size=2, tp_size=2)  # data ranks [0, 0, 1, 1]
    >>> [call_targets("peer", (r, 3), 4, tp2) for r in range(3)]  # 3 callers, 2 tp groups
    [[0, 1], [0, 1], [2, 3]]
    """
    if execute == 'first':
        return [0]
    if execute == 'peer' and caller is not None:
        data_ranks = _data_ranks(n, device_mesh, gpus_per_worker)
        groups = sorted(set(data_ranks))
        ours = {groups[j] for j in peer_workers(caller[0], caller[1], len(groups))}
        return [w for w in range(n) if data_ranks[w] in ours]
    return list(range(n))


def peer_workers(caller_rank: int, caller_world: int, n_workers: int) -> list[int]:
    """The workers of a gang that answer a call made by rank ``caller_rank`` of another gang.

    >>> peer_workers(1, 2, 4)   # 2 callers, 4 workers: each caller gets 2
    [2, 3]
    >>> peer_workers(3, 4, 2)   # 4 callers, 2 workers: callers 2, 3 share worker 1
    [1]
    """
    if n_workers >= caller_world:
        per = n_workers // caller_world
        extra = n_workers % caller_world
        start = caller_rank * per + min(caller_rank, extra)
        return list(range(start, start + per + (1 if caller_rank < extra else 0)))
    return [caller_rank * n_workers // caller_world]


def worker_global_rank(worker_index: int, gpus_per_worker: int = 1) -> int:
    """Global (device-mesh) rank of the first device of worker ``worker_index``.

    A worker that owns several devices (a vLLM engine with TP=2) covers the global ranks
    ``i * gpus_per_worker ... (i + 1) * gpus_per_worker - 1``; it is addressed by the first.

    Example::

        >>> worker_global_rank(3, gpus_per_worker=2)
        6
    """
    if worker_index < 0:
        raise ValueError(f'worker index must be >= 0, got {worker_index}')
    if gpus_per_worker < 1:
        raise ValueError(f'gpus_per_worker must be >= 1, got {gpus_per_worker}')
    return worker_index * gpus_per_worker


# --------------------------------------------------------------------------- batch helpers


def _torch():
    return sys.modules.get('torch')


class View:
    """A batch that the split and collect rules handle without holding its items.

    :mod:`twinkle_ray.core.routing` runs the very functions of this module
    (:func:`collect`, :func:`concat`, :func:`take`, :func:`batch_len`, and the split of
    :func:`split_arg`) on views of a producer's outputs, to find which outputs a consumer's
    part needs before any is fetched. A view has a batch length, can be narrowed
    (``take``) and joined (``join``); nothing else.
    """

    __slots__ = ()

    def batch_len(self) -> int:
        raise NotImplementedError

    def take(self, start: int, stop: int) -> View:
        raise NotImplementedError

    @classmethod
    def join(cls, pieces: list) -> View:
        """What :func:`concat` gives for ``pieces`` (views among them)."""
        raise NotImplementedError


def is_tensor(obj: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_sliceable(obj: Any) -> bool:
    """A value with a batch dimension: list, tuple, ndarray / tensor with ndim >= 1."""
    if isinstance(obj, (list, tuple, View)):
        return True
    if isinstance(obj, np.ndarray):
        return obj.ndim >= 1
    if is_tensor(obj):
        return obj.dim() >= 1
    return False


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of a contiguous split of ``n`` items into ``parts``; the first ``n % parts`` get one more.

    Example::

        >>> split_sizes(10, 4)
        [3, 3, 2, 2]
    """
    if parts < 1:
        raise ValueError(f'cannot split into {parts} parts; need at least 1')
    if n < 0:
        raise ValueError(f'cannot split a negative number of items ({n})')
    k, m = divmod(n, parts)
    return [k + 1 if i < m else k for i in range(parts)]


def _span(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of piece ``index`` in the :func:`split_sizes` split."""
    k, m = divmod(n, parts)
    return index * k + min(index, m), (index + 1) * k + min(index + 1, m)


def batch_len(obj: Any) -> int | None:
    """Length along dim 0, or ``None`` for a value without a batch dimension.

    Lists, tuples, numpy arrays and tensors (ndim >= 1) have one.  A dict has the common
    length of its values that have one (nested dicts included); ``None`` when it has none,
    ``ValueError`` naming the keys when they disagree.  Strings, numbers, ``None``, 0-d
    arrays and other objects are scalars.

    Example::

        >>> batch_len({'ids': np.zeros((8, 16)), 'labels': list(range(8)), 'temperature': 0.7})
        8
        >>> batch_len('hello') is None
        True
    """
    if isinstance(obj, dict):
        lengths = _dict_lengths(obj, ())
        distinct = set(lengths.values())
        if not distinct:
            return None
        if len(distinct) > 1:
            found = ', '.join(f'{_key_path(path)}: {n}' for path, n in lengths.items())
            raise ValueError(f'dict values have different batch lengths ({found})')
        return distinct.pop()
    if isinstance(obj, (list, tuple)):
        return len(obj)
    if isinstance(obj, np.ndarray):
        return int(obj.shape[0]) if obj.ndim >= 1 else None
    if is_tensor(obj):
        return int(obj.shape[0]) if obj.dim() >= 1 else None
    if isinstance(obj, View):
        return obj.batch_len()
    return None


def _dict_lengths(obj: dict, prefix: tuple) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for key, value in obj.items():
        if isinstance(value, dict):
            out.update(_dict_lengths(value, (*prefix, key)))
        elif _is_sliceable(value):
            out[(*prefix, key)] = batch_len(value)
    return out


def _key_path(path: tuple) -> str:
    return ''.join(f'[{k!r}]' for k in path)


def take(obj: Any, start: int, stop: int) -> Any:
    """Items ``start:stop`` of ``obj`` along dim 0; values without a batch dimension are returned as is.

    Lists and tuples keep their type; numpy arrays and tensors give views (no copy); dicts
    are sliced key by key (recursively), their scalar values kept.  The input is never
    modified.

    Example::

        >>> take({'ids': [1, 2, 3, 4], 'temperature': 0.7}, 1, 3)
        {'ids': [2, 3], 'temperature': 0.7}
    """
    if isinstance(obj, dict):
        return {k: take(v, start, stop) for k, v in obj.items()}
    if isinstance(obj, View):
        return obj.take(start, stop)
    if _is_sliceable(obj):
        return obj[start:stop]
    return obj


def concat(pieces: Sequence[Any]) -> Any:
    """Join pieces along dim 0 -- the inverse of :func:`take` for everything with a batch dimension.

    - lists / tuples -> one ``list``;
    - numpy arrays -> ``np.concatenate``; tensors -> ``torch.cat`` (a single piece is
      returned as is, without a copy);
    - dicts -> key by key (keys in order of first appearance); a key whose values have no
      batch dimension gives the list of its values, one per piece that has the key, whatever
      they are (values that happen to be equal never collapse into one: the shape of a
      joined value never depends on the data);
    - a mix of lists, tuples, arrays and tensors -> one ``list`` of their dim-0 items;
    - pieces that all lack a batch dimension (one number per worker) -> the list of them.

    ``TypeError`` (naming the piece) for a piece without a batch dimension among pieces
    with one, or for dicts mixed with non-dicts.  An empty input gives ``[]``.

    Example::

        >>> concat([[1, 2], (3,), [4]])
        [1, 2, 3, 4]
        >>> concat([{'ids': [1], 'step': 3}, {'ids': [2, 3], 'step': 3}])
        {'ids': [1, 2, 3], 'step': [3, 3]}
    """
    pieces = list(pieces)
    if not pieces:
        return []
    if any(isinstance(p, View) for p in pieces):
        return next(p for p in pieces if isinstance(p, View)).join(pieces)
    if all(isinstance(p, dict) for p in pieces):
        return _concat_dicts(pieces)
    if not any(isinstance(p, dict) or _is_sliceable(p) for p in pieces):
        # One value per worker (a loss, a reward): the list of them.
        return pieces
    for index, piece in enumerate(pieces):
        if isinstance(piece, dict):
            raise TypeError(
                f'cannot concatenate a dict (piece {index}) with non-dict pieces '
                f'({", ".join(sorted({type(p).__name__ for p in pieces}))})'
            )
        if not _is_sliceable(piece):
            raise TypeError(
                f'cannot concatenate piece {index} of type {type(piece).__name__}: '
                'it has no batch dimension (expected list, tuple, numpy array or tensor)'
            )
    if all(isinstance(p, (list, tuple)) for p in pieces):
        return [item for piece in pieces for item in piece]
    if all(isinstance(p, np.ndarray) for p in pieces):
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)
    if all(is_tensor(p) for p in pieces):
        return pieces[0] if len(pieces) == 1 else _torch().cat(pieces, dim=0)
    # A mix of sequence types: a plain list of the dim-0 items, like one worker's list.
    return [item for piece in pieces for item in piece]


def _concat_dicts(pieces: list[dict]) -> dict:
    keys: dict[Any, None] = {}
    for piece in pieces:
        keys.update(dict.fromkeys(piece))
    out = {}
    for key in keys:
        values = [p[key] for p in pieces if key in p]
        if all(isinstance(v, dict) for v in values):
            out[key] = _concat_dicts(values)
        elif all(_is_sliceable(v) for v in values):
            out[key] = concat(values)
        else:
            out[key] = values
    return out


# --------------------------------------------------------------------------- dispatch


def _where(method: str, group: str) -> str:
    return f"{method}() on group '{group}'"


def _arg_name(position: int | str) -> str:
    return f'argument {position}' if isinstance(position, int) else f'argument {position!r}'


def _too_small(method: str, group: str, n: int, dp: int, location: str, note: str = '') -> ValueError:
    return ValueError(
        f'{_where(method, group)}: batch of {n} items is smaller than the data-parallel size '
        f'{dp} ({location}{note}); pass at least {dp} items or use dispatch=\'all\''
    )


def _named_args(args: tuple, kwargs: dict):
    yield from enumerate(args)
    yield from kwargs.items()


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
        runners: the workers that run the call (``execute='peer'``: :func:`call_targets`);
            every worker when None. The arguments are cut over the runners only, so every
            item runs exactly once (see :func:`runner_splits`); the entries of the workers
            that do not run repeat the first runner's.

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
        raise ValueError(f'{_where(method, group)}: need at least one worker, got n_workers={n_workers!r}')
    if gpus_per_worker < 1:
        raise ValueError(f'{_where(method, group)}: gpus_per_worker must be >= 1, got {gpus_per_worker}')
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
        raise ValueError(f'{_where(method, group)}: the workers that run a call must be distinct '
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
        raise ValueError(f"{_where(method, group)}: runner_splits cuts under 'slice' or "
                         f"'slice_dp', not {mode!r}")
    _, data_ranks = worker_data_ranks(n_workers, device_mesh, gpus_per_worker, method, group)
    ours = sorted({data_ranks[r] for r in runners})
    return [Split('slice_dp', len(ours), ours.index(data_ranks[r]), method, group) for r in runners]


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
            f'{_where(method, group)}: dispatch function {name} must return (args, kwargs) '
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
        out.append((
            tuple(split_arg(cut, v, _arg_name(p)) for p, v in enumerate(args)),
            {k: split_arg(cut, v, _arg_name(k)) for k, v in kwargs.items()},
        ))
    return _fill(n_workers, runners, out)


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
            f"{_where(method, group)}: dispatch='slice' splits every list argument the same way, "
            f'but their lengths differ ({found})'
        )
    return distinct.pop() if distinct else None


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
                f"{_where(split.method, split.group)}: dispatch='slice' splits every list argument "
                f'the same way, but their lengths differ ({location}: {n}; the others: '
                f'{split.slice_len})')
        if n < split.parts:
            raise _too_small(split.method, split.group, n, split.parts, location,
                             note=f"; dispatch='slice' over {split.parts} workers")
        return take(value, *_span(n, split.parts, split.index))
    _check_dp_sizes(value, split.parts, location, split.method, split.group)
    return _split_dp(value, lambda n: _span(n, split.parts, split.index))


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
    elif _is_sliceable(value):
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
    if _is_sliceable(value):
        return take(value, *window(batch_len(value)))
    return value


def worker_data_ranks(
    n_workers: int, mesh: Any = None, gpus_per_worker: int = 1, method: str = '?', group: str = '?'
) -> tuple[int, list[int]]:
    """``(data world size, data rank of each worker)`` for ``slice_dp`` routing.

    Worker ``i`` is global rank ``i * gpus_per_worker`` of ``mesh``; without a
    mesh every worker is its own data rank.

    >>> worker_data_ranks(4)
    (4, [0, 1, 2, 3])
    """
    if mesh is None:
        return n_workers, list(range(n_workers))
    dp = int(mesh.data_world_size)
    data_ranks = _data_ranks(n_workers, mesh, gpus_per_worker, method, group)
    missing = sorted(set(range(dp)) - set(data_ranks))
    if missing:
        raise ValueError(
            f'{_where(method, group)}: the {n_workers} worker(s) cover data ranks '
            f'{sorted(set(data_ranks))} of data-parallel size {dp}; the slices of data ranks '
            f"{missing} would be dropped (use dispatch='all' for a single worker)"
        )
    return dp, data_ranks


def _data_ranks(n_workers: int, mesh: Any, gpus_per_worker: int = 1, method: str = '?',
                group: str = '?') -> list[int]:
    """The data rank of each worker (worker ``i`` is global rank ``i * gpus_per_worker``);
    ValueError for a worker outside the mesh."""
    if mesh is None:
        return list(range(n_workers))
    ranks = [worker_global_rank(i, gpus_per_worker) for i in range(n_workers)]
    world = getattr(mesh, 'world_size', None)
    if world is not None and ranks[-1] >= world:
        raise ValueError(
            f'{_where(method, group)}: worker {n_workers - 1} maps to global rank {ranks[-1]} '
            f'(gpus_per_worker={gpus_per_worker}) but the device mesh has only {world} ranks'
        )
    return [int(mesh.get_data_rank_from_global_rank(g)) for g in ranks]


def span(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of piece ``index`` when ``n`` items split into ``parts``.

    >>> [span(10, 4, i) for i in range(4)]
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    return _span(n, parts, index)


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
            call = by_split[cut] = (
                tuple(split_arg(cut, v, _arg_name(p)) for p, v in enumerate(args)),
                {k: split_arg(cut, v, _arg_name(k)) for k, v in kwargs.items()},
            )
        out.append(call)
    return _fill(n_workers, runners, out)


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


# --------------------------------------------------------------------------- collect


def collect(
    mode: str | Callable,
    results: Sequence[Any],
    *,
    device_mesh: Any = None,
    gpus_per_worker: int = 1,
    worker_indices: Sequence[int] | None = None,
) -> Any:
    """Join the per-worker results of one call.

    Args:
        mode: ``'none'`` (a single result unwrapped, else the list), ``'flatten'``
            (:func:`concat`), ``'mean'`` / ``'sum'`` (numbers, arrays, tensors elementwise,
            dicts per key, lists per position), ``'first'``, ``'last_pp'``,
            ``'last_pp_first'`` or ``fn(results, device_mesh)``.
        results: one result per executing worker, in worker order.
        device_mesh: the gang's mesh (used by ``'last_pp'`` and ``'last_pp_first'``).
        gpus_per_worker: worker ``w`` is global mesh rank ``w * gpus_per_worker``.
        worker_indices: which worker produced each result (default ``0..len-1``).

    ``'last_pp'`` keeps the results of the last pipeline stage, one per data-parallel rank
    (tp / cp peers of a data rank hold the same output; the one with the smallest global
    rank is kept -- Twinkle's ``DeviceMesh.get_collect_ranks`` rule), ordered by data rank,
    and concatenates them when they are sequences / dicts, else returns them as a list.
    With no ``'pp'`` dim every rank is on the last stage.

    ``'last_pp_first'`` (Twinkle's mode for metrics that every last-stage rank holds) is the
    result of the smallest global rank of the last pipeline stage among the results; the
    first result when none of them is on the last stage (or there is no mesh), as Twinkle
    falls back to rank 0's.

    When every result is a tuple of one length, element ``k`` of the answer is
    ``collect(mode, [r[k] for r in results])`` (a namedtuple keeps its type). For
    ``'last_pp'`` and ``'last_pp_first'`` only the results they keep count (see
    :func:`collect_sources`), so the answer is the same whether the others were fetched or not.
    An empty ``results`` gives ``[]``.

    Example::

        >>> collect('mean', [{'loss': 1.0}, {'loss': 3.0}])
        {'loss': 2.0}
        >>> collect('flatten', [([1, 2], 0.5), ([3], 1.5)])
        ([1, 2, 3], [0.5, 1.5])
    """
    check_collect(mode)
    results = list(results)
    if worker_indices is None:
        worker_indices = list(range(len(results)))
    else:
        worker_indices = list(worker_indices)
        if len(worker_indices) != len(results):
            raise ValueError(
                f'collect got {len(results)} results but {len(worker_indices)} worker indices'
            )
    if not results:
        return []
    if mode in ('last_pp', 'last_pp_first'):  # only these results count, for the tuple check too
        keep = collect_sources(mode, worker_indices, device_mesh=device_mesh,
                               gpus_per_worker=gpus_per_worker)
        results = [results[k] for k in keep]
        worker_indices = [worker_indices[k] for k in keep]

    first = results[0]
    if elementwise(results):
        elements = [
            collect(
                mode,
                [r[k] for r in results],
                device_mesh=device_mesh,
                gpus_per_worker=gpus_per_worker,
                worker_indices=worker_indices,
            )
            for k in range(len(first))
        ]
        return type(first)(*elements) if hasattr(type(first), '_fields') else tuple(elements)

    if not isinstance(mode, str):
        return mode(results, device_mesh)
    if mode == 'none':
        return results[0] if len(results) == 1 else results
    if mode == 'first':
        return results[0]
    if mode == 'flatten':
        return concat(results)
    if mode in ('mean', 'sum'):
        return _reduce(mode, results, 'results')
    if mode == 'last_pp_first':
        return results[0]
    if all(isinstance(p, dict) for p in results) or all(_is_sliceable(p) for p in results):
        return concat(results)
    return results


def elementwise(results: Sequence[Any]) -> bool:
    """Whether :func:`collect` joins ``results`` element by element: they are all tuples of one
    length (a method with several return values).

    >>> elementwise([(1, 2), (3, 4)]), elementwise([(1, 2), [3, 4]]), elementwise([])
    (True, False, False)
    """
    if not results or not isinstance(results[0], tuple):
        return False
    n = len(results[0])
    return all(isinstance(r, tuple) and len(r) == n for r in results)


def collect_sources(
    mode: str | Callable,
    worker_indices: Sequence[int],
    *,
    device_mesh: Any = None,
    gpus_per_worker: int = 1,
) -> list[int]:
    """Positions of the results that :func:`collect` reads for ``mode``, in order.

    ``'last_pp'`` reads one result per data rank of the last pipeline stage,
    ``'last_pp_first'`` one result; every other mode reads them all. A consumer that
    collects another gang's outputs fetches only these; passing them to
    :func:`collect` (with their worker indices) gives the same value.

    Example::

        >>> from twinkle_ray.core.mesh import DeviceMesh
        >>> mesh = DeviceMesh.from_sizes(pp_size=2, dp_size=2)
        >>> collect_sources('last_pp', [0, 1, 2, 3], device_mesh=mesh)
        [2, 3]
        >>> collect_sources('last_pp_first', [0, 1, 2, 3], device_mesh=mesh)
        [2]
    """
    worker_indices = list(worker_indices)
    if mode == 'last_pp' and worker_indices:
        return _last_pp_picks(worker_indices, device_mesh, gpus_per_worker)
    if mode == 'last_pp_first' and worker_indices:
        return [_last_pp_first(worker_indices, device_mesh, gpus_per_worker)]
    return list(range(len(worker_indices)))


def _last_stage(mesh: Any) -> set[int] | None:
    """The global ranks of the mesh's last pipeline stage; None: every rank is on it."""
    if mesh is None:
        return None
    get_last = getattr(mesh, 'get_pp_last_ranks', None)
    last = get_last() if callable(get_last) else None
    return None if last is None else {int(r) for r in last}


def _last_pp_first(worker_indices, mesh, gpus_per_worker) -> int:
    """Position of the result of the smallest last-stage global rank (0 if there is none)."""
    ranks = [worker_global_rank(w, gpus_per_worker) for w in worker_indices]
    last = _last_stage(mesh)
    on_last = [(g, k) for k, g in enumerate(ranks) if last is None or g in last]
    return min(on_last)[1] if on_last else 0


def _last_pp_picks(worker_indices, mesh, gpus_per_worker) -> list[int]:
    """Positions of the results ``'last_pp'`` keeps, in data-rank order."""
    ranks = [worker_global_rank(w, gpus_per_worker) for w in worker_indices]
    if mesh is None:
        return list(range(len(ranks)))
    last = _last_stage(mesh)
    data_rank_of = getattr(mesh, 'get_data_rank_from_global_rank', None)
    chosen: dict[int, tuple[int, int]] = {}  # data rank -> (global rank, result index)
    for k, g in enumerate(ranks):
        if last is not None and g not in last:
            continue
        d = int(data_rank_of(g)) if callable(data_rank_of) else g
        if d not in chosen or g < chosen[d][0]:
            chosen[d] = (g, k)
    if not chosen:
        raise ValueError(
            f"collect='last_pp': none of the results comes from the last pipeline stage "
            f'(results from global ranks {ranks}; last-stage ranks {sorted(last or [])}); '
            "run the call on all workers (execute='all')"
        )
    return [chosen[d][1] for d in sorted(chosen)]


def _reduce(op: str, values: list, path: str) -> Any:
    if all(v is None for v in values):
        return None
    if all(isinstance(v, dict) for v in values):
        keys: dict[Any, None] = {}
        for v in values:
            keys.update(dict.fromkeys(v))
        return {k: _reduce(op, [v[k] for v in values if k in v], f'{path}[{k!r}]') for k in keys}
    torch = _torch()
    if torch is not None and any(isinstance(v, torch.Tensor) for v in values):
        _require_numeric(op, values, path)
        ref = next(v for v in values if isinstance(v, torch.Tensor))
        stacked = torch.stack([torch.as_tensor(v).to(ref.device) for v in values])
        if op == 'sum':
            return stacked.sum(dim=0)
        if not (stacked.is_floating_point() or stacked.is_complex()):
            # float32, torch's own default: never the collecting process's default dtype,
            # so a routed mean (collected in the consumer) equals the fetched one
            stacked = stacked.to(torch.float32)
        return stacked.mean(dim=0)
    if any(isinstance(v, (np.ndarray, np.generic)) for v in values):
        _require_numeric(op, values, path)
        stacked = np.stack([np.asarray(v) for v in values])
        return stacked.sum(axis=0) if op == 'sum' else stacked.mean(axis=0)
    if all(isinstance(v, list) for v in values):
        if len({len(v) for v in values}) != 1:
            raise TypeError(
                f'collect={op!r}: {path} are lists of different lengths {[len(v) for v in values]}'
            )
        return [_reduce(op, [v[j] for v in values], f'{path}[{j}]') for j in range(len(values[0]))]
    _require_numeric(op, values, path)
    total = sum(values)
    return total if op == 'sum' else total / len(values)


def _require_numeric(op: str, values: list, path: str) -> None:
    torch = _torch()
    for v in values:
        if isinstance(v, (numbers.Number, np.ndarray, np.generic)):
            continue
        if torch is not None and isinstance(v, torch.Tensor):
            continue
        raise TypeError(
            f'collect={op!r} cannot combine {path} of type {type(v).__name__} '
            '(expected numbers, numpy arrays, tensors, or dicts / lists of them)'
        )
