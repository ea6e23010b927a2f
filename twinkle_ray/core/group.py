"""DeviceGroup: a named set of devices that becomes one Ray placement group.

Pure module (no Ray import).  A group says how many devices (or which ones) it uses,
of which accelerator kind, and how many devices each worker process owns; the runtime
turns it into one placement-group bundle per worker. The accelerator kinds themselves are
in :mod:`twinkle_ray.core.accelerators`.

One piece, a little over 400 lines: a group's checks read the very facts they guard (each
worker's devices, the visible ids, its node), and ``check_groups`` checks several groups by
those same facts, so splitting them would only pass the group's internals between modules.

Example::

    >>> g = DeviceGroup(name='trainer', ranks=[0, 1, 2, 3], device_type='CUDA', gpus_per_worker=2)
    >>> g.kind, g.num_workers, g.bundles()
    ('gpu', 2, [{'GPU': 2, 'CPU': 1.0}, {'GPU': 2, 'CPU': 1.0}])
    >>> g.worker_devices(1)
    [2, 3]
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .accelerators import ACCELERATORS, DEVICE_TYPE_ALIASES, Accelerator, normalize_device_type
from .mesh_checks import is_int

__all__ = [
    'ACCELERATORS',
    'DEVICE_TYPE_ALIASES',
    'PLACEMENT_STRATEGIES',
    'Accelerator',
    'DeviceGroup',
    'check_groups',
    'normalize_device_type',
]


#: Ray placement-group strategies.
PLACEMENT_STRATEGIES = ('PACK', 'SPREAD', 'STRICT_PACK', 'STRICT_SPREAD')


@dataclass
class DeviceGroup:
    """A named group of devices; one Ray placement group with one bundle per worker.

    Args:
        name: unique group name (``remote_group=`` refers to it).
        ranks: an ``int`` (that many devices, placed by Ray) or a list of explicit device
            indices (rank ``r`` is device ``r % gpus_per_node`` on node ``r // gpus_per_node``).
            CPU groups take an ``int`` only: the number of worker processes.
        device_type: ``'cuda'`` / ``'gpu'``, ``'npu'`` or ``'cpu'``, any case.
        visible_devices: optional comma-separated device ids the group may use (e.g. ``"8,9"``),
            numbered like a ``ranks`` list; with an int ``ranks`` the group takes the first
            ``ranks`` of them, with a list every rank must be one of them.
        gpus_per_worker: devices per worker process (a vLLM TP=2 engine is one worker with 2).
        cpus_per_worker: CPUs in each worker's bundle.
        strategy: Ray placement strategy: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
        gpus_per_node: devices per node, for explicit rank lists that span nodes.
        colocate_with: name of another group whose devices this group may share.
        env: extra environment variables for the group's workers.

    Both Twinkle spellings work::

        >>> DeviceGroup(name='default', ranks=4, device_type='cuda').num_workers
        4
        >>> DeviceGroup('default', [0, 1, 2, 3], 'CUDA').device_ids
        [0, 1, 2, 3]
    """

    name: str
    ranks: int | list[int]
    device_type: str = 'cuda'
    visible_devices: str | None = None
    gpus_per_worker: int = 1
    cpus_per_worker: float = 1.0
    strategy: str = 'PACK'
    gpus_per_node: int | None = None
    colocate_with: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f'DeviceGroup name must be a non-empty string, got {self.name!r}')
        where = f"DeviceGroup '{self.name}'"
        try:
            kind = normalize_device_type(self.device_type)
        except ValueError as exc:
            raise ValueError(f'{where}: {exc}') from None

        if not is_int(self.gpus_per_worker) or self.gpus_per_worker < 1:
            raise ValueError(f'{where}: gpus_per_worker must be an integer >= 1, got {self.gpus_per_worker!r}')
        if (
            not isinstance(self.cpus_per_worker, numbers.Real)
            or isinstance(self.cpus_per_worker, bool)
            or self.cpus_per_worker < 0
        ):
            raise ValueError(f'{where}: cpus_per_worker must be a number >= 0, got {self.cpus_per_worker!r}')
        if kind == 'cpu' and self.cpus_per_worker == 0:
            raise ValueError(f'{where}: a CPU group needs cpus_per_worker > 0 (its bundles would be empty)')

        if not isinstance(self.strategy, str) or self.strategy.upper() not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f'{where}: unknown placement strategy {self.strategy!r}; '
                f'expected one of {", ".join(PLACEMENT_STRATEGIES)}'
            )
        self.strategy = self.strategy.upper()

        if self.gpus_per_node is not None and (not is_int(self.gpus_per_node) or self.gpus_per_node < 1):
            raise ValueError(f'{where}: gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}')
        if self.colocate_with is not None and (not isinstance(self.colocate_with, str) or not self.colocate_with):
            raise ValueError(f'{where}: colocate_with must be a group name, got {self.colocate_with!r}')
        if self.colocate_with == self.name:
            raise ValueError(f'{where}: colocate_with names the group itself')
        if self.env is None:
            self.env = {}
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise ValueError(f'{where}: env must be a dict of str to str, got {self.env!r}')
        self.env = dict(self.env)

        self._check_ranks(where, kind)
        self._check_visible_devices(where)
        self._check_worker_nodes(where)

    # ----------------------------------------------------------------- validation

    def _check_ranks(self, where: str, kind: str) -> None:
        ranks = self.ranks
        if is_int(ranks):
            if ranks <= 0:
                raise ValueError(f'{where}: ranks must be a positive number of devices, got {ranks}')
            self.ranks = int(ranks)
            count = self.ranks
        elif isinstance(ranks, Iterable) and not isinstance(ranks, (str, bytes, Mapping)):
            ranks = list(ranks)
            if kind == 'cpu':
                raise ValueError(
                    f'{where}: a CPU group takes an int (the number of worker processes), '
                    f'not a list of ranks {ranks}'
                )
            if not ranks:
                raise ValueError(f'{where}: ranks is an empty list')
            bad = [r for r in ranks if not is_int(r)]
            if bad:
                raise ValueError(f'{where}: ranks must be integers, got {bad}')
            ranks = [int(r) for r in ranks]
            negative = [r for r in ranks if r < 0]
            if negative:
                raise ValueError(f'{where}: ranks must be >= 0, got negative ranks {negative}')
            seen: set[int] = set()
            duplicates = sorted({r for r in ranks if r in seen or seen.add(r)})
            if duplicates:
                raise ValueError(f'{where}: duplicate ranks {duplicates} in {ranks}')
            self.ranks = ranks
            count = len(ranks)
        else:
            raise ValueError(f'{where}: ranks must be an int or a list of ints, got {ranks!r}')

        if kind == 'cpu':
            if self.gpus_per_worker != 1:
                raise ValueError(
                    f'{where}: a CPU group has no devices to share out; gpus_per_worker must be 1, '
                    f'got {self.gpus_per_worker} (use cpus_per_worker for bigger workers)'
                )
        elif count % self.gpus_per_worker:
            raise ValueError(
                f'{where}: {count} devices cannot be divided into workers of '
                f'gpus_per_worker={self.gpus_per_worker}'
            )

    def _check_visible_devices(self, where: str) -> None:
        if self.visible_devices is None:
            return
        ids = self.visible_device_ids
        if self.kind == 'cpu':
            raise ValueError(f'{where}: a CPU group has no devices; visible_devices={self.visible_devices!r}')
        if isinstance(self.ranks, int) and self.ranks > len(ids):
            raise ValueError(
                f'{where}: asks for {self.ranks} devices but visible_devices={self.visible_devices!r} '
                f'lists only {len(ids)}'
            )
        if isinstance(self.ranks, list):
            outside = [r for r in self.ranks if r not in ids]
            if outside:
                raise ValueError(
                    f'{where}: ranks {outside} are not among visible_devices={self.visible_devices!r}'
                )

    def _check_worker_nodes(self, where: str) -> None:
        if self.gpus_per_node is None or not self.pins_devices:
            return
        for i in range(self.num_workers):
            devices = self.worker_devices(i)
            nodes = sorted({r // self.gpus_per_node for r in devices})
            if len(nodes) > 1:
                raise ValueError(
                    f'{where}: worker {i} would own devices {devices} on nodes {nodes} '
                    f'(gpus_per_node={self.gpus_per_node}); a worker\'s devices must be on one node'
                )

    # ----------------------------------------------------------------- derived

    @property
    def kind(self) -> str:
        """``'gpu'``, ``'npu'`` or ``'cpu'``."""
        return normalize_device_type(self.device_type)

    @property
    def accelerator(self) -> Accelerator:
        """The :data:`ACCELERATORS` entry of this group's kind."""
        return ACCELERATORS[self.kind]

    @property
    def resource_name(self) -> str | None:
        """Ray resource name of the devices (``'GPU'``, ``'NPU'``), ``None`` for CPU groups."""
        return self.accelerator.resource_name

    @property
    def visible_devices_env(self) -> str | None:
        """Env variable that pins a worker to its devices, ``None`` for CPU groups."""
        return self.accelerator.visible_devices_env

    @property
    def backend(self) -> str:
        """Default torch.distributed backend: nccl (gpu), hccl (npu), gloo (cpu)."""
        return self.accelerator.backend

    @property
    def is_cpu(self) -> bool:
        return self.kind == 'cpu'

    @property
    def explicit_ranks(self) -> bool:
        """True when ``ranks`` lists device indices (placement pinned by the user)."""
        return isinstance(self.ranks, list)

    @property
    def pins_devices(self) -> bool:
        """True when the group names its device ids (a ``ranks`` list or ``visible_devices``):
        the runtime then reserves and assigns exactly those devices, instead of letting Ray pick.

        Example::

            >>> DeviceGroup('t', [2, 3]).pins_devices, DeviceGroup('v', 1, visible_devices='5').pins_devices
            (True, True)
            >>> DeviceGroup('c', 2).pins_devices
            False
        """
        return not self.is_cpu and (self.explicit_ranks or self.visible_devices is not None)

    @property
    def num_devices(self) -> int:
        """Number of accelerator devices (0 for CPU groups)."""
        if self.is_cpu:
            return 0
        return self.ranks if isinstance(self.ranks, int) else len(self.ranks)

    @property
    def num_workers(self) -> int:
        """Worker processes: devices / gpus_per_worker; for CPU groups ``ranks``."""
        if self.is_cpu:
            return self.ranks
        return self.num_devices // self.gpus_per_worker

    @property
    def device_ids(self) -> list[int]:
        """``ranks`` as a list; for an int, the first ``ranks`` of ``visible_devices`` or else
        ``range(ranks)`` (logical ids: Ray picks the devices); empty for CPU groups."""
        if self.is_cpu:
            return []
        if isinstance(self.ranks, list):
            return list(self.ranks)
        visible = self.visible_device_ids
        return visible[:self.ranks] if visible is not None else list(range(self.ranks))

    @property
    def visible_device_ids(self) -> list[int] | None:
        """``visible_devices`` parsed into ints, or ``None``."""
        if self.visible_devices is None:
            return None
        where = f"DeviceGroup '{self.name}'"
        text = str(self.visible_devices)
        parts = [p.strip() for p in text.split(',')]
        if not text.strip() or not all(p.isdigit() for p in parts):
            raise ValueError(
                f'{where}: visible_devices must be comma-separated device ids like "8,9", '
                f'got {self.visible_devices!r}'
            )
        ids = [int(p) for p in parts]
        if len(set(ids)) != len(ids):
            raise ValueError(f'{where}: visible_devices {self.visible_devices!r} repeats a device')
        return ids

    def _check_worker(self, i: int) -> None:
        if not is_int(i) or not 0 <= i < self.num_workers:
            raise IndexError(
                f"DeviceGroup '{self.name}' has {self.num_workers} workers; no worker {i!r}"
            )

    def bundles(self) -> list[dict[str, float]]:
        """One Ray placement-group bundle per worker, whole devices only.

        Example::

            >>> DeviceGroup('r', 2, 'cpu', cpus_per_worker=2).bundles()
            [{'CPU': 2}, {'CPU': 2}]
        """
        bundle: dict[str, float] = {}
        if not self.is_cpu:
            bundle[self.resource_name] = self.gpus_per_worker
        if self.cpus_per_worker:
            bundle['CPU'] = self.cpus_per_worker
        return [dict(bundle) for _ in range(self.num_workers)]

    def worker_devices(self, i: int) -> list[int]:
        """Device ids owned by worker ``i`` (``device_ids[i*g:(i+1)*g]``; logical ids for an int
        ``ranks``, the user's ids for a list; ``[]`` for CPU groups).

        Example::

            >>> DeviceGroup('s', [4, 5, 6, 7], gpus_per_worker=2).worker_devices(1)
            [6, 7]
        """
        self._check_worker(i)
        g = self.gpus_per_worker
        return self.device_ids[i * g:(i + 1) * g]

    def worker_local_devices(self, i: int) -> list[int]:
        """Worker ``i``'s devices as indices on its node (``r % gpus_per_node``)."""
        devices = self.worker_devices(i)
        if self.gpus_per_node is None:
            return devices
        return [r % self.gpus_per_node for r in devices]

    def node_of_worker(self, i: int) -> int | None:
        """Node index of worker ``i`` for named devices with ``gpus_per_node``; else ``None``.

        Example::

            >>> DeviceGroup('t', [8, 9], gpus_per_node=8).node_of_worker(1)
            1
        """
        self._check_worker(i)
        if self.gpus_per_node is None or not self.pins_devices:
            return None
        return self.worker_devices(i)[0] // self.gpus_per_node

    def worker_placement(self, i: int, gpus_per_node: int) -> tuple[int, list[int]]:
        """(node index, device ids on that node) of worker ``i`` of a group that names its
        devices, with ``gpus_per_node`` devices per node (the group's own when it sets one):
        device ``r`` is device ``r % gpus_per_node`` on node ``r // gpus_per_node``.

        Example::

            >>> DeviceGroup('t', [6, 7, 8, 9], gpus_per_worker=2).worker_placement(1, 8)
            (1, [0, 1])
        """
        devices = self.worker_devices(i)
        per_node = self.gpus_per_node or gpus_per_node
        nodes = sorted({r // per_node for r in devices})
        if len(nodes) > 1:
            raise ValueError(
                f"DeviceGroup '{self.name}': worker {i} would own devices {devices} on nodes {nodes} "
                f'(gpus_per_node={per_node}); a worker\'s devices must be on one node'
            )
        return nodes[0], [r % per_node for r in devices]


def check_groups(groups: Iterable[DeviceGroup]) -> dict[str, DeviceGroup]:
    """Validate a set of groups together and index them by name.

    Raises ``ValueError`` for duplicate names, a ``colocate_with`` naming an unknown group,
    explicit rank lists of one accelerator kind that disagree on ``gpus_per_node``, and two
    groups whose explicit ranks share devices unless one names the other in ``colocate_with``.

    Example::

        >>> sorted(check_groups([DeviceGroup('a', [0, 1]), DeviceGroup('b', [2, 3])]))
        ['a', 'b']
    """
    by_name: dict[str, DeviceGroup] = {}
    for group in groups:
        if not isinstance(group, DeviceGroup):
            raise TypeError(f'expected DeviceGroup, got {type(group).__name__}: {group!r}')
        if group.name in by_name:
            raise ValueError(f"two device groups are named '{group.name}'")
        by_name[group.name] = group

    for group in by_name.values():
        if group.colocate_with is not None and group.colocate_with not in by_name:
            raise ValueError(
                f"DeviceGroup '{group.name}': colocate_with='{group.colocate_with}' names no group "
                f'(groups: {", ".join(repr(n) for n in by_name)})'
            )

    explicit = [g for g in by_name.values() if g.pins_devices]
    for i, a in enumerate(explicit):
        for b in explicit[i + 1:]:
            if a.kind != b.kind:
                continue
            if a.gpus_per_node is not None and b.gpus_per_node is not None and a.gpus_per_node != b.gpus_per_node:
                raise ValueError(
                    f"DeviceGroups '{a.name}' and '{b.name}' disagree on gpus_per_node "
                    f'({a.gpus_per_node} vs {b.gpus_per_node})'
                )
            shared = sorted(set(a.device_ids) & set(b.device_ids))
            if not shared or a.colocate_with == b.name or b.colocate_with == a.name:
                continue
            raise ValueError(
                f"DeviceGroups '{a.name}' and '{b.name}' both claim devices {shared}; "
                f"give them disjoint ranks or set colocate_with='{a.name}' on '{b.name}'"
            )
    return by_name
