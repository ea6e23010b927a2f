"""Which producer outputs cover which consumer slice (pure, no Ray).

A LazyResult is a list of per-rank outputs whose concatenation is the value.
When it is passed to another gang, each consumer worker needs only the part of
that concatenation its dispatch mode gives it (``dispatch.span`` of its data
rank); ``locate`` says which producer outputs (and which ranges inside them)
make up that part. Each consumer worker runs it on the producers' length records.

Example: producer dp=4 yields 4 outputs of 25 items; a dp=2 consumer's rank 0
gets items [0, 50), rank 1 items [50, 100)::

    >>> locate([25, 25, 25, 25], 0, 50)
    [(0, None), (1, None)]
    >>> locate([25, 25, 25, 25], 10, 60)
    [(0, (10, 25)), (1, None), (2, (0, 10))]
"""

from __future__ import annotations


def locate(lengths: list[int], start: int, stop: int) -> list[tuple[int, tuple[int, int] | None]]:
    """Producer outputs covering items [start, stop) of their concatenation.

    Returns (output index, window inside that output) pairs in order; the
    window is None when the whole output is used.
    """
    pieces: list[tuple[int, tuple[int, int] | None]] = []
    offset = 0
    for k, n in enumerate(lengths):
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            pieces.append((k, None if (lo, hi) == (offset, offset + n) else (lo - offset, hi - offset)))
        offset += n
        if offset >= stop:
            break
    return pieces


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
