"""``@remote_class`` and ``@remote_function``: Twinkle's decorators.

``remote_function`` wraps a method in a descriptor that keeps its dispatch,
execute and collect settings; on a local instance the method runs as
written. ``remote_class`` is applied once, at decoration time: construction
with ``remote_group='name'`` in Ray mode returns a GangProxy (a gang of
workers), anything else builds the object in-process.

Example::

    @remote_class()
    class Model:
        def __init__(self, device_mesh=None):
            ...

        @remote_function(dispatch="slice_dp", collect="mean")
        def train_step(self, batch):
            ...

    twinkle_ray.initialize(groups=[DeviceGroup("trainer", 4, "cpu")])
    model = Model(device_mesh=DeviceMesh.from_sizes(dp_size=4), remote_group="trainer")
    loss = model.train_step(list(range(64)))()
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

    dispatch: ``'slice'`` | ``'all'`` | ``'slice_dp'`` | ``fn(n, i, args, kwargs, mesh)``.
    execute: ``'all'`` | ``'first'`` | ``'peer'``.
    collect: ``'none'`` | ``'flatten'`` | ``'mean'`` | ``'sum'`` | ``'first'`` |
    ``'last_pp'`` | ``fn(results, mesh)``.
    sync / lazy_collect=False: return the value instead of a LazyResult.
    timeout: seconds to wait for the result; a CallTimeoutError names late ranks.

    Unknown modes raise ValueError here, at decoration time.

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


def remote_class(
    execute: str = "all",
    *,
    distributed: bool | None = None,
    max_restarts: int = 0,
    stuck_grace_s: float | None = 3.0,
) -> Callable[[type], type]:
    """Make a class constructible as a gang: ``Cls(..., remote_group='name')``.

    execute: ``'all'`` (one worker per group worker) or ``'first'`` (one
    worker on the group's first bundle, e.g. a DataLoader); ``'peer'`` is
    accepted and behaves as ``'all'`` for construction.
    distributed: initialise torch.distributed in the gang (default: when it
    has more than one worker); False opts out.
    max_restarts: rebuild the gang automatically this many times after a
    worker dies (calls in flight still raise WorkerDiedError); the state last
    saved with ``save_state()`` is restored on every rank of the new gang.
    stuck_grace_s: when a call raises on some ranks, ranks of that call still
    running this many seconds later are presumed stuck in a collective and the
    gang is torn down (``GangStuckError``) and rebuilt as after a death, so no
    later call waits on them. None: never (stuck ranks then wait for
    torch.distributed's own timeout).

    Without ``remote_group``, in local mode, or inside a worker, the class
    is built in-process exactly as written.
    """
    check_execute(execute)
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if stuck_grace_s is not None and stuck_grace_s <= 0:
        raise ValueError(f"stuck_grace_s must be positive or None, got {stuck_grace_s!r}")
    options = dict(distributed=distributed, max_restarts=max_restarts, stuck_grace_s=stuck_grace_s)

    def decorate(cls: type) -> type:
        original_init = cls.__init__
        original_new = cls.__new__

        @functools.wraps(original_init)
        def __init__(self, *args, remote_group: str | None = None, **kwargs):
            original_init(self, *args, **kwargs)

        def __new__(klass, *args, remote_group: str | None = None, **kwargs):
            if remote_group is not None:
                from .runtime import gang_for

                proxy = gang_for(klass, execute, options, remote_group, args, kwargs)
                if proxy is not None:
                    return proxy
            if original_new is object.__new__:
                return object.__new__(klass)
            return original_new(klass, *args, **kwargs)

        cls.__init__ = __init__
        cls.__new__ = staticmethod(__new__)
        return cls

    return decorate
