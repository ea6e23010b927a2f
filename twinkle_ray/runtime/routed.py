"""Routed values in the consumer worker: which part of a producer's outputs it gets, and how.

The dispatcher routes a LazyResult argument without waiting for its values:
each consumer worker's task carries a :class:`Pieces` (outputs joined in the
worker, sliced by its :class:`Window`) or a :class:`Collected` (a whole value
collected there, then sliced) naming only the producer refs that cover its
slice. ``resolve_routed`` materialises them in the worker, pulling the refs
from the producers' object stores (``pull`` names a failed producer).

Example (in a worker)::

    value = resolve_routed(Pieces(refs, window=Window(parts=2, index=1)), lengths)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ObjectFetchTimedOutError, RayError

from ..core.balance import join_items, locate_positions, take_items, total_items
from ..core.dispatch import batch_len, collect_sources, concat, span, take
from ..core.dispatch import collect as collect_results
from ..core.routing import length_record, locate, plain_length, tuple_arity
from .lazy import OUTPUT_REFS, GangRef, LazyResult, fetch, fetch_timed_out


@dataclass
class Window:
    """How a consumer worker finds its own slice of a routed value, in the worker.

    The dispatcher never waits for the producers' length records: it passes
    them to the consumer's task as top-level arguments (Ray resolves them
    before the task runs) and the worker computes its window from them: part
    ``index`` of ``parts`` contiguous parts (its data rank of the data world
    size for ``slice_dp``, its position among the workers for ``slice``).
    """

    parts: int
    index: int
    where: str = ""  # "train_step() on group 'trainer'", for the short-batch error
    source: str = ""  # "Sampler.generate", likewise

    def pieces(self, lengths: list[int], element: tuple = ()) -> list[tuple[int, tuple[int, int] | None]]:
        total = sum(lengths)
        if total < self.parts:
            part = "".join(f"[{j}]" for j in element)
            what = f"element {part} of the tuple from {self.source}" if element else self.source
            raise ValueError(
                f"{self.where}: batch of {total} items (from {what}) is smaller than the "
                f"data-parallel size {self.parts}"
            )
        return locate(lengths, *span(total, self.parts, self.index))

    def apply(self, value: Any, records: list, element: tuple = ()) -> Any:
        """This window of a whole (joined) value: what slicing the fetched value gives.

        ``records``: the length records of the results joined into ``value``; when
        they are all a tuple's, ``value`` was joined element-wise and is sliced so.
        """
        arity = tuple_arity(records)
        if arity is not None and isinstance(value, tuple) and len(value) == arity:
            items = [self.apply(v, [r.items[j] for r in records], (*element, j))
                     for j, v in enumerate(value)]
            return _like(value, items)
        try:
            n = batch_len(value)
        except ValueError:  # a dict whose values differ in length: key by key, as slice_dp splits it
            return {k: self.apply(v, [], element) for k, v in value.items()}
        if n is None:
            return value
        [(_, w)] = self.pieces([n], element)
        return value if w is None else take(value, *w)


def _like(value: tuple, items: list) -> tuple:
    """A tuple of ``items`` of ``value``'s type (a namedtuple keeps its type, as in collect)."""
    return type(value)(*items) if hasattr(type(value), "_fields") else tuple(items)


def _at(value: Any, element: tuple) -> Any:
    for j in element:
        value = value[j]
    return value


@dataclass
class Pieces:
    """A routed lazy value: producer outputs (or parts of them), joined in the consumer worker.

    The consumer gets what fetching the value (the producer's ``collect``:
    ``'flatten'``, ``'none'`` or ``'first'``) and slicing it by its ``window``
    gives. With a window, the worker picks the covering outputs itself from the
    producers' length records (the resolved values at positions ``length_slots``
    of its task's leading arguments): tuple results are joined element-wise, so
    each element is sliced by its own lengths. Only the covering producer refs
    are pulled.
    """

    refs: list | None  # None: see refs_ref
    as_list: bool = False  # items are whole per-rank results (collect='none'), not concatenated
    producer: GangRef | None = None
    method: str = ""
    ranks: list | None = None  # producer rank of each ref
    window: Window | None = None
    length_slots: tuple[int, int] | None = None
    collect: str = "flatten"  # the producer's collect mode: 'flatten', 'none' or 'first'
    # Aligned layouts (output k is this worker's own slice when lengths are even): output
    # ``aligned`` also travels as leading argument ``aligned_slot``, so Ray hands it over
    # with the task, as it does for raw Ray's direct ref passing.
    aligned: int | None = None
    aligned_slot: int | None = None
    # Aligned markers hold the producer refs as one object (``refs_ref``: the producer's
    # CallOutput, its first ``n_refs`` refs; refs is None) that the worker fetches
    # only when uneven lengths need another rank's output: each task then carries one nested
    # ref instead of one per producer output. ``own`` is the aligned output until the
    # dispatcher moves it into the task's leading arguments.
    refs_ref: Any = None
    n_refs: int = 0
    own: Any = None

    def materialize(self, lengths: tuple = ()) -> Any:
        n = len(self.refs) if self.refs is not None else self.n_refs
        if self.window is None or self.length_slots is None:  # the whole value
            return collect_results(self.collect, self._fetch(list(range(n)), lengths))
        records = list(lengths[self.length_slots[0]:self.length_slots[1]])
        plan = self._plan(records, ())
        needed = sorted(_needed(plan))
        values = dict(zip(needed, self._fetch(needed, lengths), strict=True))
        return self._assemble(plan, values)

    def _plan(self, records: list, element: tuple) -> tuple:
        """Which outputs (and ranges) make up this worker's part, element by element."""
        arity = tuple_arity(records)
        if arity is not None:
            return ("tuple", element, [self._plan([r.items[j] for r in records], (*element, j))
                                       for j in range(arity)])
        lens = [1] * len(records) if self.as_list else [plain_length(r) for r in records]
        if all(isinstance(x, int) for x in lens):
            return ("pieces", element, self.window.pieces(lens, element))
        return ("whole", element, records)  # not one batch: joined whole, then sliced

    def _assemble(self, plan: tuple, values: dict) -> Any:
        kind, element, detail = plan
        if kind == "tuple":
            items = [self._assemble(sub, values) for sub in detail]
            return _like(_at(values[min(_needed(plan))], element), items)
        if kind == "whole":
            joined = collect_results(self.collect, [_at(values[k], element) for k in range(len(detail))])
            return self.window.apply(joined, detail, element)
        parts = [_at(values[k], element) for k, _ in detail]
        parts = [v if w is None else take(v, *w) for v, (_, w) in zip(parts, detail, strict=True)]
        if self.as_list:
            return parts
        return concat(parts) if self.collect == "flatten" else parts[0]

    def _fetch(self, ks: list[int], lengths: tuple) -> list:
        """The values of outputs ``ks`` (the aligned one from the task's leading values)."""
        fetch_ks = [k for k in ks if k != self.aligned or self.aligned_slot is None]
        if fetch_ks and self.refs is None:
            try:
                self.refs = list(ray.get(self.refs_ref).unpacked().refs)[:self.n_refs]
            except ObjectFetchTimedOutError as e:  # Ray found no copy in time: not a death
                raise fetch_timed_out(e, self.producer, self.method, None, OUTPUT_REFS) from None
            except RayError as e:  # aligned markers name their producer
                raise self.producer.plan_lost(e, self.method) from None
        got = dict(zip(fetch_ks, pull([self.refs[k] for k in fetch_ks], self.producer, self.method,
                                      [self.ranks[k] if self.ranks else None for k in fetch_ks]),
                       strict=True))
        return [got[k] if k in got else lengths[self.aligned_slot] for k in ks]


def _needed(plan: tuple) -> set[int]:
    """The outputs a Pieces plan reads."""
    kind, _, detail = plan
    if kind == "tuple":
        return set().union(*(_needed(sub) for sub in detail))
    if kind == "whole":
        return set(range(len(detail)))
    return {k for k, _ in detail}


@dataclass
class Collected:
    """A whole lazy value collected in the consuming worker (mean, sum, last_pp, custom
    collects), then sliced by the consumer's ``window`` (element-wise for tuples), as slicing
    the fetched value would."""

    refs: list
    collect: Any
    workers: list[int]
    mesh: Any = None
    gpus_per_worker: int = 1
    producer: GangRef | None = None
    method: str = ""
    window: Window | None = None

    def materialize(self, lengths: tuple = ()) -> Any:
        # Only the outputs the collect reads are pulled ('last_pp': the last stage's, one per
        # data rank; 'last_pp_first': one).
        keep = collect_sources(self.collect, self.workers, device_mesh=self.mesh,
                               gpus_per_worker=self.gpus_per_worker)
        workers = [self.workers[k] for k in keep]
        results = pull([self.refs[k] for k in keep], self.producer, self.method, workers)
        value = collect_results(
            self.collect,
            results,
            device_mesh=self.mesh,
            gpus_per_worker=self.gpus_per_worker,
            worker_indices=workers,
        )
        if self.window is None:
            return value
        return self.window.apply(value, [length_record(r) for r in results])


@dataclass
class Placed:
    """A routed balanced value (``dispatch='balance'``): its items lie in the producer's
    outputs as their positions records say (resolved leading values ``position_slots`` of the
    task). A ``window`` (slice/slice_dp consumers) is a part of the input positions; without
    one the consumer takes the whole value. Only the outputs covering it are pulled, and the
    items come in input order, whichever worker produced them."""

    refs: list
    producer: GangRef | None = None
    method: str = ""
    ranks: list | None = None
    position_slots: tuple[int, int] = (0, 0)
    window: Window | None = None

    def materialize(self, lengths: tuple = ()) -> Any:
        positions = list(lengths[self.position_slots[0]:self.position_slots[1]])
        total = total_items(positions)
        lo, hi = 0, total
        if self.window is not None:
            w = self.window
            if total < w.parts:
                raise ValueError(f"{w.where}: batch of {total} items (from {w.source}) is smaller "
                                 f"than the data-parallel size {w.parts}")
            lo, hi = span(total, w.parts, w.index)
        picks = locate_positions(positions, lo, hi)
        ks = sorted({k for k, _ in picks})
        got = dict(zip(ks, pull([self.refs[k] for k in ks], self.producer, self.method,
                                [self.ranks[k] if self.ranks else None for k in ks]), strict=True))
        return join_items([take_items(got[k], a, b) for k, (a, b) in picks])


def pull(refs: list, producer: GangRef | None, method: str, ranks: list) -> list:
    """The values of a producer's outputs in a consumer; a failed producer is named, not hidden.

    One ``ray.get`` of the refs. On a failure, the caller's rules
    (:func:`~twinkle_ray.runtime.lazy.fetch`): a producer worker that died
    anywhere makes this raise the producer gang's WorkerDiedError (group,
    class, rank), whatever another rank raised; else a producer's own exception
    is re-raised as itself with a note naming the producer.
    """
    try:
        return ray.get(refs)
    except RayError:
        if producer is None:
            raise
    try:
        return fetch(refs, ranks, producer, method, None)
    except Exception as err:  # a death, the producer's own error, or Ray's (e.g. unpickling)
        err.add_note(f"while fetching an output of {producer.cls_name}.{method}() on group "
                     f"'{producer.group}' as an input")
        raise


def resolve_routed(value: Any, lengths: tuple = ()) -> Any:
    """Materialise what the proxy or dispatcher put in place of an argument, in the worker.

    Routed markers are fetched from the producers (``lengths``: the task's
    resolved length records); an ObjectRef (a large value the proxy
    ``ray.put``, when Ray did not resolve it as a top-level argument) is
    fetched; other values pass through.
    """
    if isinstance(value, (Pieces, Collected, Placed)):
        return value.materialize(lengths)
    if isinstance(value, ray.ObjectRef):
        return ray.get(value)
    if isinstance(value, LazyResult):  # a LazyResult passed whole (e.g. in local use)
        return value.get()
    return value
