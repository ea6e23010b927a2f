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

from dataclasses import dataclass, field
from typing import Any

from ..core.balance import ChunkTable
from .placement import BundleSlot


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
