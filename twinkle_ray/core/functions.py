"""``@remote_function``: how a method's calls split, run and join.

``remote_function`` wraps a method in a descriptor that keeps its dispatch,
execute and collect settings; on a local instance the method runs as
written. Pure: the runtime reads these settings when it routes a call.

Example::

    class Model:
        @remote_function(dispatch="slice_dp", collect="mean")
        def train_step(self, batch):
            ...

    Model().train_step([1, 2])   # local instance: a plain method call
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from . import balance
from .dispatch import check_collect, check_dispatch, check_execute


class RemoteFunction:
    """A method marked with :func:`remote_function`; a plain method on local instances."""

    def __init__(
        self,
        fn: Callable | None,
        *,
        dispatch: str | Callable = "slice",
        execute: str = "all",
        collect: str | Callable = "none",
        sync: bool = False,
        lazy_collect: bool | None = None,
        timeout: float | None = None,
        chunk_size: int | None = None,
        in_flight: int = 1,
        max_staleness: int | None = None,
        beside: bool = False,
    ):
        check_dispatch(dispatch)
        check_execute(execute)
        check_collect(collect)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"remote_function timeout must be positive, got {timeout!r}")
        check_balance(dispatch, execute, collect, chunk_size)
        check_in_flight(in_flight, dispatch, fn)
        check_max_staleness(max_staleness, dispatch)
        self.fn = fn
        self.chunk_size = chunk_size
        self.in_flight = in_flight
        self.max_staleness = max_staleness
        # the runtime's own endpoints (the weight receive): the call may run beside a balanced
        # call running on the gang instead of queueing behind it (runtime.beside)
        self.beside = bool(beside)
        self.dispatch = dispatch
        self.execute = execute
        self.collect = collect
        self.sync = sync
        self.lazy_collect = lazy_collect
        self.timeout = timeout
        if fn is not None:
            functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        if self.dispatch == "balance":  # in-process (local mode): chunk by chunk, as in a gang
            return functools.partial(_run_balanced_local, self, obj)
        return types.MethodType(self.fn, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @classmethod
    def marked(cls, **options: Any) -> Callable[[Callable], RemoteFunction]:
        """``remote_function``, with the runtime's own marks too (``beside``: the weight
        receive runs beside a running balanced call); for the runtime's endpoints."""
        cls(None, **options)  # checked now
        return lambda fn: cls(fn, **options)

    def replaced(self, **changes: Any) -> RemoteFunction:
        """A copy with ``changes`` (checked as at decoration; ValueError otherwise).

        >>> f = RemoteFunction(None, dispatch="balance", chunk_size=1)
        >>> f.replaced(max_staleness=2).max_staleness, f.max_staleness
        (2, None)
        """
        keys = ("dispatch", "execute", "collect", "sync", "lazy_collect", "timeout", "chunk_size",
                "in_flight", "max_staleness", "beside")
        unknown = sorted(set(changes) - set(keys))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; known: {list(keys)}")
        options = {k: changes.get(k, getattr(self, k)) for k in keys}
        return RemoteFunction(self.fn, **options)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", "?")
        return (f"<remote_function {name} dispatch={self.dispatch!r} execute={self.execute!r} "
                f"collect={self.collect!r}>")


def check_balance(dispatch: Any, execute: str, collect: Any, chunk_size: Any) -> None:
    """ValueError for settings ``dispatch='balance'`` cannot take: execute 'first'/'peer'
    (chunks go to every data-parallel group), a collect other than 'flatten'/'none' (the
    results are one list in input order), a chunk_size that is not a positive int, or a
    chunk_size without balance.

    >>> check_balance("balance", "first", "flatten", None)
    Traceback (most recent call last):
    ValueError: dispatch='balance' with execute='first' is not supported: a balanced call runs on every data-parallel group (execute='all')
    """
    if dispatch != "balance":
        if chunk_size is not None:
            raise ValueError(f"chunk_size={chunk_size!r} needs dispatch='balance' (got dispatch={dispatch!r})")
        return
    balance.check_chunk_size(chunk_size)
    if execute != "all":
        raise ValueError(f"dispatch='balance' with execute={execute!r} is not supported: a balanced call "
                         f"runs on every data-parallel group (execute='all')")
    if collect not in ("flatten", "none"):
        raise ValueError(f"dispatch='balance' with collect={collect!r} is not supported: a balanced "
                         f"call's results are one list in input order (collect='flatten' or 'none')")


def check_in_flight(in_flight: Any, dispatch: Any, fn: Callable | None) -> None:
    """ValueError for an ``in_flight`` that is not a positive int, one above 1 without
    ``dispatch='balance'``, or one above 1 on a plain method (requests run concurrently only
    as coroutines: the method must be ``async def``; ``fn`` None: not decorated yet).

    >>> check_in_flight(4, "balance", None)
    >>> check_in_flight(0, "balance", None)
    Traceback (most recent call last):
    ValueError: in_flight must be a positive int, got 0
    """
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight must be a positive int, got {in_flight!r}")
    if in_flight == 1:
        return
    if dispatch != "balance":
        raise ValueError(f"in_flight={in_flight} needs dispatch='balance' (got dispatch={dispatch!r}): "
                         f"requests are pulled in flight only by a balanced call")
    if fn is not None and not inspect.iscoroutinefunction(fn):
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(f"{name}: in_flight={in_flight} needs an 'async def' method (its requests "
                         f"run concurrently on the worker's event loop); {name} is a plain method")


def check_max_staleness(max_staleness: Any, dispatch: Any) -> None:
    """ValueError for a ``max_staleness`` that is neither None nor an int >= 0, and for one on
    a method that is not ``dispatch='balance'`` (only a balanced call's items carry versions).

    >>> check_max_staleness(0, "balance")
    >>> check_max_staleness(-1, "balance")
    Traceback (most recent call last):
    ValueError: max_staleness must be None or an int >= 0, got -1
    """
    if max_staleness is None:
        return
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
    if dispatch != "balance":
        raise ValueError(f"max_staleness={max_staleness} needs dispatch='balance' (got "
                         f"dispatch={dispatch!r}): only a balanced call's items carry weight versions")


def is_async(spec: RemoteFunction) -> bool:
    """Whether the method is ``async def`` (a balanced call runs it on the worker's own loop)."""
    return spec.fn is not None and inspect.iscoroutinefunction(spec.fn)


def _run_balanced_local(spec: RemoteFunction, obj: Any, *args: Any, **kwargs: Any) -> Any:
    where = f"{type(obj).__name__}.{getattr(spec.fn, '__name__', '?')}()"
    return balance.run_local(types.MethodType(spec.fn, obj), args, kwargs, spec.chunk_size, where)


DEFAULT_FUNCTION = RemoteFunction(None)


def remote_function(
    dispatch: str | Callable = "slice",
    execute: str = "all",
    collect: str | Callable = "none",
    sync: bool = False,
    lazy_collect: bool | None = None,
    timeout: float | None = None,
    chunk_size: int | None = None,
    in_flight: int = 1,
    max_staleness: int | None = None,
) -> Callable[[Callable], RemoteFunction]:
    """Mark a method of a remote class with how calls split, run and join.

    Unknown modes raise ValueError here, at decoration time.

    Args:
        dispatch: how the arguments split over the workers: ``'slice'`` |
            ``'all'`` | ``'slice_dp'`` | ``'balance'`` | ``fn(n, i, args, kwargs, mesh)``.
            ``'balance'``: the list arguments are cut into chunks of ``chunk_size``
            items, each handed to whichever data-parallel group is free (its tp/pp
            peers get the same chunk); the method takes a list and returns a list of
            the same length (else ValueError); non-list arguments go whole to every
            chunk; results come back in input order. Only with execute ``'all'``
            and collect ``'flatten'``/``'none'``.
        execute: which workers run the call: ``'all'`` | ``'first'`` | ``'peer'``.
        collect: how the workers' results join: ``'none'`` | ``'flatten'`` |
            ``'mean'`` | ``'sum'`` | ``'first'`` | ``'last_pp'`` |
            ``'last_pp_first'`` (the first result of the last pipeline stage) |
            ``fn(results, mesh)``.
        sync: return the value instead of a LazyResult.
        lazy_collect: False does the same as ``sync=True``.
        timeout: seconds to wait for the result (a balanced call: all of it); a
            CallTimeoutError names late ranks.
        chunk_size: items per chunk of a ``dispatch='balance'`` call (ValueError with
            any other dispatch). None: ``ceil(n / (8 * data-parallel groups))``, about
            8 chunks per group; 1: per item.
        in_flight: ``dispatch='balance'`` only: how many chunks each data-parallel group
            keeps running at once (default 1). Above 1 the method must be ``async def``
            (ValueError otherwise, here): the worker runs its coroutines concurrently on an
            event loop of its own and asks for the next chunk the moment one finishes.
        max_staleness: ``dispatch='balance'`` only: an item whose first weight version
            falls more than this many syncs behind the gang's is aborted (its coroutine
            cancelled) and re-run under the new weights on the same worker, so every item
            delivered has ``versions[1] - versions[0] <= max_staleness``. None: unbounded.
            Per call: ``gang.method.options(max_staleness=s)(...)``.

    Returns:
        The method decorator (it wraps the method in a ``RemoteFunction``).

    Example::

        >>> class M:
        ...     @remote_function(dispatch="slice_dp", collect="flatten")
        ...     def double(self, xs):
        ...         return [2 * x for x in xs]
        >>> M().double([1, 2])
        [2, 4]
        >>> class S:
        ...     @remote_function(dispatch="balance", collect="flatten", chunk_size=2)
        ...     def square(self, xs):
        ...         return [x * x for x in xs]
        >>> S().square([1, 2, 3])   # local: chunks [1, 2], [3]; results in input order
        [1, 4, 9]
    """
    options = dict(dispatch=dispatch, execute=execute, collect=collect, sync=sync,
                   lazy_collect=lazy_collect, timeout=timeout, chunk_size=chunk_size,
                   in_flight=in_flight, max_staleness=max_staleness)
    RemoteFunction(None, **options)  # validate now, not when the method is decorated

    def decorate(fn: Callable) -> RemoteFunction:
        return RemoteFunction(fn, **options)

    return decorate
