"""Small results of an eager call come back inline, in the dispatcher's reply.

An eager call (``sync=True``, or ``lazy_collect=False``) wants values, not
refs. Handing the caller the output refs costs an ownership round trip: the
refs the dispatcher owns are borrowed by the caller, which then fetches each
one from the dispatcher. Instead the dispatcher awaits the outputs and
replies with them, which Ray inlines for small objects. Payload never passes
through the dispatcher: a worker whose result is large by
:func:`~twinkle_ray.runtime.sending._nbytes`' estimate puts it in its own
object store and returns a :class:`Held` ref, which the caller fetches from
the worker directly.

Example::

    out = hold_large(result)        # in the worker: the value, or Held(ray.put(value))
    values = unhold([out, ...])     # in the caller: every Held fetched
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray


@dataclass(frozen=True)
class Held:
    """A large result left in its worker's object store: ``ref`` is fetched by the caller."""

    ref: Any


def hold_large(value: Any) -> Any:
    """``value`` itself when small, else :class:`Held` of a ref to it (put by this process).

    >>> hold_large([1, 2, 3])
    [1, 2, 3]
    """
    from .sending import PUT_THRESHOLD_BYTES, _nbytes  # sending imports lazy, which imports us

    if _nbytes(value) < PUT_THRESHOLD_BYTES:
        return value
    return Held(ray.put(value))


def unhold(values: list) -> list:
    """The values with every :class:`Held` fetched (one ``ray.get`` for all of them).

    >>> unhold([1, None])
    [1, None]
    """
    at = [i for i, v in enumerate(values) if isinstance(v, Held)]
    if not at:
        return values
    got = ray.get([values[i].ref for i in at])
    out = list(values)
    for i, v in zip(at, got, strict=True):
        out[i] = v
    return out
