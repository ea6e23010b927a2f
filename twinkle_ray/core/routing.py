"""The routing rule: what a consumer rank receives for a LazyResult argument (pure, no Ray).

One rule, written once::

    value(rank) = split(collect(mode, producer outputs))[rank]

exactly what the rank would receive had the caller fetched the result and passed the
value: :func:`~twinkle_ray.core.collect.collect` joins the outputs as ``get()`` does, and
:func:`~twinkle_ray.core.split.split_arg` cuts the value as
:func:`~twinkle_ray.core.split.dispatch` cuts a passed argument. A result of several return values (tuple results, joined element-wise by
``collect``) is then cut as that tuple would be, passed.

**The fast path computes that same value with those same functions.** Each producer output
comes with a *record* (:func:`record_of`: its structure, with the length, type and dtype of
every sequence in it, none of its items). The consumer builds a *skeleton* of every output
from its record, with :class:`~twinkle_ray.core.batch.View` s in place of the sequences,
and runs the real ``collect`` and ``split_arg`` on the skeletons. What comes out names the
outputs (and the ranges in them) the rank's part is made of: only those are fetched, and the
part is assembled from them with the real ``take`` and ``concat``. Where a join cannot be
windowed without the whole value (sequences of different types or dtypes under one key, a
very long tuple, an error), the consumer fetches every output it reads, collects and splits:
the rule itself, literally.

One piece over 400 lines: the record format is written here (:func:`record_of`) and read
here (the skeletons), and the fast path must give exactly the rule's value, so the rule, the
records and the fast path that stands in for it are kept side by side, where a change to one
is seen against the others.

Example: a dp=4 producer's ``collect='flatten'`` result, routed to data rank 1 of a
``slice_dp`` consumer of data-parallel size 2, pulls outputs 2 and 3 only::

    >>> from twinkle_ray.core.split import Split
    >>> outputs = [{'ids': [0, 1], 'n': 2}, {'ids': [2, 3], 'n': 2},
    ...            {'ids': [4, 5], 'n': 2}, {'ids': [6, 7], 'n': 2}]
    >>> source = Source('flatten', [record_of(o) for o in outputs], workers=[0, 1, 2, 3])
    >>> pulled = []
    >>> fetch = lambda ks: [pulled.append(k) or outputs[k] for k in ks]
    >>> route(source, Split('slice_dp', 2, 1), fetch)
    {'ids': [4, 5, 6, 7], 'n': [2, 2]}
    >>> pulled
    [2, 3]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .balance import in_input_order, locate_positions, total_items
from .batch import View, batch_len, concat, is_tensor, take
from .collect import collect, collect_sources
from .split import Split, is_list, split_arg

# A tuple this long in an output is recorded by its length only (a skeleton of every element
# would cost more than it saves): a result holding one is collected whole.
TUPLE_RECORD_MAX = 256
# Collect modes whose join can be windowed from the records: every output is part of the
# joined value, so a part that needs an output that raised raises. The others reduce or pick
# outputs ('first', 'last_pp'): every output is fetched, so an error on any rank raises.
WINDOWED = ("flatten", "none")


class NotWindowable(Exception):
    """The skeletons cannot stand for the outputs: collect them whole."""


# --------------------------------------------------------------------------- records


def record_of(value: Any, _top: bool = True) -> tuple:
    """The record of one producer output: its structure, never its items.

    Dicts record their keys and each value's record (a dict subclass records only its type
    name: it is joined and cut for real, so it keeps its type); a tuple at the top (or inside a
    top-level tuple: a method's several return values) each element's; a list, tuple, array or
    tensor elsewhere is a *sequence* (type, length, dtype and trailing shape); anything else is
    a leaf.

    >>> record_of({'ids': [1, 2, 3], 'loss': 0.5})
    ('d', ('ids', 'loss'), (('s', 'list', 3, None), ('x',)))
    >>> record_of(([1, 2], 0.5))
    ('t', None, (('s', 'list', 2, None), ('x',)))
    """
    if isinstance(value, dict):
        if type(value) is not dict:  # a subclass (OrderedDict, a ModelOutput): the real join
            return ("D", type(value).__name__)  # and cut keep its type; no skeleton
        return ("d", tuple(value), tuple(record_of(v, False) for v in value.values()))
    if isinstance(value, tuple) and _top:
        if len(value) > TUPLE_RECORD_MAX:
            return ("T", len(value))
        kind = type(value) if hasattr(type(value), "_fields") else None
        return ("t", kind, tuple(record_of(v, True) for v in value))
    if isinstance(value, list | tuple):
        return ("s", type(value).__name__ if type(value) in (list, tuple) else "list", len(value),
                None)
    if isinstance(value, np.ndarray) and value.ndim >= 1:
        extra = (value.dtype.str, tuple(value.shape[1:]))
        if value.flags.f_contiguous and not value.flags.c_contiguous:
            extra = (*extra, "F")  # it arrives Fortran-ordered (pickled as it is laid out)
        return ("s", "ndarray", int(value.shape[0]), extra)
    if is_tensor(value) and value.dim() >= 1:
        return ("s", "tensor", int(value.shape[0]), (str(value.dtype), tuple(value.shape[1:])))
    return ("x",)


def record_balanced(value: Any, positions: list[tuple[int, int]]) -> tuple:
    """The record of one rank's output of a ``dispatch='balance'`` call: its positions record
    (the input ranges its items answer) and its structure (None when it ran no chunk)."""
    return ("b", list(positions), None if value is None else record_of(value))


# --------------------------------------------------------------------------- views


class Piece(View):
    """Items ``[start, stop)`` of the sequence at ``path`` in output ``k``, of type ``kind``
    ('list', 'tuple', 'ndarray', 'tensor'; ``extra``: an array's dtype and trailing shape)."""

    __slots__ = ("k", "path", "start", "stop", "kind", "extra")

    def __init__(self, k: int, path: tuple, start: int, stop: int, kind: str, extra: Any = None):
        self.k, self.path, self.start, self.stop, self.kind, self.extra = (
            k, path, start, stop, kind, extra)

    def batch_len(self) -> int:
        return self.stop - self.start

    def take(self, start: int, stop: int) -> Piece:
        a, b, _ = slice(start, stop).indices(self.stop - self.start)
        return Piece(self.k, self.path, self.start + a, self.start + max(a, b), self.kind,
                     self.extra)

    @classmethod
    def join(cls, pieces: list) -> Joined:
        return Joined.of(pieces)

    def __repr__(self) -> str:
        return f"Piece(out {self.k}{list(self.path)}[{self.start}:{self.stop}] {self.kind})"


class Joined(View):
    """What :func:`~twinkle_ray.core.batch.concat` makes of sequences: their segments
    ``(k, path, start, stop)`` one after another, as one ``kind`` ('list', 'ndarray', 'tensor')."""

    __slots__ = ("segments", "kind", "extra", "fresh")

    def __init__(self, segments: list[tuple[int, tuple, int, int]], kind: str, extra: Any = None,
                 fresh: bool = False):
        self.segments, self.kind, self.extra = segments, kind, extra
        # the real join concatenates (several pieces): its value is a new array or tensor, so a
        # window of it that lies in one output is not a view of that output (see _fill)
        self.fresh = fresh

    @classmethod
    def of(cls, pieces: list) -> Joined:
        """``concat(pieces)``: every piece a sequence view of one type family (lists and tuples
        join as a list; arrays or tensors of one dtype and trailing shape as one of them),
        else NotWindowable (the real join decides)."""
        segments, kinds = [], set()
        fresh = len(pieces) > 1
        for p in pieces:
            if isinstance(p, Piece):
                segments.append((p.k, p.path, p.start, p.stop))
                kinds.add(("list", None) if p.kind in ("list", "tuple") else (p.kind, p.extra))
            elif isinstance(p, Joined):
                segments.extend(p.segments)
                kinds.add((p.kind, p.extra))
                fresh = fresh or p.fresh
            else:
                raise NotWindowable(f"a {type(p).__name__} joined with sequences")
        if len(kinds) != 1:
            raise NotWindowable(f"sequences of different types joined: {sorted(map(str, kinds))}")
        kind, extra = kinds.pop()
        if fresh and kind == "ndarray" and extra[-1] == "F":
            # np.concatenate lays a join of Fortran-ordered arrays out as they are: a window of
            # it is not contiguous (passed, it is pickled by value), unlike a window of one
            # output standing for it; the real join is made (see as_concatenated)
            raise NotWindowable("Fortran-ordered arrays joined")
        return cls(segments, kind, extra, fresh)

    @classmethod
    def join(cls, pieces: list) -> Joined:
        return cls.of(pieces)

    def batch_len(self) -> int:
        return sum(b - a for _, _, a, b in self.segments)

    def take(self, start: int, stop: int) -> Joined:
        start, stop, _ = slice(start, stop).indices(self.batch_len())
        kept, offset = [], 0
        for k, path, a, b in self.segments:
            lo, hi = max(start, offset), min(stop, offset + b - a)
            if lo < hi:
                kept.append((k, path, a + lo - offset, a + hi - offset))
            offset += b - a
        if not kept and self.segments:  # nothing: an empty part of the first, for its type
            k, path, a, _ = self.segments[0]
            kept = [(k, path, a, a)]
        return Joined(kept, self.kind, self.extra, self.fresh)

    def __repr__(self) -> str:
        return f"Joined({self.segments}, {self.kind})"


class Leaf:
    """The value at ``path`` in output ``k``, whole (no batch dimension)."""

    __slots__ = ("k", "path")

    def __init__(self, k: int, path: tuple):
        self.k, self.path = k, path

    def __repr__(self) -> str:
        return f"Leaf(out {self.k}{list(self.path)})"


# --------------------------------------------------------------------------- the rule


@dataclass
class Source:
    """A producer's outputs as a consumer sees them before fetching any.

    ``mode``: the producer's collect mode (a name or a callable); ``records``: each output's
    record (:func:`record_of`, :func:`record_balanced`), None when none were kept (the outputs
    are then collected whole); ``workers``: the producer gang rank of each output; ``mesh``
    and ``gpus_per_worker``: the producer's, for ``'last_pp'``; ``balanced``: the outputs of a
    ``dispatch='balance'`` call (joined in input order, whatever the mode).
    """

    mode: Any
    records: list | None
    workers: list[int] = field(default_factory=list)
    mesh: Any = None
    gpus_per_worker: int = 1
    balanced: bool = False

    @property
    def n(self) -> int:
        return len(self.workers)


class Routed:
    """One LazyResult's value in a consumer, before any of it is fetched: its join, as
    skeletons when the records allow it (see the module docstring), else fetched whole
    (once, on first need). ``fetch(ks)`` returns producer outputs ``ks``.

    Example::

        routed = Routed(source, fetch)
        routed.list_lengths('argument 0')              # what 'slice' would cut, by name
        part = routed.part(Split('slice_dp', 2, 0))    # fetches only what the part needs
    """

    def __init__(self, source: Source, fetch: Callable[[list[int]], list],
                 windowed: Callable[[Any], Any] | None = None):
        self.source, self.fetch = source, fetch
        # a window of one output standing for the same window of a fresh concatenation
        self.windowed = windowed or as_concatenated
        self._real: list | None = None  # [the joined value], once fetched
        self._skeleton: tuple[Any, dict] | None = None
        if source.records is not None and (source.balanced or source.mode in WINDOWED):
            try:
                self._skeleton = _skeleton_value(source)
            except Exception:  # noqa: BLE001 -- not windowable (or an error the real join raises)
                self._skeleton = None

    def whole(self, again: bool = False) -> Any:
        """The joined value, fetched: the rule, literally. Fetched once; ``again``: fetched and
        joined anew, a value of its own (as a second argument's fetched value would be)."""
        if again:
            return join(self.source, self.fetch)
        if self._real is None:
            self._real = [join(self.source, self.fetch)]
        return self._real[0]

    def part(self, split: Split | None, location: str = "argument", again: bool = False) -> Any:
        """``split_arg(split, joined value)`` (the whole value when ``split`` is None),
        fetching only the outputs it is made of when the skeletons allow it. Each call but
        the first of ``whole`` gives objects of its own; ``again`` makes ``whole`` one too."""
        if split is None:
            return self.whole(again)
        if self._skeleton is not None:
            value, originals = self._skeleton
            try:
                part = split_arg(split, value, location)
            except Exception:  # noqa: BLE001 -- the real value raises the error, with its types
                part = None
            if part is not None:
                needed = sorted(_outputs_in(part, originals))
                got = dict(zip(needed, self.fetch(needed), strict=True))
                return _fill(part, originals, got, self.windowed)
        return split_arg(split, self.whole(again), location)

    def list_lengths(self, location: str = "argument") -> dict[str, int]:
        """The length of the list ``'slice'`` would cut in this value, by name (none when
        the value is not a list)."""
        value = self._skeleton[0] if self._skeleton is not None else self.whole()
        return {location: batch_len(value)} if is_list(value) else {}


def route(source: Source, split: Split | None, fetch: Callable[[list[int]], list],
          location: str = "argument") -> Any:
    """The consumer's value: ``Routed(source, fetch).part(split, location)``."""
    return Routed(source, fetch).part(split, location)


def join(source: Source, fetch: Callable[[list[int]], list]) -> Any:
    """The producer's value as ``get()`` gives it. Every output is fetched, also those the
    join does not read (``'last_pp'``: the earlier stages'), so an error raised on any rank
    is raised here, never dropped with the output that carried it."""
    outputs = fetch(list(range(source.n)))
    if source.balanced:
        return in_input_order(outputs, [r[1] for r in source.records])
    ks = collect_sources(source.mode, source.workers, device_mesh=source.mesh,
                         gpus_per_worker=source.gpus_per_worker)
    return collect(source.mode, [outputs[k] for k in ks], device_mesh=source.mesh,
                   gpus_per_worker=source.gpus_per_worker,
                   worker_indices=[source.workers[k] for k in ks])


def likely_needed(source: Source, split: Split | None) -> list[int]:
    """The outputs a consumer part most likely reads, known before any record is: every
    output, or, for a windowed join cut by ``split``, the outputs its part covers when
    every output has as many items (exact for even layouts). The runtime hands a consumer
    task their refs with it; the part itself is always computed by :func:`route`.

    >>> likely_needed(Source('flatten', None, workers=[0, 1, 2, 3]), Split('slice_dp', 2, 1))
    [2, 3]
    """
    n = source.n
    if source.balanced or split is None or source.mode not in ("flatten", "none"):
        return list(range(n))
    lo = split.index * n // split.parts
    hi = -(-(split.index + 1) * n // split.parts)
    return list(range(lo, max(hi, lo + 1)))


# --------------------------------------------------------------------------- the fast path


def _skeleton_value(source: Source) -> tuple[Any, dict]:
    """The joined value as a skeleton (views and leaves of the outputs), and the skeleton
    nodes that stand for a whole output value (id -> (node, output, path))."""
    originals: dict[int, tuple[Any, int, tuple]] = {}  # id -> (node, output, path)
    if source.balanced:
        return _balanced_skeleton(source.records), originals
    skeletons = [_skeleton(r, k, (), originals) for k, r in enumerate(source.records)]
    value = collect(source.mode, skeletons, device_mesh=source.mesh,
                    gpus_per_worker=source.gpus_per_worker, worker_indices=source.workers)
    return value, originals


def _skeleton(record: tuple, k: int, path: tuple, originals: dict) -> Any:
    tag = record[0]
    if tag == "d":
        node = {key: _skeleton(r, k, (*path, key), originals)
                for key, r in zip(record[1], record[2], strict=True)}
    elif tag == "t":
        items = [_skeleton(r, k, (*path, j), originals) for j, r in enumerate(record[2])]
        node = record[1](*items) if record[1] is not None else tuple(items)
        if not items:  # () is one object: nothing to fetch for it
            return node
    elif tag == "s":
        node = Piece(k, path, 0, record[2], record[1], record[3])
    elif tag == "x":
        node = Leaf(k, path)
    else:
        raise NotWindowable(f"output {k} holds {record!r}")
    originals[id(node)] = (node, k, path)  # the node kept alive: its id stays its own
    return node


def _balanced_skeleton(records: list) -> Any:
    """The value of a balanced call (items in input order) as views, element-wise for
    tuple results, like :func:`~twinkle_ray.core.balance.in_input_order`."""
    positions = [r[1] for r in records]
    picks = locate_positions(positions, 0, total_items(positions))
    if not picks:
        raise NotWindowable("an empty balanced result")

    def build(path: tuple, recs: list) -> Any:
        first = recs[picks[0][0]]
        if first[0] == "t":
            items = [build((*path, j), [None if r is None else r[2][j] for r in recs])
                     for j in range(len(first[2]))]
            return first[1](*items) if first[1] is not None else tuple(items)
        if first[0] != "s":
            raise NotWindowable(f"a balanced result holding {first!r}")
        return Piece.join([Piece(w, path, a, b, recs[w][1], recs[w][3]) for w, (a, b) in picks])

    return build((), [None if r[2] is None else r[2] for r in records])


def _outputs_in(node: Any, originals: dict) -> set[int]:
    hit = originals.get(id(node))
    if hit is not None:
        return {hit[1]}
    if isinstance(node, Leaf | Piece):
        return {node.k}
    if isinstance(node, Joined):
        return {k for k, _, _, _ in node.segments}
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, list | tuple):
        return set().union(*(_outputs_in(x, originals) for x in node))
    return set()


def as_concatenated(value: Any) -> Any:
    """``value``, a window of one output, as the same window of a fresh concatenation of
    several outputs would be (what the real join gives, and ``concat`` of one piece does not):
    an array a writable C-ordered copy (``np.concatenate`` of C-ordered outputs: a join with a
    Fortran-ordered output, which ``np.concatenate`` lays out otherwise, is never windowed,
    see :class:`Joined`); a tensor contiguous (``torch.cat``); anything else as it is.

    >>> a = np.arange(4); a.flags.writeable = False
    >>> as_concatenated(a[1:3]).flags.writeable
    True
    """
    if isinstance(value, np.ndarray):
        return np.array(value, order="C")
    if is_tensor(value):
        return value.contiguous()
    return value


def _fill(node: Any, originals: dict, got: dict[int, Any],
          windowed: Callable[[Any], Any] = as_concatenated) -> Any:
    """The real value a skeleton part stands for, built with the real ``take`` and
    ``concat`` from the fetched outputs ``got``. A window of one output that the real join
    cuts from a concatenation of several (a fresh value) is given as ``windowed`` makes it."""
    hit = originals.get(id(node))
    if hit is not None:
        return _at(got[hit[1]], hit[2])
    if isinstance(node, Piece):
        return take(_at(got[node.k], node.path), node.start, node.stop)
    if isinstance(node, Joined):
        parts = [take(_at(got[k], path), a, b) for k, path, a, b in node.segments]
        if len(parts) == 1 and node.fresh:
            return windowed(parts[0])
        return concat(parts)
    if isinstance(node, dict):
        return {key: _fill(v, originals, got, windowed) for key, v in node.items()}
    if isinstance(node, tuple):
        items = [_fill(x, originals, got, windowed) for x in node]
        return type(node)(*items) if hasattr(type(node), "_fields") else tuple(items)
    if isinstance(node, list):
        return [_fill(x, originals, got, windowed) for x in node]
    if isinstance(node, Leaf):
        return _at(got[node.k], node.path)
    raise TypeError(f"routing: unexpected part {node!r}")


def _at(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value
