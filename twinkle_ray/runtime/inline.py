"""Small results of an eager call come back inline, in the dispatcher's reply.

An eager call (``sync=True``, or ``lazy_collect=False``) wants values, not
refs. Handing the caller the output refs costs an ownership round trip: the
refs the dispatcher owns are borrowed by the caller, which then fetches each
one from the dispatcher. Instead the dispatcher awaits the outputs and
replies with them. Only values that are small *for certain* travel that way:
plain Python scalars, strings and bytes, numpy arrays, and lists, tuples and
dicts of those, up to ``INLINE_BYTES`` in all (:func:`certainly_small`). Any
other result (a torch tensor, a user's class, a large value) stays in its
worker's object store and a :class:`Held` ref goes in its place, which the
caller fetches from the worker directly. So payload never passes through the
dispatcher, and the dispatcher never imports a user's module or torch to
unpickle a result.

Example::

    out = hold_unless_small(result)        # in the worker: the value, or Held(ray.put(value))
    values = unhold([out, ...], fetch)     # in the caller: every Held fetched
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

# The most bytes a result may have to come back inline (Ray inlines small objects in a task's
# reply up to 100 KiB; the same bound as the caller's ray.put of large arguments).
INLINE_BYTES = 64 * 1024
_SCALARS = (type(None), bool, int, float, complex)
_MAX_DEPTH = 8


@dataclass(frozen=True)
class Held:
    """A result left in its worker's object store: ``ref`` is fetched by the caller."""

    ref: Any


def certainly_small(value: Any, limit: int = INLINE_BYTES) -> bool:
    """Whether ``value`` is plain data of fewer than ``limit`` bytes, by its structure.

    Anything this cannot size for certain (another type, deeper than 8 levels)
    is not small. The walk stops as soon as the limit is passed.

    >>> import numpy as np
    >>> certainly_small({"loss": 0.5, "ids": [1, 2, 3], "x": np.zeros(4)})
    True
    >>> certainly_small(np.zeros(65536)), certainly_small(object())
    (False, False)
    """
    left = [limit]

    def walk(v: Any, depth: int) -> bool:
        t = type(v)
        if t in _SCALARS:
            left[0] -= 16
        elif t is str or t is bytes or t is bytearray:
            left[0] -= len(v)
        elif t.__module__ == "numpy" and isinstance(getattr(v, "nbytes", None), int):
            if getattr(v, "dtype", None) is not None and v.dtype.hasobject:
                return False
            left[0] -= v.nbytes
        elif (t is list or t is tuple) and depth < _MAX_DEPTH:
            left[0] -= 8 * len(v)
            return left[0] >= 0 and all(walk(x, depth + 1) for x in v)
        elif t is dict and depth < _MAX_DEPTH:
            left[0] -= 16 * len(v)
            return left[0] >= 0 and all(walk(k, depth + 1) and walk(x, depth + 1)
                                        for k, x in v.items())
        else:
            return False
        return left[0] >= 0

    return walk(value, 0)


def hold_unless_small(value: Any) -> Any:
    """``value`` itself when :func:`certainly_small`, else :class:`Held` of a ref to it (put
    by this process, the worker).

    >>> hold_unless_small([1, 2, 3])
    [1, 2, 3]
    """
    return value if certainly_small(value) else Held(ray.put(value))


def unhold(values: list, fetch: Callable[[list, list[int]], list]) -> list:
    """The values with every :class:`Held` fetched: ``fetch(refs, positions)`` gets them (the
    caller's error contract: a worker that died before its result was fetched is a death).

    >>> unhold([1, None], fetch=None)
    [1, None]
    """
    at = [i for i, v in enumerate(values) if isinstance(v, Held)]
    if not at:
        return values
    got = fetch([values[i].ref for i in at], at)
    out = list(values)
    for i, v in zip(at, got, strict=True):
        out[i] = v
    return out
