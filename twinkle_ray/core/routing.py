"""Which producer outputs cover which consumer slice (pure, no Ray).

A LazyResult is a list of per-rank outputs whose concatenation is the value.
When it is passed to another gang, each consumer worker needs only the part of
that concatenation its dispatch mode gives it (``dispatch.span`` of its data
rank); ``locate`` says which producer outputs (and which ranges inside them)
make up that part. Each consumer worker runs it on the producers' length records
(:func:`length_record`: a tuple result's record has one length per element, since
``collect`` joins tuples element-wise).

Example: producer dp=4 yields 4 outputs of 25 items; a dp=2 consumer's rank 0
gets items [0, 50), rank 1 items [50, 100)::

    >>> locate([25, 25, 25, 25], 0, 50)
    [(0, None), (1, None)]
    >>> locate([25, 25, 25, 25], 10, 60)
    [(0, (10, 25)), (1, None), (2, (0, 10))]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .dispatch import batch_len


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


@dataclass(frozen=True)
class TupleLengths:
    """Length record of a tuple result: one record per element.

    ``collect`` joins tuple results element-wise (element ``j`` of the value is the join of
    every rank's element ``j``), so routing slices each element by its own length. A record
    is an ``int`` (a batch length), ``None`` (no batch dimension) or a TupleLengths.

    Example::

        >>> length_record(([1, 2, 3], {'x': [1, 2]}, 0.5))
        TupleLengths(items=(3, 2, None))
    """

    items: tuple

    def __len__(self) -> int:
        return len(self.items)


def length_record(obj: Any) -> int | TupleLengths | None:
    """What ``collect`` joins of a result: its batch length, per element for a tuple.

    >>> length_record([1, 2]), length_record('text'), length_record(([1], (2, 3)))
    (2, None, TupleLengths(items=(1, TupleLengths(items=(None, None)))))
    """
    if isinstance(obj, tuple):
        return TupleLengths(tuple(length_record(e) for e in obj))
    try:
        return batch_len(obj)
    except (TypeError, ValueError):  # e.g. a dict whose values differ in length
        return None


def tuple_arity(records: list) -> int | None:
    """The common arity when every record is a tuple's (joined element-wise), else None.

    >>> tuple_arity([TupleLengths((2, 1)), TupleLengths((3, 1))]), tuple_arity([TupleLengths((2,)), 2])
    (2, None)
    """
    if not records or not all(isinstance(r, TupleLengths) for r in records):
        return None
    arity = {len(r) for r in records}
    return arity.pop() if len(arity) == 1 else None


def plain_length(record: int | TupleLengths | None) -> int | None:
    """A record's length when its result is joined whole (a tuple among non-tuples: its items).

    >>> plain_length(TupleLengths((5, 5))), plain_length(4), plain_length(None)
    (2, 4, None)
    """
    return len(record) if isinstance(record, TupleLengths) else record
