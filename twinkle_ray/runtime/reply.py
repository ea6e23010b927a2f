"""What a call gives back: the dispatcher's :class:`Reply`, and what a rank returns.

The dispatcher answers every call with a :class:`Reply`: the output ObjectRef of
each rank that runs it and, when the outputs may be routed by length, the ref of
each output's record (:func:`~twinkle_ray.core.routing.record_of`). Never payload.

- **Packed.** A reply with more than ``PACK_REFS_OVER`` refs carries them as one
  object (a ``ray.put`` in the dispatcher), fetched by the caller only when it
  needs them (:meth:`Reply.unpacked`): a ref nested in a reply costs the
  caller's process CPU (borrowing it) when the reply arrives, so a lazy call's
  cost to its caller would otherwise grow with the gang's size.
- **Inline.** An eager call (``sync=True``) wants values: each rank returns
  :func:`inline` of its result: the pickled bytes when they are at most
  ``INLINE_BYTES`` (measured, not guessed) and the call's results together at most
  ``INLINE_CALL_BYTES`` (each rank's share: :func:`inline_limit`), else a :class:`Held`
  ref to the result left in the rank's object store. The dispatcher awaits them and replies with
  them; it never unpickles a result (bytes are opaque to it), and payload never
  passes through it. The caller unpickles (:func:`values_of`).

Example::

    reply = Reply(refs=[r0, r1], records=[], workers=[0, 1])
    out = inline(result)                    # in a rank: Inline(b'...') or Held(ref)
    values = values_of([out, ...], fetch)   # in the caller
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, NamedTuple

import ray

from .wire import Pickler

# A reply to a lazy call that would carry more ObjectRefs than this carries one instead.
PACK_REFS_OVER = 16
# The most bytes a result's pickle may have to come back inline (Ray inlines small objects in
# a task's reply up to 100 KiB).
INLINE_BYTES = 64 * 1024
# The most bytes an eager call's results may bring through its dispatcher inline, all ranks
# together: each rank's share (``inline_limit``), past which its result stays in its store.
INLINE_CALL_BYTES = 512 * 1024


def inline_limit(ranks: int, call_bytes: int = INLINE_CALL_BYTES) -> int:
    """The most bytes one rank's result may have to come back inline in a call that ``ranks``
    ranks run: ``INLINE_BYTES``, or less in a gang so large that the call's inline results
    together could pass ``call_bytes``.

    >>> inline_limit(4), inline_limit(8), inline_limit(64)
    (65536, 65536, 8192)
    """
    return min(INLINE_BYTES, call_bytes // max(ranks, 1))


class Reply(NamedTuple):
    """The dispatcher's answer to one call: its outputs' refs, never payload. (A named tuple:
    Ray pickles it on every call, several times faster than a dataclass.)"""

    refs: list  # per executing rank: its output ObjectRef
    records: list  # per rank: the ref of its output's record (or its value); [] when not kept
    workers: list[int]  # gang rank of each executing rank
    ended: bool = False  # __next__ reported exhaustion
    balanced: bool = False  # dispatch='balance': records are positions records (runtime.balance)
    values: list | None = None  # an eager call's Inline/Held per rank, in place of its refs
    bundle: Any = None  # (refs, records) as one ObjectRef its dispatcher owns (see ``packed``)
    stream: tuple[int, int] | None = None  # dispatch='balance': (call number, generation)

    def _large(self) -> bool:
        return len(self.refs) + len(self.records) > PACK_REFS_OVER

    def packed(self) -> Reply:
        """This reply as it goes to its caller: more than PACK_REFS_OVER refs travel as one
        object (put here, in the dispatcher) that the caller fetches when it needs them."""
        if not self._large():
            return self
        return self._replace(refs=[], records=[], bundle=ray.put((self.refs, self.records)))

    def unpacked(self, got: tuple[list, list] | None = None,
                 timeout: float | None = None) -> Reply:
        """The reply with its refs at hand: fetches a packed reply's bundle (or takes ``got``,
        the bundle's value awaited by an async caller)."""
        if self.bundle is None:
            return self
        refs, records = got if got is not None else ray.get(self.bundle, timeout=timeout)
        return self._replace(refs=list(refs), records=list(records), bundle=None)

    def traveling(self) -> Reply | None:
        """What a LazyResult sent elsewhere carries of this reply: itself, or None when its refs
        are many (the receiver reads the reply's ref instead, which carries them as one object)."""
        return None if self._large() else self


class Inline(NamedTuple):
    """A rank's result, pickled (at most INLINE_BYTES): comes back in the dispatcher's reply."""

    data: bytes


class Held(NamedTuple):
    """A rank's result left in its object store: ``ref`` is fetched by the caller."""

    ref: Any


class NotPicklable(TypeError):
    """A result that cannot be pickled (raised in the rank, named by the caller)."""


_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes})


def inline(result: Any, limit: int = INLINE_BYTES) -> Inline | Held:
    """In a rank: ``result`` as an eager call's reply carries it. Its exact pickled size
    decides (pickled once, as the reply needs it anyway); a result holding ObjectRefs or actor
    handles stays a Held ref (Ray keeps count of those), as does a large one.

    >>> type(inline([1, 2, 3])).__name__
    'Inline'
    """
    try:
        # a plain scalar holds no ref: pickled without the ref-checking pickler (a no-op's None)
        data = (pickle.dumps(result, protocol=5) if type(result) in _SCALARS else
                Pickler.dumps_plain(result))
    except Pickler.HasRefs:
        return Held(ray.put(result))
    except Exception as e:  # noqa: BLE001 -- named for the caller, as a TypeError
        raise NotPicklable(f"its result, of type {type(result).__name__}, cannot be pickled "
                           f"({type(e).__name__}: {e})") from None
    return Inline(data) if len(data) <= limit else Held(ray.put(result))


def values_of(outs: list, fetch: Callable[[list, list[int]], list]) -> list:
    """In the caller: the values of an eager call's Inline/Held results (other values pass);
    ``fetch(refs, positions)`` gets the held ones (the caller's error contract: a rank that
    died before its result was fetched is a death).

    >>> values_of([Inline(pickle.dumps(1)), None], fetch=None)
    [1, None]
    """
    at = [i for i, v in enumerate(outs) if isinstance(v, Held)]
    got = dict(zip(at, fetch([outs[i].ref for i in at], at), strict=True)) if at else {}
    return [got[i] if i in got else pickle.loads(v.data) if isinstance(v, Inline) else v
            for i, v in enumerate(outs)]
