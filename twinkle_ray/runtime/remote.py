"""``@remote_class``: Twinkle's class decorator.

``remote_class`` is applied once, at decoration time: construction
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
from collections.abc import Callable
from typing import Any

from ..core import defaults
from ..core.dispatch import check_execute
from .session import gang_for


def remote_class(
    execute: str = "all",
    *,
    distributed: bool | None = None,
    max_restarts: int = 0,
    stuck_grace_s: float | None = defaults.STUCK_GRACE_S,
    **removed: Any,
) -> Callable[[type], type]:
    """Make a class constructible as a gang: ``Cls(..., remote_group='name')``.

    Without ``remote_group``, in local mode, or inside a worker, the class
    is built in-process exactly as written.

    Args:
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

    ``compiled=`` (any value) raises TypeError: the Compiled Graph path was
    removed (see the Concepts page); calls are actor tasks.

    Returns:
        The class decorator.

    Example::

        @remote_class(max_restarts=2)
        class Trainer: ...
    """
    _reject_removed(removed)
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


def _reject_removed(removed: dict) -> None:
    """TypeError for ``compiled=`` (the removed Compiled Graph path) or any other unknown keyword.

    >>> try:
    ...     _reject_removed({"compiled": False})
    ... except TypeError as e:
    ...     print(str(e)[:58])
    remote_class(compiled=...): the Compiled Graph call path w
    """
    if "compiled" in removed:
        raise TypeError(
            "remote_class(compiled=...): the Compiled Graph call path was removed; calls are "
            "actor tasks, one per rank. Ray put Compiled Graphs in maintenance mode, and their "
            "channel readers busy-spin, so an idle compiled gang kept a CPU core per worker "
            "busy. Drop the argument.")
    if removed:
        raise TypeError(f"remote_class() got unexpected keyword argument(s) {sorted(removed)}")
