"""What a call sends to its gang's dispatcher, prepared in the caller's process.

Large top-level argument values go to the object store once (``put_large``:
the dispatcher only ever sees refs), the gang's own LazyResults travel
without their GangRef (``strip_own_gang``), and what stays inline is kept to
name an argument the dispatcher could not unpickle (``sent_by_value``,
``unpicklable``).

Example::

    per_worker = strip_own_gang(put_large([(args, kwargs)]), gang)
    why = unpicklable(args, kwargs)      # None, or which argument cannot be pickled
"""

from __future__ import annotations

from typing import Any

import cloudpickle
import ray

from .lazy import GangRef, LazyResult, traveling
from .together import StartFailed

PUT_THRESHOLD_BYTES = 64 * 1024


def _nbytes(obj: Any, depth: int = 0) -> int:
    """A cheap estimate of an object's pickled size (enough to decide on ray.put)."""
    nb = getattr(obj, "nbytes", None)
    if isinstance(nb, int):
        return nb
    if isinstance(obj, bytes | bytearray | str):
        return len(obj)
    if depth < 2 and isinstance(obj, list | tuple) and obj:
        head = obj[:8]
        return sum(_nbytes(x, depth + 1) for x in head) * len(obj) // len(head)
    if depth < 2 and isinstance(obj, dict) and obj:
        vals = list(obj.values())
        head = vals[:16]
        return sum(_nbytes(v, depth + 1) for v in head) * len(vals) // len(head)
    return 64


def strip_own_gang(per_worker: list[tuple[tuple, dict]], gang: GangRef) -> list[tuple[tuple, dict]]:
    """Send this gang's own LazyResults to its dispatcher without their GangRef (``gang=None``).

    The dispatcher knows its own gang; the GangRef's actor handle and mesh would be pickled
    here and unpickled there on every chained call. Other values pass unchanged.
    """
    light: dict[int, LazyResult] = {}

    def conv(v: Any) -> Any:
        if not isinstance(v, LazyResult) or v.gang is not gang:
            return v
        c = light.get(id(v))
        if c is None:  # one copy per value, so the dispatcher routes it once
            c = light[id(v)] = LazyResult(v._plan_ref, collect=v.collect, gang=None, method=v.method,
                                          timeout=v.timeout, out=traveling(v._out), turn=v._turn)
        return c

    if not any(isinstance(v, LazyResult) for a, kw in per_worker for v in (*a, *kw.values())):
        return per_worker
    return [(tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()})
            for args, kwargs in per_worker]


def put_large(per_worker: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """Replace large top-level argument values by ObjectRefs, one ``ray.put`` per object.

    Keeps payload off the dispatcher: it only ever sees the refs, and each
    worker pulls its piece straight from the object store.
    """
    cache: dict[int, Any] = {}

    def conv(v: Any) -> Any:
        if isinstance(v, LazyResult | ray.ObjectRef) or _nbytes(v) < PUT_THRESHOLD_BYTES:
            return v
        key = id(v)
        if key not in cache:
            cache[key] = ray.put(v)
        return cache[key]

    return [
        (tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()})
        for args, kwargs in per_worker
    ]


def unpicklable(args: tuple, kwargs: dict) -> str | None:
    for name, v in [*((f"argument {i}", a) for i, a in enumerate(args)),
                    *((f"argument '{k}'", v) for k, v in kwargs.items())]:
        try:
            cloudpickle.dumps(v)
        except StartFailed as e:  # a gang in it failed to start: that is the error
            raise e.error from None
        except Exception as e:
            return f"{name} of type {type(v).__name__} cannot be pickled: {e}"
    return None


def sent_by_value(per_worker: list[tuple[tuple, dict]]) -> tuple[tuple[str, Any], ...]:
    """The arguments sent to the dispatcher by value, named as ``unpicklable`` names them.

    Only these can fail to unpickle there: payload went to the object store (``put_large``)
    and LazyResults are routed, so neither is kept (a LazyResult holds no caller's payload).
    Each value kept is below ``PUT_THRESHOLD_BYTES`` by ``_nbytes``' estimate.
    """
    seen: set[int] = set()
    kept = []
    for args, kwargs in per_worker:
        for name, v in [*((f"argument {i}", a) for i, a in enumerate(args)),
                        *((f"argument '{k}'", v) for k, v in kwargs.items())]:
            if isinstance(v, ray.ObjectRef | LazyResult) or id(v) in seen:
                continue
            seen.add(id(v))
            kept.append((name, v))
    return tuple(kept)
