"""``dispatch='balance'`` on a gang: chunks handed to whichever data-parallel group is free.

How a balanced call runs (the pure rules are in :mod:`twinkle_ray.core.balance`):

1. **The caller** (:func:`split`, in the proxy) replaces each top-level list
   argument by a :class:`Chunks` marker: its chunks inline when the list is
   small, else one ``ray.put`` per chunk (never the whole batch to every
   worker). Each worker's arguments start with a :class:`BalanceHead`: its
   data-parallel group, the number of groups, the chunk size asked for, and
   where the LazyResult arguments are (those are routed whole to the worker
   and chunked there).
2. **The dispatcher** takes the call like any other: one place in the gang's
   order, one task per worker (``GangWorker.run_balanced``), submitted at
   once. It waits for nothing; while the call runs it answers the workers'
   ``next_chunk`` asks from its :class:`~twinkle_ray.core.balance.ChunkTable`
   (a method that never blocks).
3. **Each worker** (:func:`run_chunks`) loops inside its one task: ask for its
   k-th chunk, run the method on it, check one result per item; the first
   peer of a group to ask gets the next free chunk and its tp/pp peers the
   same one. No other call runs on a rank between a balanced call's chunks.
   It returns its results concatenated and, as a second (small) output, its
   positions record ``[(start, stop), ...]``.
4. **Collect** (``LazyResult.get``) puts the results back in input order;
   routed to another gang, each consumer worker resolves its window of input
   positions from the positions records (top-level task arguments, like
   length records) and pulls only the outputs covering it (``lazy.Placed``).

Faults are those of any call: a death fails the call with WorkerDiedError
(the gang's teardown ends the chunk table, so no chunk runs twice, and with
``max_restarts`` the call is not re-run); a raising chunk ends the call's
handing out (the other groups stop at their next ask) and the error is raised
with its type.

Example::

    @remote_class()
    class Sampler:
        @remote_function(dispatch="balance", collect="flatten", chunk_size=1)
        def generate(self, prompts: list) -> list:
            return [self.engine.generate(p) for p in prompts]

    texts = sampler.generate(prompts)()   # texts[i] answers prompts[i]
"""

from __future__ import annotations

import dataclasses
import logging
import types
from dataclasses import dataclass
from typing import Any

import ray

from ..core.balance import check_result, chunk_bounds, join_items, list_length, pick_chunk_size
from ..core.dispatch import batch_len, take, worker_data_ranks
from ..core.functions import RemoteFunction
from .lazy import GangRef, LazyResult
from .routed import Placed, Window

logger = logging.getLogger(__name__)

PUT_THRESHOLD_BYTES = 64 * 1024  # as the proxy's put_large: smaller lists travel inline


@dataclass(frozen=True)
class BalanceHead:
    """The first argument of each worker's balanced task: what its chunk loop needs."""

    group: int  # this worker's data-parallel group (its data rank)
    groups: int  # the number of data-parallel groups
    chunk_size: int | None  # as asked (None: core.balance.pick_chunk_size decides)
    lazy: tuple = ()  # positions (int) / names (str) of the LazyResult arguments
    where: str = "?"  # 'Class.method()' for errors


@dataclass
class Chunks:
    """A list argument cut into chunks: ``pieces[j]`` is chunk j (its items, or an ObjectRef
    of them), covering ``bounds[j]`` of the input."""

    n: int
    bounds: list[tuple[int, int]]
    pieces: list

    def piece(self, j: int) -> Any:
        p = self.pieces[j]
        return ray.get(p) if isinstance(p, ray.ObjectRef) else p


def split(name: str, spec: RemoteFunction, gang: GangRef, execute: str, args: tuple,
          kwargs: dict, nbytes) -> list[tuple[tuple, dict]]:
    """Each worker's (args, kwargs) of a balanced call, made by the caller (see step 1).

    ``nbytes(value)`` estimates a value's size (the proxy's). ValueError for a gang whose
    class runs on its first worker only, and for list arguments of different lengths.
    """
    where = f"{gang.cls_name}.{name}()"
    if execute != "all":
        raise ValueError(f"{where} on group '{gang.group}': dispatch='balance' with "
                         f"execute={execute!r} (the gang's remote_class) is not supported: a "
                         f"balanced call runs on every data-parallel group")
    groups, data_ranks = worker_data_ranks(gang.n_workers, gang.mesh, gang.gpus_per_worker, name,
                                           gang.group)
    lazy = tuple(p for p, v in [*enumerate(args), *kwargs.items()] if isinstance(v, LazyResult))
    has_list = any(isinstance(v, list) for v in [*args, *kwargs.values()])
    if has_list or not lazy:
        n = list_length(args, kwargs, f"{where} on group '{gang.group}'")
        bounds = chunk_bounds(n, pick_chunk_size(n, groups, spec.chunk_size))
        cut = {}

        def chunked(v: Any) -> Any:
            if not isinstance(v, list):
                return v
            if id(v) not in cut:
                pieces = [v[s:e] for s, e in bounds]
                if nbytes(v) >= PUT_THRESHOLD_BYTES:  # one put per chunk
                    pieces = [ray.put(p) for p in pieces]
                cut[id(v)] = Chunks(n, bounds, pieces)
            return cut[id(v)]

        args = tuple(chunked(v) for v in args)
        kwargs = {k: chunked(v) for k, v in kwargs.items()}
    heads = {d: BalanceHead(d, groups, spec.chunk_size, lazy, where) for d in set(data_ranks)}
    return [((heads[d], *args), kwargs) for d in data_ranks]


def run_chunks(worker: Any, seq: int | None, instance: Any, method: str, args: tuple,
               kwargs: dict) -> tuple[Any, list[tuple[int, int]]]:
    """A worker's loop over the chunks of one balanced call (see step 3): returns (its
    results concatenated, or None when it ran no chunk; its positions record)."""
    head: BalanceHead = args[0]
    args = args[1:]
    fn = _raw_method(instance, method)
    n, bounds = None, None
    for v in [*args, *kwargs.values()]:
        if isinstance(v, Chunks):
            n, bounds = v.n, v.bounds
    for key in head.lazy:  # routed whole: cut here
        got = batch_len(args[key] if isinstance(key, int) else kwargs[key])
        if got is None or (n is not None and got != n):
            raise ValueError(f"{head.where} (dispatch='balance'): argument {key!r} has "
                             f"{'no batch length' if got is None else f'{got} items'}"
                             + (f", the list arguments {n}" if n is not None else ""))
        n = got
    if bounds is None:
        if not n:
            raise ValueError(f"{head.where} (dispatch='balance') got an empty batch")
        bounds = chunk_bounds(n, pick_chunk_size(n, head.groups, head.chunk_size))
    d, gen, world = worker.info.dispatcher, worker.info.generation, worker.info.world_size
    results, positions = [], []
    k = 0
    while True:
        j = ray.get(d.next_chunk.remote(gen, seq, head.group, k, len(bounds), world))
        if j is None:
            break
        s, e = bounds[j]

        def cut(key, v, j=j, s=s, e=e):
            if isinstance(v, Chunks):
                return v.piece(j)
            return take(v, s, e) if key in head.lazy else v

        out = fn(*(cut(i, v) for i, v in enumerate(args)), **{q: cut(q, v) for q, v in kwargs.items()})
        check_result(out, e - s, head.where)
        results.append(out)
        positions.append((s, e))
        k += 1
    if not results:
        return None, positions
    return join_items(results), positions


def _raw_method(instance: Any, method: str) -> Any:
    """The method as written (``remote_function``'s local chunking is for callers outside a
    gang; here the method gets the chunks themselves)."""
    attr = getattr(type(instance), method, None)
    if isinstance(attr, RemoteFunction) and attr.fn is not None:
        return types.MethodType(attr.fn, instance)
    return getattr(instance, method)


def route(lazy: LazyResult, out: Any, method: str, n: int, dispatch: Any, lengths: list,
          spec: Any, producer: GangRef) -> list:
    """One :class:`~twinkle_ray.runtime.lazy.Placed` marker per consumer worker for a
    balanced LazyResult (see step 4): the producer's positions records are appended to
    ``lengths`` (the messages' leading values); a ``slice``/``slice_dp`` consumer's window
    covers input positions, any other takes the whole value in input order."""
    slots = (len(lengths), len(lengths) + len(out.refs))
    lengths.extend(out.metas)
    named = GangRef(producer.group, producer.cls_name, dispatcher=None)
    common = dict(refs=list(out.refs), producer=named, method=lazy.method, ranks=list(out.workers),
                  position_slots=slots)
    if dispatch not in ("slice", "slice_dp"):
        return [Placed(**common)] * n
    g = spec.group
    if dispatch == "slice_dp":
        parts, index = worker_data_ranks(n, spec.mesh, g.gpus_per_worker, method, g.name)
    else:
        parts, index = n, list(range(n))
    where, source = f"{method}() on group '{g.name}'", f"{producer.cls_name}.{lazy.method}"
    return [dataclasses.replace(Placed(**common), window=Window(parts, index[i], where, source))
            for i in range(n)]
