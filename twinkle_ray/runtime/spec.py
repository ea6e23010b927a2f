"""GangSpec: what a dispatcher needs to build (and rebuild) its gang, and its handles.

The one place where a gang's :class:`~twinkle_ray.runtime.diagnose.GangRef` and
its :class:`~twinkle_ray.runtime.proxy.GangProxy` are built: by
``create_gang`` for the caller that made the gang, and by the dispatcher for
callers that find it by name (``GangProxy.lookup``), so both behave the same
(``execute`` and ``lazy_collect`` travel in the spec).

The user's class and its constructor arguments travel to the workers as two
object-store refs (``payload``: the class's, the arguments', put where the spec
is made) that only the workers resolve: a pickled spec carries the refs, so the
dispatcher never unpickles the arguments (nor imports what they import: torch,
the user's module), and the class only for a caller that looks the gang up.

Example::

    spec = GangSpec(group=g, cls=Model, label="trainer/Model", args=(), kwargs={},
                    slots=slots, owns=owns, pg=pg, execute="all", lazy_collect=True)
    proxy = spec.proxy(dispatcher_handle, desc)
    worker.start.remote(port, True, timeout_s, seed, spec.payload)  # fetched there
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from ..core import defaults
from ..core.group import DeviceGroup
from .diagnose import GangRef
from .metrics import metrics_enabled
from .placement import BundleSlot
from .proxy import GangProxy


@dataclass
class GangSpec:
    """What a dispatcher needs to build (and rebuild) its gang."""

    group: DeviceGroup
    cls: type
    label: str  # 'group/Class' (or 'group/Class-2'): prefix of every actor name
    args: tuple
    kwargs: dict
    slots: list[BundleSlot]  # one per worker, in rank order
    owns: list[bool]  # per worker: takes the bundle's devices (first gang on them)
    pg: Any
    mesh: Any = None
    distributed: bool | None = None
    dist_timeout_s: float = defaults.DIST_TIMEOUT_S
    seed: int | None = defaults.SEED
    namespace: str | None = None
    max_restarts: int = 0
    restart_window_s: float | None = None  # max_restarts within this many seconds (None: ever)
    # the budget's history when a dispatcher is respawned (RebuildLedger): the times of the
    # rebuilds it still counts, and how many rebuilds the gang had before (respawns included)
    restart_times: tuple[float, ...] = ()
    restarts: int = 0
    placement_timeout_s: float = defaults.PLACEMENT_TIMEOUT_S  # a rebuild waits this long for its bundles to be placed
    # a rebuild's start (workers up, torch.distributed, constructors, saved state) ends within
    # this many seconds, or what it built is killed and the gang is down (None: no bound)
    start_timeout_s: float | None = defaults.START_TIMEOUT_S
    # the group's placement group is this gang's group's alone (not an adopted one, nor the pool
    # of named devices or a colocation host shared with other groups): a rebuild that finds no
    # capacity may remove it, so nothing stays reserved
    owns_pg: bool = False
    stuck_grace_s: float | None = defaults.STUCK_GRACE_S  # None: never presume ranks stuck after a failure
    env: dict[str, str] = field(default_factory=dict)
    # the gang's metrics; TWINKLE_METRICS=0 where the gang is created: off
    metrics: bool = field(default_factory=metrics_enabled)
    execute: str = "all"  # the remote_class's execute ('first': a one-worker gang)
    lazy_collect: bool = True  # the session's default: calls return LazyResults
    cls_name: str = ""  # the class's __name__ (set from ``cls``)
    # (ObjectRef of cls, ObjectRef of (args, kwargs)), put when the spec is made: what the workers
    # build from
    payload: tuple | None = None

    def __post_init__(self) -> None:
        if self.cls is not None:
            self.cls_name = self.cls_name or self.cls.__name__
            if self.payload is None:
                self.payload = (ray.put(self.cls), ray.put((self.args, self.kwargs)))

    def __getstate__(self) -> dict:
        """A pickled spec (the dispatcher's) has the payload refs, not the class and arguments."""
        return {**self.__dict__, "cls": None, "args": (), "kwargs": {}}

    def gang_ref(self, dispatcher: Any, dispatcher_node: tuple[str, str] | None = None) -> GangRef:
        """This gang's GangRef, with its dispatcher's handle (and node, to name it if it dies)."""
        return GangRef(self.group.name, self.cls_name, dispatcher, self.mesh,
                       self.group.gpus_per_worker, len(self.slots), dispatcher_node,
                       label=self.label, namespace=self.namespace)

    def proxy(self, dispatcher: Any, desc: dict, gang: GangRef | None = None,
              cls: type | None = None, starting: Any = None) -> GangProxy:
        """A GangProxy for this gang (``gang``: an already built GangRef of it; ``cls``: the
        class, where this spec was unpickled without it; ``starting``: its start-up under way,
        a :class:`~twinkle_ray.runtime.together.Start`)."""
        gang = gang or self.gang_ref(dispatcher, desc.get("dispatcher_node"))
        return GangProxy(cls or self.cls, gang, self.execute, self.lazy_collect, desc, starting)
