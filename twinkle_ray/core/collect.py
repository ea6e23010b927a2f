"""The collect rules: how the per-worker results of one call become one value.

One job: :func:`collect` joins the results under a collect mode -- ``'none'``,
``'flatten'``, ``'mean'``, ``'sum'``, ``'first'``, ``'last_pp'``, ``'last_pp_first'`` or a
callable ``fn(results, device_mesh)``; results that are all tuples of one length (a method
with several return values) are collected element-wise (:func:`elementwise`).
:func:`collect_sources` says which results a mode reads, so a consumer of another gang's
outputs fetches only those. The device mesh is duck-typed: ``get_pp_last_ranks()`` and
``get_data_rank_from_global_rank(g)`` are read. Pure module: numpy only, no Ray; torch only
if the caller has imported it.

Example: a pp=2, dp=2 gang's results, one per worker; ``'last_pp'`` keeps the last stage's::

    >>> from twinkle_ray.core.mesh import DeviceMesh
    >>> mesh = DeviceMesh.from_sizes(pp_size=2, dp_size=2)
    >>> collect('last_pp', [[0], [1], [2], [3]], device_mesh=mesh)
    [2, 3]
    >>> collect('mean', [1.0, 2.0, 3.0, 6.0])
    3.0
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .batch import concat, is_sliceable, loaded_torch
from .modes import check_collect
from .worker_ranks import worker_global_rank

__all__ = ['collect', 'collect_sources', 'elementwise']


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
    if all(isinstance(p, dict) for p in results) or all(is_sliceable(p) for p in results):
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
    torch = loaded_torch()
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
    torch = loaded_torch()
    for v in values:
        if isinstance(v, (numbers.Number, np.ndarray, np.generic)):
            continue
        if torch is not None and isinstance(v, torch.Tensor):
            continue
        raise TypeError(
            f'collect={op!r} cannot combine {path} of type {type(v).__name__} '
            '(expected numbers, numpy arrays, tensors, or dicts / lists of them)'
        )
