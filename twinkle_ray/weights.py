"""Weight sync trainer -> sampler: a bucketed broadcast over a cross-gang process group.

Every gang has its own default torch.distributed world, so the group that
joins the trainer's rank 0 and every sampler worker is a separate one, built
with torch's public API: a ``TCPStore`` hosted by the trainer's rank 0 and a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) on it. It is set up
once (on the first sync) and reused. Rank 0 of that group is the source;
sampler worker ``i`` is rank ``1 + i``.

One sync: the source broadcasts a small JSON manifest (names, dtypes, shapes,
bucket layout), then the tensors packed into flat buckets of one dtype
(``bucket_mb``, 32 MB by default; a larger tensor gets a bucket of its own).
Packing the next bucket overlaps sending the current one. Receivers unpack
into their own tensors (``copy_``: bit-identical for the same dtype) or hand
the tensors to a hook (vLLM's ``load_weights``). Every wait is bounded by the
sync's timeout.

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
            self.model = build_model()

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

import json
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .core.context import get_rank
from .core.functions import remote_function
from .runtime.errors import GangStuckError, WorkerDiedError

logger = logging.getLogger(__name__)

__all__ = ["SyncStats", "WeightChannel", "WeightSync", "WeightSyncMixin", "fingerprint", "sync_weights"]

DEFAULT_BUCKET_MB = 32
DEFAULT_TIMEOUT_S = 300.0
SYNC_GRACE_S = 3.0  # after one end of a sync failed, how long the others get to finish
SETTLE_READ_S = 30.0  # reading the outcome of an end that has finished or was torn down
_FP_CHUNK = 1 << 20
_INT_VIEW = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


@dataclass
class SyncStats:
    """What one sync moved (as seen by the process that reports it)."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0  # the transfer: manifest + buckets
    prepare_s: float = 0.0  # choosing tensors (fingerprints) before the transfer
    names: list[str] = field(default_factory=list)
    backend: str = ""
    receivers: int = 0

    @property
    def gb_per_s(self) -> float:
        """Payload rate (GB/s, 1e9 bytes) of one copy of the weights."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"{self.tensors} tensor(s), {self.bytes / 1e6:.1f} MB in {self.buckets} bucket(s), "
                f"{self.seconds:.3f}s ({self.gb_per_s:.2f} GB/s to each of {self.receivers} receiver(s), "
                f"{self.backend})")


# ------------------------------------------------------------------------------ fingerprints
_weights_cache: dict[str, Any] = {}


def fingerprint(tensor: Any) -> tuple[int, int]:
    """A content fingerprint of ``tensor``'s raw bits: (numel, randomised sum mod 2**64).

    Computed on the tensor's device, in chunks (bounded extra memory). Equal
    contents give equal fingerprints; different contents collide with
    probability about 2**-64.

    >>> import torch
    >>> a = torch.ones(5)
    >>> fingerprint(a) == fingerprint(a.clone()), fingerprint(a) == fingerprint(a + 1e-7)
    (True, False)
    """
    import torch

    x = tensor.detach().reshape(-1)
    if x.numel() == 0:
        return (0, 0)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    bits = x.contiguous().view(getattr(torch, _INT_VIEW[x.element_size()]))
    key = str(bits.device)
    w = _weights_cache.get(key)
    if w is None:
        gen = torch.Generator().manual_seed(0x7A1E)
        w = torch.randint(-(2**62), 2**62, (_FP_CHUNK,), generator=gen, dtype=torch.int64) | 1
        w = _weights_cache[key] = w.to(bits.device)
    # Odd random weights: any single changed element changes the sum; int64 wraps mod 2**64.
    mixed = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), _FP_CHUNK):
        chunk = bits[start:start + _FP_CHUNK].to(torch.int64)
        mixed += (chunk * w[: chunk.numel()]).sum()
    return (int(bits.numel()), int(mixed))


# ------------------------------------------------------------------------------ the channel
def _dtype(name: str):
    import torch

    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in the manifest")
    return dt


def _buckets(items: list[tuple[str, Any]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``items`` grouped into same-dtype buckets of at most ``bucket_bytes``."""
    by_dtype: dict[str, list[int]] = {}
    for i, (_, t) in enumerate(items):
        by_dtype.setdefault(str(t.dtype), []).append(i)
    buckets: list[list[int]] = []
    for idx in by_dtype.values():
        current: list[int] = []
        size = 0
        for i in idx:
            nbytes = items[i][1].numel() * items[i][1].element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


class WeightChannel:
    """One process's end of a weight-sync process group (rank 0 sends, the rest receive).

    Built by :class:`WeightSyncMixin`; usable directly in any process::

        host = WeightChannel.host(world_size=3)                   # on the source
        addr, port = host.address
        src = host.join(backend="gloo")                          # concurrently with:
        dst = WeightChannel.connect(addr, port, rank=1, world_size=3)  # on each receiver
        src.send(model.state_dict().items()); dst.recv(target_dict)
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, address: tuple[str, int]):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.address = address
        self.pg: Any = None
        self.backend: str | None = None
        self.device: Any = None
        self.sent: dict[str, tuple[int, int]] = {}
        self.tracking = False  # record fingerprints (from the first only_changed sync on)
        self.syncs = 0

    @classmethod
    def host(cls, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, host_ip: str | None = None) -> WeightChannel:
        """Rank 0's end: start the TCPStore on a free port of this node."""
        import torch.distributed as dist

        ip = host_ip or _node_ip()
        store = dist.TCPStore(ip, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return cls(store, 0, world_size, timeout_s, (ip, int(store.port)))

    @classmethod
    def connect(cls, addr: str, port: int, rank: int, world_size: int,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> WeightChannel:
        """A receiver's end: connect to rank 0's TCPStore."""
        import torch.distributed as dist

        if not 0 < rank < world_size:
            raise ValueError(f"weight sync: receiver rank {rank} is outside 1..{world_size - 1}")
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, rank, world_size, timeout_s, (addr, port))

    def join(self, backend: str = "gloo", prefix: str = "twinkle-weights") -> WeightChannel:
        """Create the process group (a rendezvous: every rank calls it concurrently)."""
        import torch
        import torch.distributed as dist

        store = dist.PrefixStore(prefix, self.store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"weight sync: backend must be 'gloo' or 'nccl', got {backend!r}")
        self.backend = backend
        # A first collective: NCCL connects lazily, and every rank learns the others are up.
        self._bcast(torch.zeros(1, dtype=torch.int64, device=self.device)).wait(self.timeout)
        return self

    def _bcast(self, tensor: Any) -> Any:
        return self.pg.broadcast(tensor, 0, self.timeout)

    # -- source ---------------------------------------------------------------------------------
    def send(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        names: Sequence[str] | None = None,
        only_changed: bool = False,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> SyncStats:
        """Broadcast tensors (rank 0). ``names``: only these; ``only_changed``: only the changed ones."""
        import torch

        t0 = time.perf_counter()
        try:
            items, prints = self._select(list(named_tensors), names, only_changed)
        except Exception as e:
            self._send_manifest({"error": f"{type(e).__name__}: {e}"})
            raise
        start = time.perf_counter()
        buckets = _buckets(items, int(bucket_mb * 2**20))
        manifest = {
            "seq": self.syncs,
            "tensors": [[n, str(t.dtype), list(t.shape)] for n, t in items],
            "buckets": buckets,
        }
        self._send_manifest(manifest)
        pending: list = []
        total = 0
        with torch.no_grad():
            for bucket in buckets:
                parts = [items[i][1].detach().reshape(-1) for i in bucket]
                if len(parts) == 1 and parts[0].is_contiguous():
                    flat = parts[0]
                else:
                    flat = torch.cat(parts)
                if flat.device != self.device:
                    flat = flat.to(self.device)
                total += flat.numel() * flat.element_size()
                work = self._bcast(flat)
                pending.append((work, flat))
                if len(pending) > 1:  # the previous bucket; this one is already in flight
                    pending.pop(0)[0].wait(self.timeout)
            for work, _ in pending:
                work.wait(self.timeout)
        self.sent.update(prints)
        self.syncs += 1
        return SyncStats(tensors=len(items), bytes=total, buckets=len(buckets),
                         seconds=time.perf_counter() - start, prepare_s=start - t0,
                         names=[n for n, _ in items], backend=self.backend or "",
                         receivers=self.world_size - 1)

    def _select(self, items, names, only_changed):
        if names is not None:
            have = {n for n, _ in items}
            missing = [n for n in names if n not in have]
            if missing:
                raise KeyError(f"weight sync: unknown tensor name(s) {missing[:5]} (of {len(missing)})")
            wanted = set(names)
            items = [(n, t) for n, t in items if n in wanted]
        # Fingerprints cost a pass over the weights: taken only once only_changed is in use.
        self.tracking = self.tracking or only_changed
        if not self.tracking:
            return items, {}
        prints = {n: fingerprint(t) for n, t in items}
        if only_changed:
            items = [(n, t) for n, t in items if self.sent.get(n) != prints[n]]
        return items, prints

    def _send_manifest(self, manifest: dict) -> None:
        import torch

        data = json.dumps(manifest).encode()
        head = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._bcast(head).wait(self.timeout)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        self._bcast(body).wait(self.timeout)

    # -- receivers ------------------------------------------------------------------------------
    def recv(self, load: Any) -> SyncStats:
        """Receive one sync (ranks > 0). ``load``: a dict name -> tensor to copy into, or a
        callable taking a list of (name, tensor) per bucket (e.g. vLLM's ``load_weights``)."""
        import torch

        start = time.perf_counter()
        head = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(head).wait(self.timeout)
        body = torch.empty(int(head.item()), dtype=torch.uint8, device=self.device)
        self._bcast(body).wait(self.timeout)
        manifest = json.loads(bytes(body.cpu().numpy()).decode())
        if "error" in manifest:
            raise RuntimeError(f"weight sync: the source failed: {manifest['error']}")
        specs = manifest["tensors"]
        problems: list[str] = []
        failure: BaseException | None = None
        total = 0

        def post(bucket):
            dt = _dtype(specs[bucket[0]][1])
            numel = sum(_numel(specs[i][2]) for i in bucket)
            buf = torch.empty(numel, dtype=dt, device=self.device)
            return self._bcast(buf), buf

        buckets = manifest["buckets"]
        with torch.no_grad():
            nxt = post(buckets[0]) if buckets else None
            for k, bucket in enumerate(buckets):
                work, buf = nxt
                nxt = post(buckets[k + 1]) if k + 1 < len(buckets) else None
                work.wait(self.timeout)
                total += buf.numel() * buf.element_size()
                out, offset = [], 0
                for i in bucket:
                    name, _, shape = specs[i]
                    n = _numel(shape)
                    out.append((name, buf[offset:offset + n].view(shape)))
                    offset += n
                try:  # keep receiving after a failed load: the source must not hang
                    problems.extend(_apply(load, out))
                except Exception as e:
                    failure = failure or e
        self.syncs += 1
        if failure is not None:
            raise failure
        if problems:
            raise ValueError("weight sync: received tensors did not fit: " + "; ".join(problems[:5])
                             + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
        return SyncStats(tensors=len(specs), bytes=total, buckets=len(buckets),
                         seconds=time.perf_counter() - start, names=[s[0] for s in specs],
                         backend=self.backend or "", receivers=self.world_size - 1)

    def close(self) -> None:
        """Leave the process group (best effort)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # already broken: dropping it is enough
                logger.debug("weight sync: process group shutdown failed", exc_info=True)
        self.store = None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _apply(load: Any, out: list[tuple[str, Any]]) -> list[str]:
    if callable(load) and not isinstance(load, dict):
        load(out)
        return []
    problems = []
    for name, value in out:
        target = load.get(name)
        if target is None:
            problems.append(f"no tensor named {name!r} here")
        elif tuple(target.shape) != tuple(value.shape):
            problems.append(f"{name!r}: shape {tuple(value.shape)} sent, {tuple(target.shape)} here")
        else:
            target.copy_(value)
    return problems


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # ray is a dependency; stay usable without it
        pass
    return "127.0.0.1"


# ------------------------------------------------------------------------------ the mixin
def _is_dtensor(tensor: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2 / tensor-parallel shard), without importing it."""
    cls = type(tensor)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


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


class WeightSyncMixin:
    """Weight-sync endpoints for a remote class (trainer or sampler).

    Override ``weight_sync_tensors()`` (default: ``self.model``'s state dict,
    unwrapping DDP) and, on a sampler, ``weight_sync_load(items)`` (default:
    ``copy_`` into ``weight_sync_tensors()``; vLLM: ``model.load_weights(items)``).
    The ``weight_sync_*`` remote methods are called by :class:`WeightSync`.

    On the source, ``weight_sync_tensors()`` runs on *every* rank of the
    gang before rank 0 sends, so a sharded trainer may gather full tensors
    there with a collective (FSDP full state dict, Megatron TP/PP gather) and
    return them on rank 0 (other ranks may return ``{}``).

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

    # -- hooks ----------------------------------------------------------------------------------
    def weight_sync_tensors(self) -> dict[str, Any]:
        """name -> tensor: what a source sends and a receiver fills by default.

        ``self.model``'s state dict (DDP unwrapped). An FSDP2 (``fully_shard``)
        or DTensor-parallel model is gathered here: every rank calls
        ``full_tensor()`` once per tensor, rank 0 returns the full tensors and
        the other ranks ``{}``. That suits a source; a sharded *receiver* must
        override ``weight_sync_load`` (its targets are its own shards).
        """
        model = getattr(self, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            raise NotImplementedError(
                f"{type(self).__name__}: set self.model to a torch module or override "
                f"weight_sync_tensors() to return a dict name -> tensor"
            )
        return _module_tensors(model)

    def weight_sync_load(self, items: list[tuple[str, Any]]) -> None:
        """Take one bucket of received (name, tensor); default: copy into weight_sync_tensors()."""
        problems = _apply(self.weight_sync_tensors(), items)
        if problems:
            raise ValueError("; ".join(problems))

    def _weight_channels(self) -> dict[str, WeightChannel]:
        return self.__dict__.setdefault("_twinkle_weight_channels", {})

    # -- remote endpoints -----------------------------------------------------------------------
    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_probe(self) -> list[dict]:
        """This worker's facts for choosing the backend: [{'cuda': bool, 'ip': str}]."""
        import torch

        return [{"cuda": bool(torch.cuda.is_available()), "ip": _node_ip(), "rank": get_rank()}]

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
                         backend: str, timeout_s: float, rank_offset: int = 1) -> list[int]:
        """Join the channel's process group: the source's rank 0, or every receiver worker."""
        chans = self._weight_channels()
        if role == "source":
            if get_rank() != 0:
                return []
            ch = chans.get(channel)
            if ch is None:
                raise RuntimeError(f"weight sync channel {channel!r}: weight_sync_host was not called here")
        else:
            old = chans.pop(channel, None)
            if old is not None:
                old.close()
            ch = chans[channel] = WeightChannel.connect(addr, port, rank_offset + get_rank(), world_size,
                                                        timeout_s)
        ch.join(backend, prefix=f"twinkle-weights/{channel}")
        return [ch.rank]

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_ready(self, channel: str, role: str) -> list[bool]:
        """Whether this worker holds a joined channel (source: rank 0 only answers)."""
        if role == "source" and get_rank() != 0:
            return []
        ch = self._weight_channels().get(channel)
        return [ch is not None and ch.pg is not None]

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_send(self, channel: str, names: list[str] | None = None, only_changed: bool = False,
                         bucket_mb: float = DEFAULT_BUCKET_MB) -> list[SyncStats]:
        """Source: every rank builds its tensors (may gather), rank 0 broadcasts them."""
        tensors = self.weight_sync_tensors()
        if get_rank() != 0:
            return []
        ch = self._channel(channel)
        return [ch.send(tensors.items(), names=names, only_changed=only_changed, bucket_mb=bucket_mb)]

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_recv(self, channel: str) -> list[SyncStats]:
        """Receiver: take one sync into ``weight_sync_load``."""
        stats = self._channel(channel).recv(self.weight_sync_load)
        stats.names = []  # the source reports names; keep the replies small
        return [stats]

    @remote_function(dispatch="all")
    def weight_sync_close(self, channel: str) -> None:
        """Leave the channel."""
        ch = self._weight_channels().pop(channel, None)
        if ch is not None:
            ch.close()

    def _channel(self, channel: str) -> WeightChannel:
        ch = self._weight_channels().get(channel)
        if ch is None or ch.pg is None:
            raise RuntimeError(
                f"weight sync channel {channel!r} is not set up in this worker (was the gang "
                f"restarted?); WeightSync sets it up again on the next sync"
            )
        return ch


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
        probes = [get(g.weight_sync_probe(), wait) for g in [self.source, *self.targets]]
        sizes = [len(p) for p in probes[1:]]
        self.world_size = 1 + sum(sizes)
        backend = self.backend or ("nccl" if all(x["cuda"] for p in probes for x in p) else "gloo")
        addr, port = get(self.source.weight_sync_host(self.channel, self.world_size, self.timeout_s), wait)
        joins = [self.source.weight_sync_join(self.channel, addr, port, "source", self.world_size,
                                              backend, self.timeout_s)]
        offset = 1
        for g, n in zip(self.targets, sizes, strict=True):
            joins.append(g.weight_sync_join(self.channel, addr, port, "target", self.world_size,
                                            backend, self.timeout_s, offset))
            offset += n
        ranks = [r for j in joins for r in get(j, wait)]
        if sorted(ranks) != list(range(self.world_size)):
            raise RuntimeError(f"weight sync: joined ranks {sorted(ranks)}, expected 0..{self.world_size - 1}")
        self.backend_used = backend
        self._ok = True
        logger.info("weight sync %s: %s group of %d (source + %d receiver(s)) at %s:%d",
                    self.channel, backend, self.world_size, self.world_size - 1, addr, port)

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
            gang._abort(f"weight sync {self.channel} failed on {culprit!r}; ranks {ranks} were "
                        f"still inside it {SYNC_GRACE_S:g}s later", ranks)
        return first

    def close(self) -> None:
        """Leave the channel on every worker (best effort)."""
        if not self._remote:
            return
        from .runtime.session import get

        for g in [self.source, *self.targets]:
            try:
                get(g.weight_sync_close(self.channel), 30)
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
            t.weight_sync_load([(n, v.detach()) for n, v in items])
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
