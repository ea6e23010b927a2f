"""Weight sync trainer -> sampler: a bucketed broadcast over a cross-gang process group.

Every gang has its own default torch.distributed world, so the group that
joins the trainer's rank 0 and every receiver is a separate one, built with
torch's public API (the transport, :mod:`twinkle_ray.weight_channel`: a
``TCPStore`` hosted by the trainer's rank 0 and a ``ProcessGroupGloo`` (CPU)
or ``ProcessGroupNCCL`` (GPU) on it). It is set up once (on the first sync)
and reused. Rank 0 of that group is the source; the receivers follow, each
at the rank the driver gave it once, at set-up.

One sync: the source broadcasts a small JSON manifest (names, dtypes, shapes,
bucket layout), then the tensors packed into flat buckets of one dtype
(``bucket_mb``, 32 MB by default; a larger tensor gets a bucket of its own).
Packing the next bucket overlaps sending the current one. Every wait is
bounded by the sync's timeout.

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
public API but has not been run on GPUs in this repository's CI.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from .core.context import get_rank
from .core.functions import remote_function
from .runtime.errors import GangStuckError, WorkerDiedError
from .weight_channel import (
    DEFAULT_BUCKET_MB,
    DEFAULT_TIMEOUT_S,
    ReceiverEnd,
    SyncStats,
    WeightChannel,
    _is_dtensor,
    _node_ip,
    fingerprint,
    load_into,
)

logger = logging.getLogger(__name__)

__all__ = ["ReceiverEnd", "SyncStats", "WeightChannel", "WeightSync", "WeightSyncMixin", "fingerprint",
           "load_into", "sync_weights"]

SYNC_GRACE_S = 3.0  # after one end of a sync failed, how long the others get to finish
SETTLE_READ_S = 30.0  # reading the outcome of an end that has finished or was torn down


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

    # -- source hook ----------------------------------------------------------------------------
    def weight_sync_tensors(self) -> dict[str, Any]:
        """name -> tensor: what a source sends (called on every rank of the source gang).

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

    @remote_function(dispatch="all", execute="first")
    def weight_sync_host(self, channel: str, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Source rank 0: host the channel's TCPStore; returns its (ip, port)."""
        old = self._weight_channels().pop(channel, None)
        if old is not None:
            old.close()
        ch = WeightChannel.host(world_size, timeout_s)
        self._weight_channels()[channel] = ch
        return ch.address

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_join(self, channel: str, addr: str, port: int, role: str, world_size: int,
                         backend: str, timeout_s: float, ranks: dict | None = None) -> list[int]:
        """Join the channel's process group: the source's rank 0, or every receiver of this worker.

        ``ranks`` (receivers): gang rank -> [[receiver index, channel rank], ...], decided once by
        the driver at set-up.
        """
        if role == "source":
            if get_rank() != 0:
                return []
            ch = self._weight_channels().get(channel)
            if ch is None:
                raise RuntimeError(f"weight sync channel {channel!r}: weight_sync_host was not called here")
            ch.join(backend, prefix=f"twinkle-weights/{channel}")
            return [ch.rank]
        mine = (ranks or {}).get(get_rank())
        if not mine:
            raise RuntimeError(f"weight sync channel {channel!r}: the driver gave gang rank {get_rank()} "
                               f"no channel rank (ranks {ranks})")
        return list(self.weight_sync_fanout("join", channel, addr, port, mine, world_size, backend, timeout_s))

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_ready(self, channel: str, role: str) -> list[bool]:
        """Whether this worker's ends hold a joined channel (source: rank 0 only answers)."""
        if role == "source":
            if get_rank() != 0:
                return []
            ch = self._weight_channels().get(channel)
            return [ch is not None and ch.pg is not None]
        return list(self.weight_sync_fanout("ready", channel))

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_send(self, channel: str, names: list[str] | None = None, only_changed: bool = False,
                         bucket_mb: float = DEFAULT_BUCKET_MB) -> list[SyncStats]:
        """Source: every rank builds its tensors (may gather), rank 0 broadcasts them."""
        tensors = self.weight_sync_tensors()
        if get_rank() != 0:
            return []
        ch = self._weight_channels().get(channel)
        if ch is None or ch.pg is None:
            raise RuntimeError(
                f"weight sync channel {channel!r} is not set up in this worker (was the gang "
                f"restarted?); WeightSync sets it up again on the next sync"
            )
        return [ch.send(tensors.items(), names=names, only_changed=only_changed, bucket_mb=bucket_mb)]

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_recv(self, channel: str) -> list[SyncStats]:
        """Receivers: every end of this worker takes one sync; their figures."""
        return [SyncStats(**got) for got in self.weight_sync_fanout("recv", channel)]

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

    >>> # ws = WeightSync(trainer, sampler, timeout_s=120)
    >>> # ws.sync(); ws.sync(only_changed=True); ws.close()
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
        self._remote = _is_gang(source)
        if any(_is_gang(t) != self._remote for t in self.targets):
            raise TypeError("WeightSync: source and targets must all be gangs or all be local objects")

    def setup(self) -> None:
        """Build the process group: host on the source's rank 0, join everyone concurrently."""
        if not self._remote:
            self._ok = True
            return
        from .runtime.session import get

        wait = self.timeout_s + 30
        probes = [get(self.source.weight_sync_probe("source"), wait)]
        probes += [get(g.weight_sync_probe("target"), wait) for g in self.targets]
        plan = self._rank_plan(probes[1:])  # every receiver's channel rank, decided once here
        self.world_size = 1 + sum(len(pairs) for gang in plan for pairs in gang.values())
        backend = self.backend or ("nccl" if all(x["cuda"] for p in probes for x in p) else "gloo")
        addr, port = get(self.source.weight_sync_host(self.channel, self.world_size, self.timeout_s), wait)
        joins = [self.source.weight_sync_join(self.channel, addr, port, "source", self.world_size,
                                              backend, self.timeout_s)]
        for g, ranks in zip(self.targets, plan, strict=True):
            joins.append(g.weight_sync_join(self.channel, addr, port, "target", self.world_size,
                                            backend, self.timeout_s, ranks))
        # Receivers first: one that fails (a bad rank plan, an unreachable store) fails fast, while
        # the source waits inside the rendezvous until its timeout.
        ranks = [r for j in [*joins[1:], joins[0]] for r in get(j, wait)]
        if sorted(ranks) != list(range(self.world_size)):
            raise RuntimeError(f"weight sync: joined ranks {sorted(ranks)}, expected 0..{self.world_size - 1}")
        self.backend_used = backend
        self._ok = True
        logger.info("weight sync %s: %s group of %d (source + %d receiver(s)) at %s:%d",
                    self.channel, backend, self.world_size, self.world_size - 1, addr, port)

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

    def sync(self, *, names: Sequence[str] | None = None, only_changed: bool = False) -> SyncStats:
        """Send the source's tensors (all, ``names``, or the changed ones) to every receiver."""
        if not self._remote:
            return _local_sync(self.source, self.targets, names)
        from .runtime.session import get

        if not self._ok or not self._ready():
            self.setup()
        names = list(names) if names is not None else None
        sent = self.source.weight_sync_send(self.channel, names, only_changed, self.bucket_mb)
        got = [g.weight_sync_recv(self.channel) for g in self.targets]
        ends = list(zip([self.source, *self.targets], [sent, *got], strict=True))
        first = self._settle(ends, self.timeout_s + 30)
        errors: list[tuple[int, BaseException]] = []
        stats = None
        for k, (_, lazy) in enumerate(ends):  # every end has finished or been torn down by now
            try:
                value = get(lazy, SETTLE_READ_S)
            except Exception as e:
                errors.append((k, e))
            else:
                stats = value if k == 0 else stats
        if errors:
            self._ok = False  # set up again on the next sync
            # A death explains its peers' errors (a reset connection on the other side): it wins,
            # then the end that failed first.
            deaths = [e for _, e in errors
                      if isinstance(e, WorkerDiedError) and not isinstance(e, GangStuckError)]
            raise (deaths or [e for k, e in errors if k == first] or [errors[0][1]])[0]
        return stats[0]

    def _settle(self, ends: list, wait_s: float) -> int | None:
        """Wait for both sides of a sync; return the index of the end that failed first.

        Once one end has failed (a death, an exception on any rank, a timeout),
        the others cannot complete the broadcast: ranks still inside it
        ``SYNC_GRACE_S`` later are presumed stuck, and their gangs are torn down
        (``GangStuckError``; rebuilt when ``max_restarts`` allows), so no rank
        stays blocked in the sync group.
        """
        import ray

        owner: dict = {}
        first: int | None = None
        for k, (_, lazy) in enumerate(ends):
            try:
                owner.update({ref: k for ref in lazy.refs})
            except Exception:  # the gang could not take the call (dead, stopped)
                first = k if first is None else first
        start = time.monotonic()
        failed_at = start if first is not None else None
        pending = list(owner)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1, fetch_local=False)
            if failed_at is None:
                for ref in ready:
                    try:
                        ray.get(ref)  # small: sync stats, or the error
                    except Exception:
                        first, failed_at = owner[ref], time.monotonic()
                        break
            now = time.monotonic()
            if failed_at is not None and now - failed_at >= SYNC_GRACE_S:
                break
            if now - start >= wait_s:
                first = owner[pending[0]] if first is None else first
                break
        stuck: dict[int, list[int]] = {}
        for ref in pending:
            k = owner[ref]
            stuck.setdefault(k, []).extend(
                r for r, x in zip(ends[k][1].ranks, ends[k][1].refs, strict=True) if x == ref)
        for k, ranks in stuck.items():
            gang, _ = ends[k]
            culprit = ends[first][0] if first is not None else gang
            logger.warning("weight sync %s: %r failed; tearing down %r, ranks %s still in the sync",
                           self.channel, culprit, gang, ranks)
            gang.abort(f"weight sync {self.channel} failed on {culprit!r}; ranks {ranks} were "
                        f"still inside it {SYNC_GRACE_S:g}s later", ranks)
        return first

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


def _is_gang(obj: Any) -> bool:
    from .runtime.proxy import GangProxy

    return isinstance(obj, GangProxy)


def _local_sync(source: Any, targets: list, names: Sequence[str] | None) -> SyncStats:
    """In-process objects (local mode): copy tensors directly."""
    import torch

    start = time.perf_counter()
    items = list(source.weight_sync_tensors().items())
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
) -> SyncStats:
    """Send the trainer's weights (its rank 0) to every sampler worker; returns the sender's stats.

    The channel for a (trainer, sampler) pair is set up on the first call and
    reused. Both gangs are called concurrently: the trainer's rank 0 sends,
    sampler workers receive, other trainer ranks do nothing.

    >>> # stats = sync_weights(trainer, sampler, only_changed=True)
    """
    samplers = list(sampler) if isinstance(sampler, list | tuple) else [sampler]
    for stale in [k for k, ws in _channels.items() if getattr(ws.source, "_closed", None)]:
        del _channels[stale]  # gangs closed by shutdown(): forget their channels
    key = (id(trainer), *(id(s) for s in samplers))  # the cache holds them: ids stay unique
    ws = _channels.get(key)
    if ws is None or (ws.timeout_s, ws.bucket_mb, ws.backend) != (timeout_s, bucket_mb, backend):
        ws = _channels[key] = WeightSync(trainer, sampler, timeout_s=timeout_s, bucket_mb=bucket_mb,
                                         backend=backend)
    return ws.sync(names=names, only_changed=only_changed)
