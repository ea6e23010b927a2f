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
import types
from collections.abc import Callable
from typing import Any

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
    ):
        check_dispatch(dispatch)
        check_execute(execute)
        check_collect(collect)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"remote_function timeout must be positive, got {timeout!r}")
        self.fn = fn
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
        return types.MethodType(self.fn, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", "?")
        return (f"<remote_function {name} dispatch={self.dispatch!r} execute={self.execute!r} "
                f"collect={self.collect!r}>")


DEFAULT_FUNCTION = RemoteFunction(None)


def remote_function(
    dispatch: str | Callable = "slice",
    execute: str = "all",
    collect: str | Callable = "none",
    sync: bool = False,
    lazy_collect: bool | None = None,
    timeout: float | None = None,
) -> Callable[[Callable], RemoteFunction]:
    """Mark a method of a remote class with how calls split, run and join.

    Unknown modes raise ValueError here, at decoration time.

    Args:
        dispatch: how the arguments split over the workers: ``'slice'`` |
            ``'all'`` | ``'slice_dp'`` | ``fn(n, i, args, kwargs, mesh)``.
        execute: which workers run the call: ``'all'`` | ``'first'`` | ``'peer'``.
        collect: how the workers' results join: ``'none'`` | ``'flatten'`` |
            ``'mean'`` | ``'sum'`` | ``'first'`` | ``'last_pp'`` |
            ``'last_pp_first'`` (the first result of the last pipeline stage) |
            ``fn(results, mesh)``.
        sync: return the value instead of a LazyResult.
        lazy_collect: False does the same as ``sync=True``.
        timeout: seconds to wait for the result; a CallTimeoutError names late ranks.

    Returns:
        The method decorator (it wraps the method in a ``RemoteFunction``).

    Example::

        >>> class M:
        ...     @remote_function(dispatch="slice_dp", collect="flatten")
        ...     def double(self, xs):
        ...         return [2 * x for x in xs]
        >>> M().double([1, 2])
        [2, 4]
    """
    options = dict(dispatch=dispatch, execute=execute, collect=collect, sync=sync,
                   lazy_collect=lazy_collect, timeout=timeout)
    RemoteFunction(None, **options)  # validate now, not when the method is decorated

    def decorate(fn: Callable) -> RemoteFunction:
        return RemoteFunction(fn, **options)

    return decorate
