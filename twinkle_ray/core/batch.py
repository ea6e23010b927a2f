"""What a batch is to the split and collect rules: its length, a slice of it, pieces joined.

One job: the dim-0 view of a value. :func:`batch_len` says how many items a value holds
(``None`` for a scalar), :func:`take` narrows it, :func:`concat` joins pieces back, and
:func:`split_sizes` / :func:`span` give the contiguous divmod split (the first ``n % parts``
pieces get one more item). Lists, tuples, numpy arrays and torch tensors have a batch
dimension; dicts are handled key by key; a :class:`View` stands for a batch whose items are
not held (routing's skeletons).

Pure module: numpy only, no Ray. torch is never imported here; a value is a tensor only if
torch is already imported by the caller (``sys.modules``).

Example::

    >>> batch = {'ids': [1, 2, 3, 4, 5], 'temperature': 0.7}
    >>> batch_len(batch), split_sizes(5, 2)
    (5, [3, 2])
    >>> parts = [take(batch, *span(5, 2, i)) for i in range(2)]
    >>> parts[1]
    {'ids': [4, 5], 'temperature': 0.7}
    >>> concat(parts)
    {'ids': [1, 2, 3, 4, 5], 'temperature': [0.7, 0.7]}
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    'View',
    'batch_len',
    'concat',
    'is_sliceable',
    'is_tensor',
    'loaded_torch',
    'span',
    'split_sizes',
    'take',
]


def loaded_torch() -> Any:
    """The ``torch`` module if the process has already imported it, else None (never imports it).

    >>> loaded_torch() is sys.modules.get('torch')
    True
    """
    return sys.modules.get('torch')


class View:
    """A batch that the split and collect rules handle without holding its items.

    :mod:`twinkle_ray.core.routing` runs the very split and collect rules
    (:func:`~twinkle_ray.core.collect.collect`, :func:`concat`, :func:`take`, :func:`batch_len`,
    and :func:`~twinkle_ray.core.split.split_arg`) on views of a producer's outputs, to find
    which outputs a consumer's part needs before any is fetched. A view has a batch length, can be narrowed
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
    """Whether ``obj`` is a torch tensor (False, without importing torch, when torch is not loaded).

    >>> is_tensor(np.zeros(2))
    False
    """
    torch = loaded_torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def is_sliceable(obj: Any) -> bool:
    """A value with a batch dimension: list, tuple, view, ndarray / tensor with ndim >= 1.

    >>> is_sliceable((1, 2)), is_sliceable(np.float32(1.0)), is_sliceable('ab')
    (True, False, False)
    """
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


def span(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of piece ``index`` when ``n`` items split into ``parts`` (the
    :func:`split_sizes` split).

    >>> [span(10, 4, i) for i in range(4)]
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
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
        elif is_sliceable(value):
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
    if is_sliceable(obj):
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
    if not any(isinstance(p, dict) or is_sliceable(p) for p in pieces):
        # One value per worker (a loss, a reward): the list of them.
        return pieces
    for index, piece in enumerate(pieces):
        if isinstance(piece, dict):
            raise TypeError(
                f'cannot concatenate a dict (piece {index}) with non-dict pieces '
                f'({", ".join(sorted({type(p).__name__ for p in pieces}))})'
            )
        if not is_sliceable(piece):
            raise TypeError(
                f'cannot concatenate piece {index} of type {type(piece).__name__}: '
                'it has no batch dimension (expected list, tuple, numpy array or tensor)'
            )
    if all(isinstance(p, (list, tuple)) for p in pieces):
        return [item for piece in pieces for item in piece]
    if all(isinstance(p, np.ndarray) for p in pieces):
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)
    if all(is_tensor(p) for p in pieces):
        return pieces[0] if len(pieces) == 1 else loaded_torch().cat(pieces, dim=0)
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
        elif all(is_sliceable(v) for v in values):
            out[key] = concat(values)
        else:
            out[key] = values
    return out
