"""What every room of a dispatcher reads: the gang's ranks now, and every worker it had.

One :class:`RankState` per rank of the current generation holds what is known of
that rank (its actor, name, bundle slot, pid, actor id and node); the
:class:`GangState` holds them with the generation counter, the stopped flag and
the all-generations actor table that deaths are classified by
(:func:`~twinkle_ray.runtime.errors.classify_death`). ``slots`` is where the
bundles are now (re-read at every build); the spec keeps what its creator gave.

Example::

    state = GangState(spec)
    state.ranks[0].node_ip, state.workers[0]     # after a build
    state.current(gen)                           # that generation is still the live one
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..core.balance import ChunkTable
from .placement import BundleSlot

# How many named tasks (sent without a head) the dispatcher keeps the call number of, the
# oldest calls dropped first, whole: a call is still known to the stuck check if fewer tasks
# than this were sent after it (8,192 calls on a 4-worker gang, 1,024 on 32). About 7 MB when
# full.
TASKS_KEPT = 32_768


class TaskNumbers:
    """The call number of each task sent without a head (a named task, see
    :mod:`~twinkle_ray.runtime.message`), by the task's id: what a worker reports in place of
    the number. Bounded: the oldest calls go first, each with all of its tasks (a peer's task
    is never forgotten while the failed rank's task of the same call is known).

    >>> t = TaskNumbers(limit=3)
    >>> t.add(1, ["a1", "b1"]); t.add(2, ["a2", "b2"])
    >>> t.number("a1"), t.number("b1"), t.number("b2"), t.number(7), t.number(None), len(t)
    (None, None, 2, 7, None, 2)
    """

    def __init__(self, limit: int = TASKS_KEPT):
        self.limit = limit
        self._numbers: dict[str, int] = {}
        self._calls: deque[list[str]] = deque()  # each call's task ids, oldest first

    def add(self, seq: int, task_ids: list[str]) -> None:
        """Call ``seq`` went as the named tasks ``task_ids`` (one per rank that runs it)."""
        self._calls.append(task_ids)
        for t in task_ids:
            self._numbers[t] = seq
        while len(self._numbers) > self.limit and len(self._calls) > 1:
            for t in self._calls.popleft():
                del self._numbers[t]

    def number(self, call: int | str | None) -> int | None:
        """The call number for what a worker reported: a number as it is, a task id looked up
        (None: not a task of this gang, or sent too long ago), None for none."""
        if call is None or isinstance(call, int):
            return call
        return self._numbers.get(call)

    def __len__(self) -> int:
        return len(self._numbers)


@dataclass
class RankState:
    """One rank of the current generation."""

    rank: int
    name: str  # its actor name: 'group/Class/rank' (plus '#generation' after a rebuild)
    slot: BundleSlot  # its bundle, and where Ray placed that bundle at the build
    worker: Any = field(default=None, repr=False)  # its actor handle
    pid: int | None = None  # once started
    actor_id: str | None = None  # once it answered: where Ray says the actor runs
    node_id: str | None = None
    node_ip: str | None = None

    @property
    def row(self) -> tuple[int, str | None, str | None]:
        """(rank, node id, node ip): its row in the actor table."""
        return self.rank, self.node_id, self.node_ip


@dataclass
class GangState:
    """The facts one dispatcher's rooms share (plain Python, owned by the dispatcher)."""

    spec: Any  # GangSpec: what builds the gang (never changed after creation)
    slots: list[BundleSlot] = field(default_factory=list)  # where the bundles are now
    generation: int = 0  # bumped by every build and every teardown: old watchers stand down
    stopped: bool = False
    ranks: list[RankState] = field(default_factory=list)  # the last build's ranks
    # live handles of the current generation ([] once torn down); one list per build (the
    # dispatcher's bound task methods are cached per list)
    workers: list = field(default_factory=list)
    # actor id (hex) -> (rank, node id, node ip) of this gang's workers, all generations
    table: dict[str, tuple[int, str | None, str | None]] = field(default_factory=dict)
    distributed: bool = False  # the workers joined torch.distributed (a collective can block)
    backend: str | None = None
    master_addr: str | None = None  # the rendezvous host of the current build
    # dispatch='balance': the chunks handed out per call in flight (Dispatcher.next_chunk);
    # cleared when a generation's workers are killed, a call dropped when it reports a failure
    chunks: ChunkTable = field(default_factory=ChunkTable)
    # the call numbers of the named tasks sent (task id -> number), for the stuck check
    tasks: TaskNumbers = field(default_factory=TaskNumbers)

    def __post_init__(self):
        if not self.slots:
            self.slots = list(self.spec.slots)

    @property
    def label(self) -> str:
        return self.spec.label

    def current(self, gen: int) -> bool:
        """Generation ``gen`` is still the live one (not torn down, not stopped)."""
        return gen == self.generation and not self.stopped

    def actor_ids(self) -> list[str]:
        """The actor ids of the current ranks (those that answered)."""
        return [r.actor_id for r in self.ranks if r.actor_id is not None]

    def node_of(self, rank: int) -> str | None:
        return self.ranks[rank].node_id if rank < len(self.ranks) else None

    def ranks_on(self, node_id: str) -> list[int]:
        return sorted(r.rank for r in self.ranks if r.node_id == node_id)
