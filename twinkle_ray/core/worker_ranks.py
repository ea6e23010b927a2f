"""Which workers run a call, and which global and data-parallel rank each worker is.

One job: the worker / rank maths the split and collect rules and the runtime share. Worker
``i`` of a gang is global rank ``i * gpus_per_worker`` of its device mesh
(:func:`worker_global_rank`); its data rank is the mesh's (:func:`data_ranks`,
:func:`worker_data_ranks`, which also refuses a gang that leaves a data rank without a
worker). :func:`call_targets` and :func:`peer_workers` say which workers run a call under
each ``execute`` mode. The device mesh is duck-typed: ``data_world_size``, ``world_size`` and
``get_data_rank_from_global_rank(g)`` are read. Pure module: no Ray.

Example: 2 calling ranks of another gang, 4 workers (tp=2): each caller's call runs on one
tp group, and the gang's 4 workers cover data ranks 0 and 1::

    >>> from twinkle_ray.core.mesh import DeviceMesh
    >>> tp2 = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    >>> call_targets('peer', (1, 2), 4, tp2), worker_data_ranks(4, tp2)
    ([2, 3], (2, [0, 0, 1, 1]))
"""

from __future__ import annotations

from typing import Any

from .batch import span
from .modes import where

__all__ = [
    'call_targets',
    'data_ranks',
    'peer_workers',
    'worker_data_ranks',
    'worker_global_rank',
]


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
        ranks = data_ranks(n, device_mesh, gpus_per_worker)
        groups = sorted(set(ranks))
        ours = {groups[j] for j in peer_workers(caller[0], caller[1], len(groups))}
        return [w for w in range(n) if ranks[w] in ours]
    return list(range(n))


def peer_workers(caller_rank: int, caller_world: int, n_workers: int) -> list[int]:
    """The workers of a gang that answer a call made by rank ``caller_rank`` of another gang.

    >>> peer_workers(1, 2, 4)   # 2 callers, 4 workers: each caller gets 2
    [2, 3]
    >>> peer_workers(3, 4, 2)   # 4 callers, 2 workers: callers 2, 3 share worker 1
    [1]
    """
    if n_workers >= caller_world:  # the divmod split of the workers over the callers
        return list(range(*span(n_workers, caller_world, caller_rank)))
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
    ranks = data_ranks(n_workers, mesh, gpus_per_worker, method, group)
    missing = sorted(set(range(dp)) - set(ranks))
    if missing:
        raise ValueError(
            f'{where(method, group)}: the {n_workers} worker(s) cover data ranks '
            f'{sorted(set(ranks))} of data-parallel size {dp}; the slices of data ranks '
            f"{missing} would be dropped (use dispatch='all' for a single worker)"
        )
    return dp, ranks


def data_ranks(n_workers: int, mesh: Any, gpus_per_worker: int = 1, method: str = '?',
               group: str = '?') -> list[int]:
    """The data rank of each worker (worker ``i`` is global rank ``i * gpus_per_worker``);
    every worker is its own without a mesh; ValueError for a worker outside the mesh.

    >>> from twinkle_ray.core.mesh import DeviceMesh
    >>> data_ranks(4, DeviceMesh.from_sizes(dp_size=2, tp_size=2))
    [0, 0, 1, 1]
    """
    if mesh is None:
        return list(range(n_workers))
    ranks = [worker_global_rank(i, gpus_per_worker) for i in range(n_workers)]
    world = getattr(mesh, 'world_size', None)
    if world is not None and ranks[-1] >= world:
        raise ValueError(
            f'{where(method, group)}: worker {n_workers - 1} maps to global rank {ranks[-1]} '
            f'(gpus_per_worker={gpus_per_worker}) but the device mesh has only {world} ranks'
        )
    return [int(mesh.get_data_rank_from_global_rank(g)) for g in ranks]
