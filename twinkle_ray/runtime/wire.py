"""The call's wire format: what a caller sends its gang's dispatcher, and each rank's task.

One piece, a little over 400 lines: the :class:`Call`, the :class:`Task` and the pickler that
writes and reads them are one format; split, each half would have to know the other's fields.

A call travels as one :class:`Call` (caller -> dispatcher), then as one actor task per
rank, ``worker.run(task, tops)`` (dispatcher -> rank), where ``task`` is a :class:`Task`
and ``tops`` the refs of what the caller put (large arrays and pickles, ObjectRefs passed
whole), fetched by the rank inside its call.

**Arguments are pickled by the caller** (:meth:`Encoding.encode`), each argument on its
own, once per distinct slice of them (the tp/pp peers of a data rank share one), with a
pickler (:class:`Pickler`) that:

- turns every LazyResult, wherever it sits (top level, keyword, inside dicts, lists,
  tuples, dataclasses, any object pickle can walk), into a *slot*: a :class:`Route` the
  dispatcher resolves and the rank materialises (:mod:`~twinkle_ray.runtime.routed`);
- keeps ObjectRefs and actor handles out of the bytes (``nested``, serialised by Ray,
  which keeps count of them); an ObjectRef passed as a whole argument is given to the
  method as its value, as for any Ray task;
- puts every array or tensor of ``PUT_BYTES`` or more in the object store (the rank
  fetches it zero-copy), and the arguments' pickles themselves, largest first, until
  those left in the task come to less than ``PUT_BYTES`` together;
- pickles a tensor that is a view of a larger storage (a slice of a batch) as a copy of
  its own elements: torch would pickle the whole storage.

So the dispatcher only ever holds bytes it never unpickles, small ones, and refs: no
payload, no user type, and nothing it could fail to unpickle. Sizes are the real
pickled sizes, not estimates. An argument the rank cannot unpickle (a module the caller
has and the workers lack) fails the call there, naming the argument (:func:`decode`).

Example::

    enc = Encoding(own_gang=gang)
    s = enc.encode((batch,), {}, split)                              # the caller
    args, kwargs = decode(task, tops, slot, "Model.f() on rank 0")   # the rank
"""

from __future__ import annotations

import io
import pickle
from typing import Any, NamedTuple

import cloudpickle
import numpy as np
import ray
from ray.actor import ActorHandle

from ..core.dispatch import Split, is_tensor
from .together import StartFailed

# An array, a tensor, or the pickled arguments of a call this large go to the object store
# (the dispatcher never holds them; a rank fetches its own).
PUT_BYTES = 64 * 1024


class Routable:
    """An argument that stands for another call's outputs (a LazyResult): routed, not sent."""

    __slots__ = ()

    def route_facts(self) -> Route:
        """The facts the dispatcher routes it by (never its value)."""
        raise NotImplementedError


class Route(NamedTuple):
    """One routed argument of a call (a slot), as its caller sends it. (Named tuples, here and
    below: Ray pickles them several times faster than dataclasses, on every call.)"""

    reply_ref: Any  # ObjectRef of the producer call's Reply (its caller owns it)
    reply: Any = None  # that Reply when the sender has it at hand (small ones only)
    gang: Any = None  # the producer's GangRef; None: the gang called (its own outputs)
    method: str = ""
    turn: tuple | None = None  # (caller id, number) of the producer call
    collect: Any = "none"  # the producer's collect mode; a callable pickled (bytes; put if large)
    cut: bool = False  # sits where the consumer's dispatch cuts it (else passed whole)
    location: str = "argument"  # where it sits, for errors: "argument 0 ['rollouts']"


class Cut:
    """A Routable at a position the call's dispatch cuts (see :func:`mark_cuts`)."""

    __slots__ = ("value", "location")

    def __init__(self, value: Routable, location: str):
        self.value, self.location = value, location


class Resolved(NamedTuple):
    """An argument that was an ObjectRef passed whole: the rank gets its value, top ``top``."""

    top: int


class Slice(NamedTuple):
    """One distinct set of a call's arguments, encoded: each argument pickled on its own."""

    # per positional argument: its pickle (bytes), the top holding its pickle (int), or a ref
    # passed whole (Resolved)
    args: tuple = ()
    kwargs: dict = {}  # likewise, per keyword
    tops: list = []  # refs of what the caller put, and ObjectRefs passed whole
    nested: list = []  # refs and handles inside the arguments
    split: Split | None = None  # how a routed value at a cut position is cut for its ranks
    balance: Any = None  # dispatch='balance': the rank's chunk loop (runtime.balance.BalanceHead)
    # a dispatch function with LazyResults among the arguments: (its gang size, mesh, gpus per
    # worker); each rank applies it to the values, as the caller would to the fetched ones
    reslice: tuple | None = None


class Call(NamedTuple):
    """One call as its caller sends it to the gang's dispatcher (one task argument)."""

    method: str
    slices: list[Slice]
    of_rank: list[int] | None  # the slice of each gang rank; None: slices[0] for every rank
    routes: list[Route]
    execute: str  # 'all', 'first' or 'peer'
    caller: tuple[int, int] | None = None  # (rank, world size) of a calling gang worker ('peer')
    turn: tuple | None = None  # (caller id, number, previous call: [settled ref] | SETTLED | None)
    returns: str = "value"  # what each rank returns: 'value', 'meta' (and a record), 'inline'
    wait_end: bool = False  # iteration: wait for the records, to see StopIteration
    # the method may run beside a running balanced call (RemoteFunction.beside: the weight receive)
    beside: bool = False
    version: int | None = None  # on success, the gang's weight version becomes this (a sync's number)


class Task(NamedTuple):
    """One rank's task of a call (its first argument; ``tops`` the second)."""

    method: str
    seq: int  # the gang's call number: what the rank reports (stuck check, failures)
    returns: str  # 'value', 'meta' (the result and its record) or 'inline'
    args: tuple  # per argument: its pickle, or the top holding it (see Slice)
    kwargs: dict
    nested: list  # refs and handles inside the arguments
    routes: tuple  # per slot: a routed.RouteIn
    split: Split | None
    balance: Any = None
    reslice: tuple | None = None  # see Slice
    inline_bytes: int = 64 * 1024  # returns="inline": the most bytes of its result inline (reply.inline_limit)
    # runtime.beside: a beside call names the balanced call it runs beside (GangWorker.run_beside);
    # a call on the run thread names the last beside call before it, which must end first
    after: int | None = None
    follows: int | None = None
    version: int | None = None  # see Call.version


# --------------------------------------------------------------------------- the caller


class Pickler(cloudpickle.CloudPickler):
    """cloudpickle, with routed arguments, refs and large arrays kept out of the bytes."""

    class HasRefs(Exception):
        """:meth:`dumps_plain` met an ObjectRef, an actor handle or a LazyResult."""

    def __init__(self, file: io.BytesIO, encoding: Encoding | None):
        super().__init__(file, protocol=5)
        self.encoding = encoding

    def reducer_override(self, obj: Any) -> Any:
        enc = self.encoding
        if isinstance(obj, Cut | Routable | ray.ObjectRef | ActorHandle):
            if enc is None:
                raise Pickler.HasRefs(type(obj).__name__)
            if isinstance(obj, Cut):
                return _slot, (enc.route(obj.value, True, obj.location),)
            if isinstance(obj, Routable):
                return _slot, (enc.route(obj, False, "argument"),)
            return _nested, (enc.nest(obj),)
        if is_tensor(obj) and partial_view(obj):  # torch pickles a view with its storage
            return _same, (obj.clone(memory_format=contiguous_format()),)
        if enc is not None and _big_array(obj):
            return _top, (enc.put(obj),)
        return super().reducer_override(obj)

    @classmethod
    def dumps_plain(cls, obj: Any) -> bytes:
        """Pickled ``obj`` (cloudpickle); HasRefs when it holds refs Ray must count."""
        buf = io.BytesIO()
        cls(buf, None).dump(obj)
        return buf.getvalue()


def partial_view(t: Any) -> bool:
    """Whether tensor ``t`` is a view of a larger storage (a slice of a batch): pickled, it
    would carry the whole storage. Plain strided tensors only; one that records gradients
    travels as it is."""
    return (t.layout is _strided() and not t.requires_grad and not t.is_quantized
            and t.untyped_storage().nbytes() > t.nbytes)


def _strided() -> Any:
    import torch

    return torch.strided


def contiguous_format() -> Any:
    import torch

    return torch.contiguous_format


def _same(value: Any) -> Any:
    return value


def _big_array(obj: Any) -> bool:
    if type(obj) is np.ndarray:
        return not obj.dtype.hasobject and obj.nbytes >= PUT_BYTES
    return is_tensor(obj) and obj.nbytes >= PUT_BYTES


class Encoding:
    """The encoding of one call: its slots and its puts (one per object, across slices)."""

    def __init__(self, own_gang: Any):
        self.own_gang = own_gang
        self.routes: list[Route] = []
        self._route_at: dict[tuple[int, bool], int] = {}
        self._puts: dict[int, Any] = {}
        self._keep: list = []  # the objects put, alive until the call is encoded (ids unique)
        self._tops: list = []  # the tops and nested refs of the slice being encoded
        self._nested: list = []

    def route(self, value: Routable, cut: bool, location: str) -> int:
        key = (id(value), cut)
        j = self._route_at.get(key)
        if j is None:
            facts = value.route_facts()
            own = facts.gang is self.own_gang  # the dispatcher knows its own gang
            facts = facts._replace(gang=None if own else facts.gang, cut=cut, location=location)
            j = self._route_at[key] = len(self.routes)
            self.routes.append(facts)
            self._keep.append(value)
        return j

    def nest(self, ref: Any) -> int:
        self._nested.append(ref)
        return len(self._nested) - 1

    def put(self, obj: Any) -> int:
        ref = self._puts.get(id(obj))
        if ref is None:
            ref = self._puts[id(obj)] = ray.put(obj)
            self._keep.append(obj)
        return self.top(ref)

    def top(self, ref: Any) -> int:
        self._tops.append(ref)
        return len(self._tops) - 1

    def encode(self, args: tuple, kwargs: dict, split: Split | None, balance: Any = None,
               reslice: tuple | None = None) -> Slice:
        """One slice: each argument pickled (see the module docstring). TypeError names an
        argument that cannot be pickled."""
        self._tops, self._nested = [], []
        items = {i: self._one(a, f"argument {i}") for i, a in enumerate(args)}
        items.update((k, self._one(v, f"argument {k!r}")) for k, v in kwargs.items())
        # the pickles that stay in the task come to less than PUT_BYTES together: the
        # largest are put until they do (so no number of arguments carries payload through
        # the dispatcher)
        inline = sorted((k for k, v in items.items() if isinstance(v, bytes)),
                        key=lambda k: len(items[k]))
        total = sum(len(items[k]) for k in inline)
        while total >= PUT_BYTES:
            k = inline.pop()
            total -= len(items[k])
            items[k] = self.top(ray.put(items[k]))
        return Slice(tuple(items[i] for i in range(len(args))), {k: items[k] for k in kwargs},
                     self._tops, self._nested, split, balance, reslice)

    def _one(self, value: Any, name: str) -> bytes | int | Resolved:
        if isinstance(value, ray.ObjectRef):  # a whole argument: Ray resolves it to its value
            return Resolved(self.top(value))
        buf = io.BytesIO()
        try:
            Pickler(buf, self).dump(value)
        except StartFailed as e:  # a gang in it failed to start: that is the error
            raise e.error from None
        except Exception as e:
            raise TypeError(f"{name} of type {type(value).__name__} cannot be pickled: "
                            f"{type(e).__name__}: {e}") from None
        data = buf.getvalue()
        return self.top(ray.put(data)) if len(data) >= PUT_BYTES else data


def unpicklable(args: tuple, kwargs: dict) -> str | None:
    """Which of the arguments cannot be pickled, and why (None: all can). A gang whose start-up
    failed, among them, raises that failure instead (it is the error to see).

    >>> import threading
    >>> unpicklable((1, threading.Lock()), {})[:46]
    'argument 1 of type lock cannot be pickled: can'
    """
    for name, v in [*((f"argument {i}", a) for i, a in enumerate(args)),
                    *((f"argument '{k}'", v) for k, v in kwargs.items())]:
        try:
            cloudpickle.dumps(v)
        except StartFailed as e:  # a gang in it failed to start: that is the error
            raise e.error from None
        except Exception as e:
            return f"{name} of type {type(v).__name__} cannot be pickled: {e}"
    return None


def mark_cuts(mode: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Mark the LazyResults at positions dispatch ``mode`` cuts: a whole argument under
    ``'slice'`` and ``'slice_dp'``, and a value reached through dicts only under
    ``'slice_dp'`` (it cuts dicts key by key). A LazyResult anywhere else goes whole, as its
    fetched value would. Containers are copied where a mark goes in, never changed.

    >>> class L(Routable): pass
    >>> x = L()
    >>> a, kw = mark_cuts("slice_dp", ({"r": x, "k": [x]},), {})
    >>> type(a[0]["r"]).__name__, a[0]["k"][0] is x
    ('Cut', True)
    """
    if mode not in ("slice", "slice_dp"):
        return args, kwargs

    def mark(v: Any, where: str, deep: bool) -> Any:
        if isinstance(v, Routable):
            return Cut(v, where)
        if deep and isinstance(v, dict):
            marked = {k: mark(x, f"{where} [{k!r}]", True) for k, x in v.items()}
            if all(marked[k] is v[k] for k in v):
                return v
            out = dict(v) if type(v) is dict else _copy(v)
            out.update(marked)
            return out
        return v

    deep = mode == "slice_dp"
    new_args = tuple(mark(a, f"argument {i}", deep) for i, a in enumerate(args))
    new_kwargs = {k: mark(v, f"argument {k!r}", deep) for k, v in kwargs.items()}
    if all(x is y for x, y in zip(new_args, args, strict=True)):
        new_args = args
    if all(new_kwargs[k] is kwargs[k] for k in kwargs):
        new_kwargs = kwargs
    return new_args, new_kwargs


def _copy(d: dict) -> dict:
    import copy

    return copy.copy(d)


# --------------------------------------------------------------------------- the rank


# Placeholders in the pickled arguments: a rank's Unpickler maps each to its own table.
def _slot(j: int) -> Any:
    raise RuntimeError("a twinkle_ray call's argument was unpickled outside its gang's worker")


def _nested(i: int) -> Any:
    raise RuntimeError("a twinkle_ray call's argument was unpickled outside its gang's worker")


def _top(i: int) -> Any:
    raise RuntimeError("a twinkle_ray call's argument was unpickled outside its gang's worker")


class Unpickler(pickle.Unpickler):
    """A rank's unpickler of its arguments: slots, nested refs and tops filled in."""

    def __init__(self, data: bytes, tops: tuple, nested: list, slot):
        super().__init__(io.BytesIO(data))
        self._tables = {"_slot": slot, "_nested": nested.__getitem__, "_top": tops.__getitem__}

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name in self._tables:
            return self._tables[name]
        return super().find_class(module, name)


def decode(task: Task, tops: tuple, slot, where: str = "") -> tuple[tuple, dict]:
    """The rank's (args, kwargs): ``tops`` are the values of the task's tops, ``slot(j)``
    gives routed argument ``j``'s value. An argument that cannot be unpickled here (a module
    the caller has and the workers lack, a ``__setstate__`` that raises) raises TypeError
    naming it and ``where`` (the call, the rank); a routed value's own error (a producer's
    death, a batch too small) is raised as it is."""

    def routed(j: int) -> Any:
        try:
            return slot(j)
        except BaseException as e:  # not the unpickling's: carried out as it is
            raise _RoutedError(e) from None

    def one(item: bytes | int | Resolved, name: str) -> Any:
        if isinstance(item, Resolved):  # an ObjectRef passed whole: its value
            return tops[item.top]
        data = tops[item] if isinstance(item, int) else item
        try:
            return Unpickler(data, tops, task.nested, routed).load()
        except _RoutedError as e:
            raise e.error from None
        except Exception as e:
            missing = getattr(e, "name", None) if isinstance(e, ImportError) else None
            hint = (f"{missing} is importable in the caller but not in the gang's Ray workers; "
                    f"ship it with runtime_env py_modules or working_dir; " if missing else "")
            raise TypeError(f"{where}: {name} cannot be unpickled in this Ray worker "
                            f"({type(e).__name__}: {e}): {hint}the call did not run") from None

    return (tuple(one(a, f"argument {i}") for i, a in enumerate(task.args)),
            {k: one(v, f"argument {k!r}") for k, v in task.kwargs.items()})


class _RoutedError(Exception):
    """A routed value's own error, carried through the unpickler (see ``decode``)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error
