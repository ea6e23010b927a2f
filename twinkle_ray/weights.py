"""Weight sync trainer -> sampler: a bucketed broadcast over a cross-gang process group.

Every gang has its own default torch.distributed world, so the group that
joins the trainer's rank 0 and every receiver is a separate one, built with
torch's public API (the transport, :mod:`twinkle_ray.weight_channel`: a
``TCPStore`` hosted by the trainer's rank 0 and a ``ProcessGroupGloo`` (CPU)
or ``ProcessGroupNCCL`` (GPU) on it). It is set up once (on the first sync)
and reused. Rank 0 of that group is the source; the receivers follow, each
at the rank the driver gave it once, at set-up.

Several sources (*lanes*): a pipeline-parallel trainer makes each stage a
source of its own layers (:meth:`WeightSyncMixin.weight_sync_lane`: the first
TP rank of each stage). Each lane is a group of its own over the same store
(the lane's source at rank 0, the receivers at their ranks), the lanes send in
parallel, and no stage's layers pass through rank 0. A receiver takes one
sync from every lane at once. ``SyncStats.sent_bytes`` reports the bytes each
process of the source gang wrote during the sync.

One sync: the source broadcasts a small JSON manifest (names, dtypes, shapes,
bucket layout), then the tensors packed into flat buckets of one dtype
(``bucket_mb``, 32 MB by default; a larger tensor gets a bucket of its own).
Packing the next bucket overlaps sending the current one. Once every end is
in the sync, every wait is bounded by the sync's timeout; reaching it (the
other gang finishing its earlier calls) is not timed (see :class:`WeightSync`).

``sync_weights(..., wait=False)`` returns a :class:`SyncHandle` at once: the
sync takes its place in both gangs' call order, so a script can generate the
next batch while the trainer trains (``twinkle_ray.get(handle)`` gives the
stats). A failure ends the sync on both sides within seconds and hurts only
what failed: a broken end closes its channel (the others' waits end), a source
whose ``weight_sync_tensors()`` raises tells the receivers, a receiver that
fails to join at set-up tells the others through the set-up gate.

Receivers. A sampler worker reaches its receivers through one fan-out hook,
:meth:`WeightSyncMixin.weight_sync_fanout`: by default the worker itself is
the one receiver; a worker that owns an engine with processes of its own
(vLLM with tensor parallelism) forwards to each of them (vLLM:
``collective_rpc``), and each joins the group at its own rank. A receiver
takes a sync with ``weight_sync_receive(buckets)``: the default resolves its
targets once (:meth:`WeightSyncMixin.weight_sync_targets`: the model's own
parameters and buffers, never gathered copies; a DTensor shard takes its
slice of the full tensor) and copies each bucket in place
(``weight_sync_load``). Receivers never call the source-side
``weight_sync_tensors()``.

Only part of the model can be sent: ``names=[...]`` (a subset) or
``only_changed=True``: tensors whose content fingerprint differs from the
one last sent on this channel. The fingerprint is a 64-bit randomised sum
over the tensor's raw bits (any one changed element changes it; two
different contents collide with probability about 2**-64). It costs a pass
over the weights on the source, so it is taken only from the first
``only_changed`` sync on, and that first one sends everything.

Use it by mixing :class:`WeightSyncMixin` into both remote classes and
calling :func:`sync_weights` (or a :class:`WeightSync`) from the driver::

    @remote_class()
    class Trainer(WeightSyncMixin):
        def __init__(self, device_mesh=None):
            self.model = build_model()          # weight_sync_tensors() uses self.model

    @remote_class()
    class Sampler(WeightSyncMixin):
        def __init__(self, device_mesh=None):
            self.model = build_model()          # weight_sync_targets() uses self.model

    trainer = Trainer(device_mesh=train_mesh, remote_group="trainer")
    sampler = Sampler(device_mesh=sample_mesh, remote_group="sampler")
    stats = sync_weights(trainer, sampler)              # sets up once, then reuses
    stats = sync_weights(trainer, sampler, only_changed=True)
    print(f"{stats.bytes / 1e6:.0f} MB in {stats.seconds:.2f}s = {stats.gb_per_s:.2f} GB/s")

Backends: gloo when any end has no CUDA device, else NCCL (override with
``backend=``). NCCL needs the source and the receivers on distinct GPUs (not
colocated groups); use gloo there. The NCCL path is written to torch's
public API but has not been run on GPUs in this repository's CI. When every
receiver is a vLLM engine on CUDA (its probe says ``transfer: vllm_nccl``) the
backend is :data:`VLLM_NCCL`: each lane's source opens vLLM's own NCCL trainer
endpoint instead (:mod:`twinkle_ray.integrations.vllm_trainer`), and the
engines receive through vLLM's weight-transfer API -- not run here (no GPU).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from .core.context import get_rank
from .core.functions import remote_function
from .runtime.errors import CallTimeoutError, GangStuckError, WorkerDiedError
from .runtime.lazy import Pending
from .weight_channel import (
    DEFAULT_BUCKET_MB,
    DEFAULT_TIMEOUT_S,
    PEER_WAIT_S,
    PeerFailed,
    ReceiverEnd,
    SetupRefused,
    SourceFailed,
    SyncStats,
    TensorSource,
    WeightChannel,
    _is_dtensor,
    _node_ip,
    bytes_written,
    fingerprint,
    lane_prefix,
    load_into,
)

logger = logging.getLogger(__name__)

__all__ = ["VLLM_NCCL", "ReceiverEnd", "SyncHandle", "SyncStats", "TensorSource", "WeightChannel", "WeightSync",
           "WeightSyncMixin", "choose_backend",
           "fingerprint", "load_into", "sync_weights"]

SYNC_GRACE_S = 3.0  # after one end of a sync failed, how long the others get to finish
SETTLE_READ_S = 30.0  # reading the outcome of an end that has finished or was torn down


# ------------------------------------------------------------------------------ the backend
VLLM_NCCL = "vllm_nccl"  # every receiver a vLLM engine on CUDA: vLLM's NCCL engine, both sides (not run here)


def choose_backend(backend: str | None, source: list[dict], targets: list[list[dict]]) -> str:
    """The set-up's backend from the probes (``source``: the source gang's, ``targets``: each target
    gang's; one dict per receiver): ``backend`` if given; :data:`VLLM_NCCL` when every end has CUDA
    and every receiver is a vLLM engine (``transfer: vllm_nccl``); else ``nccl`` when every end has
    CUDA, ``gloo`` otherwise.

    >>> choose_backend(None, [{"cuda": True}], [[{"cuda": True, "transfer": "vllm_nccl"}]])
    'vllm_nccl'
    >>> choose_backend(None, [{"cuda": True}], [[{"cuda": False}]])
    'gloo'
    """
    receivers = [x for gang in targets for x in gang]
    engines = [x for x in receivers if x.get("transfer") == VLLM_NCCL]
    if engines and len(engines) != len(receivers):
        raise ValueError(f"weight sync: {len(engines)} of {len(receivers)} receivers take weights only through "
                         f"vLLM's NCCL engine, the others through twinkle_ray's channel; sync them with "
                         f"separate sync_weights calls")
    if backend is not None:
        return backend
    if all(x["cuda"] for x in [*source, *receivers]):
        return VLLM_NCCL if engines else "nccl"
    return "gloo"


# ------------------------------------------------------------------------------ the mixin
def _gather_full(tensors: dict[str, Any]) -> dict[str, Any]:
    """Full tensors from DTensor shards: every rank gathers, the gang's rank 0 keeps them.

    ``full_tensor()`` is a collective on the DTensor's own mesh (the process
    groups FSDP2 shards over), so every rank of the gang must call this, with
    the same names in the same order (a state dict's order). Each tensor is
    gathered once; rank 0 returns name -> full tensor (plain, detached),
    other ranks return ``{}`` (the source only sends from rank 0). Plain
    tensors (buffers, unsharded parameters) pass through unchanged.
    """
    import torch

    keep = get_rank() == 0
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, t in tensors.items():
            full = t.full_tensor() if _is_dtensor(t) else t
            if keep:
                out[name] = full.detach()
    return out


def _module_tensors(module: Any) -> dict[str, Any]:
    """A module's state dict by name; DTensor (FSDP2) values are gathered (see :func:`_gather_full`)."""
    if type(module).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
        module = module.module  # the wrapped model: names without the 'module.' prefix
    tensors = dict(module.state_dict(keep_vars=False))
    if any(_is_dtensor(t) for t in tensors.values()):
        return _gather_full(tensors)
    return tensors



def _module_targets(module: Any) -> dict[str, Any]:
    """A module's own parameters and buffers by state-dict name (DTensor shards stay shards: no copy)."""
    if type(module).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
        module = module.module
    return dict(module.state_dict(keep_vars=True))


def _pairs(tensors: Any) -> Any:
    """What the channel sends from a ``weight_sync_tensors()`` answer: a lazy source as it is, a dict's items."""
    return tensors if hasattr(tensors, "metadata") else tensors.items()


def _merge_lanes(mine: SyncStats | None, wrote: int) -> SyncStats:
    """One sync's figures over every lane, and the bytes each rank of the source gang wrote.

    A collective on the gang's own torch.distributed world (every rank calls
    ``weight_sync_send``); without one, this rank's figures alone.
    """
    import torch.distributed as dist

    parts = [(get_rank(), mine, wrote)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (get_rank(), mine, wrote))
    lanes = [p for _, p, _ in parts if p is not None]
    return SyncStats(
        tensors=sum(p.tensors for p in lanes), bytes=sum(p.bytes for p in lanes),
        buckets=sum(p.buckets for p in lanes), seconds=max((p.seconds for p in lanes), default=0.0),
        prepare_s=max((p.prepare_s for p in lanes), default=0.0), names=[n for p in lanes for n in p.names],
        backend=lanes[0].backend if lanes else "", receivers=lanes[0].receivers if lanes else 0,
        lanes=len(lanes), sent_bytes={f"rank {r}": w for r, _, w in parts})


class WeightSyncMixin:
    """Weight-sync endpoints for a remote class (trainer or sampler).

    Source side: ``weight_sync_tensors()`` (default: ``self.model``'s state
    dict, unwrapping DDP) runs on *every* rank of the gang before rank 0
    sends, so a sharded trainer may gather full tensors there with a
    collective (FSDP full state dict, Megatron TP/PP gather) and return them
    on rank 0 (other ranks may return ``{}``).

    Receiver side, from the outside in (override the outermost that fits):

    - ``weight_sync_fanout(op, *args)``: reaches every receiver this worker
      holds (default: the worker itself; a vLLM engine: ``collective_rpc``);
    - ``weight_sync_receive(buckets)``: takes one sync (default: resolve the
      targets once, then ``weight_sync_load`` each bucket);
    - ``weight_sync_targets()``: where the tensors land (default:
      ``self.model``'s own parameters and buffers; DTensor shards take their
      slice);
    - ``weight_sync_load(items)``: one bucket (default: copy into the targets).

    The ``weight_sync_*`` remote methods are called by :class:`WeightSync`.

    >>> class Box(WeightSyncMixin):
    ...     def __init__(self, value):
    ...         import torch
    ...         self.model = torch.nn.Linear(2, 2)
    ...         torch.nn.init.constant_(self.model.weight, value)
    >>> a, b = Box(1.0), Box(0.0)
    >>> sync_weights(a, b).tensors           # in-process objects: a plain copy
    2
    >>> bool((b.model.weight == 1.0).all())
    True
    """

    # -- source hooks ---------------------------------------------------------------------------
    def weight_sync_lane(self) -> tuple[int | None, int]:
        """(this rank's lane or None, how many lanes): which ranks of the source gang send.

        Default ``(0, 1)`` on the gang's rank 0 and ``(None, 1)`` elsewhere: one source. A
        pipeline-parallel trainer makes every stage a source of its own layers -- the first TP
        rank of each stage (data rank 0) sends on lane = its stage, all stages in parallel, each on
        a group of its own with the receivers (no copy of stage k's layers to rank 0)::

            def weight_sync_lane(self):
                first = self.tp_rank == 0 and self.dp_rank == 0
                return (self.pp_rank if first else None), self.pp

        Rank 0 must be lane 0 (it hosts the channel). Every rank answers the same lane count.
        """
        return (0 if get_rank() == 0 else None), 1

    def weight_sync_tensors(self) -> dict[str, Any] | TensorSource:
        """name -> tensor: what a source sends (called on every rank of the source gang).

        With lanes (:meth:`weight_sync_lane`), each source returns its own lane's tensors. A
        :class:`TensorSource` (metadata first, tensors materialised as they are reached) instead of
        a dict lets the channel gather bucket i+1 while bucket i is on the wire; ranks that are not
        a source iterate theirs too (the gather is a collective they take part in).

        ``self.model``'s state dict (DDP unwrapped). An FSDP2 (``fully_shard``)
        or DTensor-parallel model is gathered here: every rank calls
        ``full_tensor()`` once per tensor, rank 0 returns the full tensors and
        the other ranks ``{}``.
        """
        model = getattr(self, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            raise NotImplementedError(
                f"{type(self).__name__}: set self.model to a torch module or override "
                f"weight_sync_tensors() to return a dict name -> tensor"
            )
        return _module_tensors(model)

    # -- receiver hooks -------------------------------------------------------------------------
    def weight_sync_fanout(self, op: str, *args: Any) -> list:
        """Run receiver operation ``op`` (see :class:`ReceiverEnd`) on every receiver of this worker.

        Returns one answer per receiver. Default: this worker is the one
        receiver. A worker whose engine has processes of its own forwards
        the call to each, and each builds its own :class:`ReceiverEnd`
        (``index`` = its rank in the engine)::

            def weight_sync_fanout(self, op, *args):
                return self.llm.collective_rpc("twinkle_weight_op", args=(op, *args))
        """
        end = self.__dict__.get("_twinkle_receiver")
        if end is None:
            end = self.__dict__["_twinkle_receiver"] = ReceiverEnd(self.weight_sync_receive)
        return [end.call(op, *args)]

    def weight_sync_receive(self, buckets: Iterator[list[tuple[str, Any]]]) -> None:
        """Take one sync: resolve the targets once, then ``weight_sync_load`` every bucket.

        A bucket that fails to load does not stop the others; the first
        failure is raised at the end.
        """
        self.__dict__["_twinkle_sync_targets"] = self.weight_sync_targets()
        failure: BaseException | None = None
        try:
            for items in buckets:
                try:
                    self.weight_sync_load(items)
                except Exception as e:  # keep receiving: the source must not hang
                    failure = failure or e
        finally:
            self.__dict__.pop("_twinkle_sync_targets", None)
        if failure is not None:
            raise failure

    def weight_sync_targets(self) -> dict[str, Any]:
        """name -> tensor that received weights are copied into, resolved once per sync.

        Default: ``self.model``'s own parameters and buffers (DDP unwrapped).
        An FSDP2 / DTensor model's parameters stay shards: each takes its
        local slice of the full tensor (:func:`load_into`), so the model
        itself changes, never a gathered copy.
        """
        model = getattr(self, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            raise NotImplementedError(
                f"{type(self).__name__}: set self.model to a torch module or override "
                f"weight_sync_targets() (or weight_sync_receive) to say where received weights go"
            )
        return _module_targets(model)

    def weight_sync_load(self, items: list[tuple[str, Any]]) -> None:
        """Take one bucket of received (name, tensor); default: copy into this sync's targets."""
        targets = self.__dict__.get("_twinkle_sync_targets")
        problems = load_into(self.weight_sync_targets() if targets is None else targets, items)
        if problems:
            raise ValueError("weight sync: received tensors did not fit: " + "; ".join(problems[:5])
                             + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))

    def _weight_channels(self) -> dict[str, WeightChannel]:
        return self.__dict__.setdefault("_twinkle_weight_channels", {})

    # -- remote endpoints -----------------------------------------------------------------------
    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_probe(self, role: str = "target") -> list[dict]:
        """Facts for choosing the backend and the ranks: one dict per receiver of this worker
        (a source worker: itself), each with ``cuda``, ``ip``, ``index`` and the gang ``rank``."""
        if role == "source":
            import torch

            facts = [{"cuda": bool(torch.cuda.is_available()), "ip": _node_ip(), "index": 0}]
        else:
            facts = list(self.weight_sync_fanout("probe"))
        return [{**f, "rank": get_rank()} for f in facts]

    @remote_function(dispatch="all", execute="first", collect="first")
    def weight_sync_open(self, channel: str, timeout_s: float, backend: str | None, source: list[dict],
                         *targets: list[dict]) -> dict:
        """Source rank 0: from the probes (``source``: this gang's, ``targets``: each target gang's),
        give every receiver its channel rank and choose the backend; host the channel's TCPStore.

        Returns the set-up every end joins with: ``addr``, ``port``, ``world_size``, ``backend``,
        ``timeout_s`` and ``plan`` (per target gang: gang rank -> [[receiver index, channel rank]]).
        """
        lane, lanes = self.weight_sync_lane()
        if lane != 0:
            raise RuntimeError(f"{type(self).__name__}.weight_sync_lane() gives gang rank {get_rank()} lane "
                               f"{lane}; rank 0 hosts the weight sync channel and must send on lane 0")
        plan = WeightSync._rank_plan(list(targets))
        world_size = 1 + sum(len(pairs) for gang in plan for pairs in gang.values())
        backend = choose_backend(backend, source, list(targets))
        old = self._weight_channels().pop(channel, None)
        if old is not None:
            old.close()
        ch = WeightChannel.host(world_size, timeout_s, lanes=lanes)
        self._weight_channels()[channel] = ch
        addr, port = ch.address
        return {"addr": addr, "port": port, "world_size": world_size, "backend": backend,
                "timeout_s": timeout_s, "plan": plan}

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_join(self, channel: str, setup: dict, role: str, gang: int = 0) -> list[int]:
        """Join the channel's process group: the source's rank 0, or every receiver of this worker.

        ``setup``: what :meth:`weight_sync_open` returned; ``gang``: the index of this target gang
        in its plan. Every end waits at the set-up gate until all have arrived; one that fails
        here tells the others at once (:meth:`WeightChannel.refuse`), so none waits for its timeout.
        """
        addr, port = setup["addr"], setup["port"]
        if role == "source":  # every lane's source: lane 0 on the hosted store, the others connect to it
            lane, _ = self.weight_sync_lane()
            if lane is None:
                return []
            if lane == 0:
                ch = self._weight_channels().get(channel)
                if ch is None:
                    raise RuntimeError(f"weight sync channel {channel!r}: weight_sync_open was not called here")
            else:
                old = self._weight_channels().pop(channel, None)
                if old is not None:
                    old.close()
                ch = self._weight_channels()[channel] = WeightChannel.connect(
                    addr, port, 0, setup["world_size"], setup["timeout_s"])
            if setup["backend"] == VLLM_NCCL:  # vLLM's NCCL trainer endpoint, the receivers' engines join it
                from .integrations.vllm_trainer import VLLMNcclSource

                ch.pass_gate(lane_prefix(channel, lane))
                self._weight_channels()[channel] = VLLMNcclSource(ch, channel, lane)
                return [0] if lane == 0 else []
            ch.join(setup["backend"], prefix=lane_prefix(channel, lane))
            ch.peer_wait = timedelta(seconds=PEER_WAIT_S)  # the targets' gangs may still be busy
            return [ch.rank] if lane == 0 else []  # channel rank 0 is the source role, once
        self.__dict__.setdefault("_twinkle_channel_hosts", {})[channel] = (addr, port)  # for leave()
        try:
            mine = setup["plan"][gang].get(get_rank())
            if not mine:
                raise RuntimeError(f"weight sync channel {channel!r}: the set-up gave gang rank {get_rank()} "
                                   f"no channel rank (plan {setup['plan'][gang]})")
            return list(self.weight_sync_fanout("join", channel, addr, port, mine, setup["world_size"],
                                                setup["backend"], setup["timeout_s"]))
        except SetupRefused:
            raise  # another end failed first and said so
        except Exception as e:
            WeightChannel.refuse(addr, port, f"{type(self).__name__}.weight_sync_join on rank {get_rank()}: "
                                             f"{type(e).__name__}: {e}", channel=channel)  # every lane
            raise

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_ready(self, channel: str, role: str) -> list[bool]:
        """Whether this worker's ends hold a joined channel (source: rank 0 only answers)."""
        if role == "source":
            if self.weight_sync_lane()[0] is None:
                return []
            ch = self._weight_channels().get(channel)
            return [ch is not None and ch.pg is not None]
        return list(self.weight_sync_fanout("ready", channel))

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_send(self, channel: str, names: list[str] | None = None, only_changed: bool = False,
                         bucket_mb: float = DEFAULT_BUCKET_MB) -> list[SyncStats]:
        """Source: every rank builds its tensors (may gather); every lane's source sends its own, in
        parallel. Gang rank 0 returns the sync's figures over all lanes, with the bytes each rank
        of the gang wrote (``sent_bytes``); the other ranks return nothing.

        If ``weight_sync_tensors()`` raises, the receivers are told (they raise the same message,
        and the channel stays in step); the error is raised here.
        """
        w0 = bytes_written()
        lane, _ = self.weight_sync_lane()
        ch = self._weight_channels().get(channel) if lane is not None else None
        stats: SyncStats | None = None
        error: BaseException | None = None
        tensors: Any = None
        if lane is not None and (ch is None or ch.pg is None):
            # Raised at the end: this rank still builds its tensors (the other ranks' gathers) and
            # joins the figures' collective, so no rank of the gang is left inside one.
            error = RuntimeError(
                f"weight sync channel {channel!r} is not set up in {type(self).__name__} rank {get_rank()} "
                f"(lane {lane}; was the gang restarted?); WeightSync sets it up again on the next sync"
            )
            ch = None
        try:
            tensors = self.weight_sync_tensors()
        except Exception as e:  # nothing sent yet: the receivers raise this too, the channel stays in step
            if ch is not None:
                ch.fail(f"{type(self).__name__} rank {get_rank()}: weight_sync_tensors() raised "
                        f"{type(e).__name__}: {e}")
            error = error or e  # raised after the figures' collective, which every rank must join
        try:
            if error is None and ch is not None:
                stats = ch.send(_pairs(tensors), names=names, only_changed=only_changed, bucket_mb=bucket_mb)
            elif tensors is not None and (isinstance(tensors, TensorSource) or hasattr(tensors, "metadata")):
                for _ in tensors:  # in step with the sources' gathers
                    pass
        except Exception as e:  # reported after the figures are exchanged: the other ranks must not hang
            error = error or e
        merged = _merge_lanes(stats, bytes_written() - w0)
        if error is not None:
            raise error
        return [merged] if get_rank() == 0 else []

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_recv(self, channel: str) -> list[SyncStats]:
        """Receivers: every end of this worker takes one sync; their figures.

        A receiver that fails (before it reached the sync too) leaves the channel: the source and
        the other receivers, waiting for it to arrive, see its connections close and end their
        wait at once, so no gang is held until the driver reads the sync (set up again next time).
        """
        try:
            return [SyncStats(**got) for got in self.weight_sync_fanout("recv", channel)]
        except BaseException as e:
            where = self.__dict__.get("_twinkle_channel_hosts", {}).get(channel)
            # Only an end still joined says why: one whose transport broke has closed its channel
            # already (the peers know), and its store's host may be the end that died.
            if where is not None and not _is_echo(e) and all(self.weight_sync_fanout("ready", channel)):
                WeightChannel.leave(*where, f"{type(self).__name__}.weight_sync_recv on rank {get_rank()}: "
                                            f"{type(e).__name__}: {e}")
            try:
                self.weight_sync_fanout("close", channel)
            except Exception:  # best effort: the original error is the one to raise
                logger.debug("weight sync %s: closing a failed receiver failed", channel, exc_info=True)
            raise

    @remote_function(dispatch="all")
    def weight_sync_close(self, channel: str, role: str | None = None) -> None:
        """Leave the channel (``role`` None: whichever end this worker holds)."""
        if role in (None, "source"):
            ch = self._weight_channels().pop(channel, None)
            if ch is not None:
                ch.close()
        if role == "target" or (role is None and "_twinkle_receiver" in self.__dict__):
            self.weight_sync_fanout("close", channel)


# ------------------------------------------------------------------------------ the driver side
class WeightSync:
    """Driver-side handle of one trainer -> samplers weight channel.

    Set up on the first :meth:`sync` (or :meth:`setup`) and reused; set up
    again by itself when a gang was restarted or a sync failed.

    A sync is a few calls on each gang, made at once and in each gang's order
    (``wait=False`` returns a :class:`SyncHandle` without waiting): the source
    gang's ``weight_sync_send`` and every target gang's ``weight_sync_recv``,
    preceded, when the channel must be set up, by ``weight_sync_probe`` on
    both, ``weight_sync_open`` on the source (it reads the probes: it waits for
    the targets to reach their turn) and ``weight_sync_join`` on both.

    Timeouts: an end that reaches the sync first waits for the others (their
    gangs may still run calls made before it) without a timeout on an
    established channel (``PEER_WAIT_S``; a death ends that wait at once), and
    up to ``timeout_s`` at set-up. Once every end is in the sync, each step of
    the transfer is bounded by ``timeout_s``.

    >>> # ws = WeightSync(trainer, sampler, timeout_s=120)
    >>> # ws.sync(); h = ws.sync(only_changed=True, wait=False); ...; twinkle_ray.get(h); ws.close()
    """

    def __init__(self, source: Any, targets: Any, *, backend: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, bucket_mb: float = DEFAULT_BUCKET_MB):
        self.source = source
        self.targets = list(targets) if isinstance(targets, list | tuple) else [targets]
        self.backend = backend
        self.timeout_s = timeout_s
        self.bucket_mb = bucket_mb
        self.channel = f"ws-{uuid.uuid4().hex[:10]}"
        self.world_size = 0
        self.backend_used: str | None = None
        self._ok = False
        self._generations: tuple = ()  # each gang's generation when the channel was set up
        self._last: SyncHandle | None = None
        self._remote = _is_gang(source)
        if any(_is_gang(t) != self._remote for t in self.targets):
            raise TypeError("WeightSync: source and targets must all be gangs or all be local objects")

    def setup(self) -> None:
        """Build the process group now: host on the source's rank 0, join everyone concurrently."""
        if not self._remote:
            self._ok = True
            return
        SyncHandle(self, self._open(), None, self.timeout_s + 30).get()
        self._ok = True

    def _open(self) -> list[tuple[Any, Any]]:
        """Submit the set-up calls (nothing waits here); returns them as (gang, LazyResult) ends."""
        src = self.source.weight_sync_probe("source")
        tgt = [g.weight_sync_probe("target") for g in self.targets]
        setup = self.source.weight_sync_open(self.channel, self.timeout_s, self.backend, src, *tgt)
        joins = [(self.source, self.source.weight_sync_join(self.channel, setup, "source"))]
        joins += [(g, g.weight_sync_join(self.channel, setup, "target", i)) for i, g in enumerate(self.targets)]
        self._generations = self._gang_generations()
        return [(self.source, src), *zip(self.targets, tgt, strict=True), (self.source, setup), *joins]

    @staticmethod
    def _rank_plan(probes: list[list[dict]]) -> list[dict[int, list[list[int]]]]:
        """Channel ranks for every receiver, from the targets' probes: per target gang,
        gang rank -> [[receiver index, channel rank], ...]; ranks 1.. in gang, worker, index order.

        >>> WeightSync._rank_plan([[{"rank": 1, "index": 0}, {"rank": 0, "index": 1}, {"rank": 0, "index": 0}]])
        [{0: [[0, 1], [1, 2]], 1: [[0, 3]]}]
        """
        plan, nxt = [], 1
        for facts in probes:
            gang: dict[int, list[list[int]]] = {}
            for f in sorted(facts, key=lambda f: (f["rank"], f["index"])):
                gang.setdefault(f["rank"], []).append([f["index"], nxt])
                nxt += 1
            plan.append(gang)
        return plan

    def _ready(self) -> bool:
        from .runtime.session import get

        wait = self.timeout_s + 30
        flags = get(self.source.weight_sync_ready(self.channel, "source"), wait)
        for g in self.targets:
            flags += get(g.weight_sync_ready(self.channel, "target"), wait)
        return bool(flags) and all(flags)

    def _gang_generations(self) -> tuple:
        """Which build of each gang runs now, asked of its dispatcher (it answers at once,
        whatever the gang is running): a rebuilt gang holds no channel. A build is named by its
        dispatcher and its number there (a respawned dispatcher numbers its builds from 1 again)."""
        out = []
        for g in [self.source, *self.targets]:
            try:
                t = g.topology()
                out.append((t["dispatcher_id"], t["generation"]))
            except Exception:  # gone: the sync will say so
                out.append(None)
        return tuple(out)

    def _check(self) -> None:
        """Whether the channel must be set up again, found without waiting on any gang call:
        the last sync finished with an error, or a gang was rebuilt since the set-up."""
        last = self._last
        if last is not None and last.done():
            try:
                last.get()  # finished: reading it (and its error) never waits
            except Exception:  # kept in the handle for its owner; it marked the channel broken
                pass
        if self._ok and self._gang_generations() != self._generations:
            self._ok = False

    def sync(self, *, names: Sequence[str] | None = None, only_changed: bool = False,
             wait: bool = True) -> SyncStats | SyncHandle:
        """Send the source's tensors (all, ``names``, or the changed ones) to every receiver.

        ``wait=False``: returns a :class:`SyncHandle` at once; the sync runs in both gangs' call
        order (after their calls made so far, before later ones). ``twinkle_ray.get(handle)``
        gives the SyncStats or raises the sync's error.
        """
        if not self._remote:
            stats = _local_sync(self.source, self.targets, names)
            return stats if wait else SyncHandle.finished(stats)
        self._check()
        if wait and self._ok and not self._ready():  # a channel closed inside a worker
            self._ok = False
        ends = [] if self._ok else self._open()
        names = list(names) if names is not None else None
        ends.append((self.source, self.source.weight_sync_send(self.channel, names, only_changed,
                                                               self.bucket_mb)))
        result = len(ends) - 1
        ends += [(g, g.weight_sync_recv(self.channel)) for g in self.targets]
        self._ok = True  # later syncs reuse it; a failure seen marks it broken again
        handle = self._last = SyncHandle(self, ends, result, self.timeout_s + 30 if wait else None)
        return handle.get() if wait else handle

    def _settle(self, ends: list, wait_s: float | None, abort_late: bool = True) -> list[int]:
        """Wait for every end of a sync; return the indices of the ends that failed, first first.

        Once one end has failed (a death, an exception on any rank, a timeout),
        the others cannot complete: ranks still inside it ``SYNC_GRACE_S`` later
        are presumed stuck, and their gangs are torn down (``GangStuckError``;
        rebuilt when ``max_restarts`` allows), so no rank stays blocked in the
        sync group. The ends tell each other of a failure themselves (a failed
        end closes its channel, a refused set-up opens the gate with an error),
        so this is the last resort. Past ``wait_s`` (None: no limit), ends still
        running are torn down too (``abort_late``) or CallTimeoutError is raised.
        """
        import ray

        owner: dict = {}
        failed: list[int] = []
        asked = time.monotonic()
        for k, (_, lazy) in enumerate(ends):
            # A call waits in its dispatcher (a rebuild, a stuck check) before its plan comes back:
            # a caller's bound (abort_late False: get(timeout)) covers that wait too.
            bound = None if abort_late or wait_s is None else max(0.0, wait_s - (time.monotonic() - asked))
            try:
                owner.update({ref: k for ref in lazy.reply(bound).refs})
            except CallTimeoutError as e:
                if bound is None:
                    failed.append(k)
                    continue
                raise CallTimeoutError(f"weight sync {self.channel}: not finished within {wait_s:g}s "
                                       f"({e})", []) from None
            except Exception:  # the gang could not take the call (dead, stopped)
                failed.append(k)
        start = time.monotonic() if abort_late or wait_s is None else asked
        failed_at = start if failed else None
        pending = list(owner)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1, fetch_local=False)
            for ref in ready:
                try:
                    ray.get(ref)  # small: sync stats, or the error
                except Exception:
                    if owner[ref] not in failed:
                        failed.append(owner[ref])
                    failed_at = failed_at or time.monotonic()
            now = time.monotonic()
            if failed_at is not None and now - failed_at >= SYNC_GRACE_S:
                break
            if wait_s is not None and now - start >= wait_s:
                if not abort_late:
                    late = sorted({owner[r] for r in pending})
                    raise CallTimeoutError(f"weight sync {self.channel}: not finished within {wait_s:g}s "
                                           f"(still running on {[repr(ends[k][0]) for k in late]})",
                                           [])
                if owner[pending[0]] not in failed:
                    failed.append(owner[pending[0]])
                break
        stuck: dict[int, list[int]] = {}
        for ref in pending:
            k = owner[ref]
            stuck.setdefault(k, []).extend(
                r for r, x in zip(ends[k][1].ranks, ends[k][1].refs, strict=True) if x == ref)
        for gang in {id(ends[k][0]): ends[k][0] for k in stuck}.values():
            ranks = sorted({r for k, rs in stuck.items() if ends[k][0] is gang for r in rs})
            culprit = ends[failed[0]][0] if failed else gang
            logger.warning("weight sync %s: %r failed; tearing down %r, ranks %s still in the sync",
                           self.channel, culprit, gang, ranks)
            gang.abort(f"weight sync {self.channel} failed on {culprit!r}; ranks {ranks} were "
                        f"still inside it {SYNC_GRACE_S:g}s later", ranks)
        return failed

    def close(self) -> None:
        """Leave the channel on every worker (best effort)."""
        if not self._remote:
            return
        from .runtime.session import get

        for g, role in [(self.source, "source"), *[(t, "target") for t in self.targets]]:
            try:
                get(g.weight_sync_close(self.channel, role), 30)
            except Exception:  # a dead gang has nothing to close
                logger.debug("weight sync close failed", exc_info=True)
        self._ok = False


class SyncHandle(Pending):
    """A weight sync under way (``sync_weights(..., wait=False)``).

    ``twinkle_ray.get(handle)`` (or ``handle.get()``) waits for both sides and
    gives the source's :class:`SyncStats`, or raises the sync's error: a
    worker's death first (``WorkerDiedError``), else the error of the end that
    failed first (an end that only echoes another's failure never wins).
    ``done()`` never waits.

    >>> # h = sync_weights(trainer, sampler, wait=False)   # returns at once
    >>> # rollouts = sampler.generate(prompts)             # runs after the sync, on the new weights
    >>> # stats = twinkle_ray.get(h)
    """

    __slots__ = ("_ws", "_ends", "_result", "_bound", "_value", "_error", "_settled")

    def __init__(self, ws: WeightSync | None, ends: list, result: int | None, bound: float | None):
        self._ws, self._ends, self._result, self._bound = ws, ends, result, bound
        self._value: Any = None
        self._error: BaseException | None = None
        self._settled = False

    @classmethod
    def finished(cls, value: Any) -> SyncHandle:
        """A handle of a sync that has already run (in-process objects)."""
        h = cls(None, [], None, None)
        h._value, h._settled = value, True
        return h

    def done(self) -> bool:
        """Whether every end of the sync has finished (never waits)."""
        return self._settled or all(lazy.done() for _, lazy in self._ends)

    def get(self, timeout: float | None = None) -> SyncStats | None:
        """The source's SyncStats once both sides are done; raises the sync's error.

        ``timeout``: raise CallTimeoutError (naming the sync) if it has not finished by then; it
        bounds the whole get, the wait for a call that has not started on any rank yet included
        (the sync goes on).
        """
        if not self._settled:
            self._settle(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def _settle(self, timeout: float | None) -> None:
        from .runtime.session import get

        ws = self._ws
        bound = self._bound if timeout is None else timeout
        order = ws._settle(self._ends, bound, abort_late=timeout is None)
        errors: dict[int, BaseException] = {}
        values: dict[int, Any] = {}
        for k, (_, lazy) in enumerate(self._ends):  # every end has finished or been torn down by now
            try:
                values[k] = get(lazy, SETTLE_READ_S)
            except Exception as e:
                errors[k] = e
        self._settled = True
        if errors:
            ws._ok = False  # set up again on the next sync
            first_stage = self._result if self._result is not None else len(self._ends)
            self._error = _first_cause({k: _root_error(e, self._ends[k][1]) for k, e in errors.items()},
                                       order, first_stage)
            return
        for v in values.values():
            if isinstance(v, dict) and "world_size" in v:  # a set-up ran: the channel is new
                ws.world_size, ws.backend_used = v["world_size"], v["backend"]
                logger.info("weight sync %s: %s group of %d (source + %d receiver(s)) at %s:%d",
                            ws.channel, v["backend"], v["world_size"], v["world_size"] - 1, v["addr"], v["port"])
        self._value = None if self._result is None else values[self._result][0]
        self._ends = []  # the refs are read: let Ray free them


def _is_echo(e: BaseException) -> bool:
    """An end's error that only repeats another end's failure."""
    return isinstance(e, SourceFailed | SetupRefused | PeerFailed)


def _root_error(error: BaseException, lazy: Any) -> BaseException:
    """The error of one end (a call on every rank of a gang): ``error`` (its first rank's), or,
    when that one only echoes another end's failure, another rank's own error (noted where)."""
    import ray

    if not _is_echo(error):
        return error
    try:
        pairs = list(zip(lazy.ranks, lazy.refs, strict=True))
    except Exception:
        return error
    for rank, ref in pairs:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if cause is not None and not _is_echo(cause):
                cause.add_note(f"raised in {lazy.gang.cls_name}.{lazy.method}() on rank {rank} of group "
                               f"'{lazy.gang.group}'")
                return cause
        except Exception:  # not finished, or not an exception of the call: keep the first
            continue
    return error


def _first_cause(errors: dict[int, BaseException], order: list[int], first_stage: int) -> BaseException:
    """The error a failed sync raises: a death (it explains its peers' errors); else, from the
    set-up calls if one failed (ends before ``first_stage``: later ones failed because of it),
    the end that failed first, passing over ends that only echo another end's failure."""
    deaths = [e for e in errors.values() if isinstance(e, WorkerDiedError) and not isinstance(e, GangStuckError)]
    if deaths:
        return deaths[0]
    ranked = [k for k in order if k in errors] + [k for k in errors if k not in order]
    early = [k for k in ranked if k < first_stage]
    ranked = early or ranked
    causes = [k for k in ranked if not _is_echo(errors[k])]
    return errors[(causes or ranked)[0]]


def _is_gang(obj: Any) -> bool:
    from .runtime.proxy import GangProxy

    return isinstance(obj, GangProxy)


def _local_sync(source: Any, targets: list, names: Sequence[str] | None) -> SyncStats:
    """In-process objects (local mode): copy tensors directly."""
    import torch

    start = time.perf_counter()
    items = list(_pairs(source.weight_sync_tensors()))
    if names is not None:
        wanted = set(names)
        items = [(n, t) for n, t in items if n in wanted]
    with torch.no_grad():
        for t in targets:
            t.weight_sync_receive(iter([[(n, v.detach()) for n, v in items]]))
    nbytes = sum(v.numel() * v.element_size() for _, v in items)
    return SyncStats(tensors=len(items), bytes=nbytes, buckets=0, seconds=time.perf_counter() - start,
                     names=[n for n, _ in items], backend="local", receivers=len(targets))


_channels: dict[tuple, WeightSync] = {}


def sync_weights(
    trainer: Any,
    sampler: Any,
    *,
    names: Sequence[str] | None = None,
    only_changed: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    backend: str | None = None,
    wait: bool = True,
) -> SyncStats | SyncHandle:
    """Send the trainer's weights (its rank 0) to every sampler worker; returns the sender's stats.

    The channel for a (trainer, sampler) pair is set up on the first call and
    reused. Both gangs are called concurrently: the trainer's rank 0 sends,
    sampler workers receive, other trainer ranks do nothing.

    ``wait=False`` returns a :class:`SyncHandle` at once: the sync takes its
    place in both gangs' call order (after the calls already made on each,
    before later ones), so a script can generate the next batch with the
    current weights while the trainer trains, then sync; ``twinkle_ray.get(handle)``
    gives the stats or raises the sync's error. ``timeout_s`` bounds the
    transfer once both sides are in the sync, not the wait for the other gang
    to finish its earlier calls (see :class:`WeightSync`).

    >>> # stats = sync_weights(trainer, sampler, only_changed=True)
    >>> # handle = sync_weights(trainer, sampler, wait=False); ...; stats = twinkle_ray.get(handle)
    """
    samplers = list(sampler) if isinstance(sampler, list | tuple) else [sampler]
    for stale in [k for k, ws in _channels.items() if getattr(ws.source, "_closed", None)]:
        del _channels[stale]  # gangs closed by shutdown(): forget their channels
    key = (id(trainer), *(id(s) for s in samplers))  # the cache holds them: ids stay unique
    ws = _channels.get(key)
    if ws is None or (ws.timeout_s, ws.bucket_mb, ws.backend) != (timeout_s, bucket_mb, backend):
        ws = _channels[key] = WeightSync(trainer, sampler, timeout_s=timeout_s, bucket_mb=bucket_mb,
                                         backend=backend)
    return ws.sync(names=names, only_changed=only_changed, wait=wait)
