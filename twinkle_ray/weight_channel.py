"""The weight-sync transport: a bucketed broadcast over one cross-gang process group, and its ends.

:mod:`twinkle_ray.weights` drives it between gangs (:func:`~twinkle_ray.weights.sync_weights`); this
module is what runs in the processes at either end, and works without Ray:

- :class:`WeightChannel`: one process's end of the group. Rank 0 hosts a ``TCPStore`` and sends; the
  other ranks connect and receive. A ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) is built
  on the store with torch's public API.
- :class:`ReceiverEnd`: one *receiving* process's channels and what it does with a sync (``consume``).
  A gang worker holds one (the default), and so does each vLLM worker process when a sampler fans the
  weight sync out to its engine (``collective_rpc``).
- :func:`load_into`: copy received full tensors into a process's own tensors, in place; a DTensor
  target (FSDP2 / tensor-parallel shard) takes only its local slice, so the model itself is updated.

One sync: the source broadcasts a small JSON manifest (names, dtypes, shapes, bucket layout), then the
tensors packed into flat buckets of one dtype (``bucket_mb``; a larger tensor gets a bucket of its
own). Packing the next bucket overlaps sending the current one; a receiver posts the next bucket's
receive before handing on the current one. Every wait is bounded by the channel's timeout, and a
receiver whose load fails still takes the whole sync (so the source never hangs), then raises.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .runtime.net import is_loopback, loopback_listener

logger = logging.getLogger(__name__)

__all__ = ["ReceiverEnd", "SyncStats", "WeightChannel", "fingerprint", "load_into"]

DEFAULT_BUCKET_MB = 32
DEFAULT_TIMEOUT_S = 300.0
# How long an end waits for the other ends to reach a sync on an established channel (their gangs
# may still be running the calls made before it). Not the transfer's timeout: that starts once
# every end has arrived. A death ends this wait at once (the dead peer's connections close).
PEER_WAIT_S = 24 * 3600.0
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
        # How long a sync waits for every end to arrive (see arrive()): the timeout, unless the
        # owner knows the ends reach a sync at different times (gangs: PEER_WAIT_S).
        self.peer_wait = self.timeout

    @classmethod
    def host(cls, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, host_ip: str | None = None) -> WeightChannel:
        """Rank 0's end: start the TCPStore on a free port of this node."""
        import torch.distributed as dist

        ip = host_ip or _node_ip()
        common = dict(world_size=world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                      wait_for_workers=False)
        if not is_loopback(ip):
            store = dist.TCPStore(ip, 0, **common)
            return cls(store, 0, world_size, timeout_s, (ip, int(store.port)))
        # A loopback-only node (the embedded default): torch's store would bind every interface
        # for the address it is given, so bind the port on loopback here and hand the socket over.
        listener = loopback_listener(ip, 0, world_size)
        port = listener.getsockname()[1]
        store = dist.TCPStore(ip, port, master_listen_fd=listener.fileno(), **common)
        listener.detach()  # the store owns the socket now
        return cls(store, 0, world_size, timeout_s, (ip, port))

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
        self._gate(store)
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

    def _gate(self, store: Any) -> None:
        """Set-up: wait until every rank has reached the channel, or one of them failed.

        Each rank but the host counts itself in; the last one opens the gate. A rank that fails
        before it gets there writes its error into the gate instead (:meth:`refuse`), so no rank
        waits in the rendezvous for the whole timeout. Bounded by the channel's timeout.
        """
        if self.rank != 0 and store.add("arrived", 1) == self.world_size - 1:
            store.set("gate", "open")
        store.wait(["gate"], self.timeout)
        state = store.get("gate").decode()
        if state != "open":
            raise SetupRefused(f"weight sync: the set-up failed on another end: {state}")

    @staticmethod
    def refuse(addr: str, port: int, message: str, prefix: str = "twinkle-weights",
               timeout_s: float = 10.0) -> None:
        """Tell every end of a channel being set up that this one failed (best effort).

        The ends waiting at the set-up gate raise ``message`` at once instead of waiting for
        their timeout.
        """
        import torch.distributed as dist

        try:
            store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            dist.PrefixStore(prefix, store).set("gate", message)
        except Exception:  # the host is gone too: nobody is left waiting on it
            logger.debug("weight sync: could not refuse the set-up at %s:%s", addr, port, exc_info=True)

    def arrive(self) -> None:
        """Wait until every end has reached this sync (the first step of a send and a receive).

        Bounded by ``peer_wait`` (the channel's timeout unless set: gang ends, whose gangs may
        still be running earlier calls, use ``PEER_WAIT_S``); the channel's timeout bounds every
        step after it. A peer that dies meanwhile ends the wait at once (its connections close).
        """
        import torch
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.timeout = self.peer_wait
        self.pg.allreduce([torch.zeros(1, device=self.device)], opts).wait()

    def fail(self, message: str) -> None:
        """Source: end this sync with an error on every receiver (they raise ``message``);
        the channel stays in step for the next sync."""
        self.arrive()
        self._send_manifest({"error": message})

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
        t0 = time.perf_counter()
        try:
            items, prints = self._select(list(named_tensors), names, only_changed)
        except Exception as e:
            self.fail(f"{type(e).__name__}: {e}")
            raise
        prepare_s = time.perf_counter() - t0
        try:
            self.arrive()
            return self._send(items, prints, bucket_mb, prepare_s)
        except BaseException:
            self.close()  # broken mid-transfer: closing it ends the peers' waits at once
            raise

    def _send(self, items: list, prints: dict, bucket_mb: float, prepare_s: float) -> SyncStats:
        import torch

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
                         seconds=time.perf_counter() - start, prepare_s=prepare_s,
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
        """Receive one sync (ranks > 0) into ``load``: a dict name -> tensor (see :func:`load_into`),
        or a callable taking each bucket's list of (name, tensor). A bucket that fails to load does
        not stop the sync: every bucket is received, then the first failure is raised."""
        problems: list[str] = []
        failure: list[BaseException] = []

        def consume(buckets: Iterator[list[tuple[str, Any]]]) -> None:
            for items in buckets:
                try:
                    problems.extend(load_into(load, items))
                except Exception as e:  # keep receiving: the source must not hang
                    failure.append(e)

        stats = self.receive(consume)
        if failure:
            raise failure[0]
        if problems:
            raise ValueError("weight sync: received tensors did not fit: " + "; ".join(problems[:5])
                             + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
        return stats

    def receive(self, consume: Callable[[Iterator[list[tuple[str, Any]]]], Any]) -> SyncStats:
        """Receive one sync (ranks > 0), handing ``consume`` an iterator over its buckets.

        Each bucket is a list of (name, tensor) views into a fresh buffer, yielded as it arrives
        (the next bucket's receive is already posted). Whatever ``consume`` does not take -- it
        returned early or raised -- is still received and dropped, so the source never hangs; its
        exception is raised afterwards.

        >>> # ch.receive(lambda buckets: engine.reload_weights(i for b in buckets for i in b))
        """
        try:
            self.arrive()
            start = time.perf_counter()  # the transfer: from the moment every end is here
            manifest = self._recv_manifest()
        except SourceFailed:
            raise  # told by the source: the channel is still in step
        except BaseException:
            self.close()  # broken: closing it ends the other ends' waits at once
            raise
        specs = manifest["tensors"]
        totals = {"bytes": 0}
        buckets = self._bucket_stream(specs, manifest["buckets"], totals)
        error: BaseException | None = None
        try:
            consume(buckets)
        except BaseException as e:  # re-raised once the sync is drained
            error = e
        try:
            for _ in buckets:  # drain what consume left (a no-op when it took everything)
                pass
        except BaseException as e:  # the transfer itself failed (timeout, peer gone)
            error = error or e
            self.close()
        self.syncs += 1
        if error is not None:
            raise error
        return SyncStats(tensors=len(specs), bytes=totals["bytes"], buckets=len(manifest["buckets"]),
                         seconds=time.perf_counter() - start, names=[s[0] for s in specs],
                         backend=self.backend or "", receivers=self.world_size - 1)

    def _recv_manifest(self) -> dict:
        import torch

        head = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(head).wait(self.timeout)
        body = torch.empty(int(head.item()), dtype=torch.uint8, device=self.device)
        self._bcast(body).wait(self.timeout)
        manifest = json.loads(bytes(body.cpu().numpy()).decode())
        if "error" in manifest:
            raise SourceFailed(f"weight sync: the source failed: {manifest['error']}")
        return manifest

    def _bucket_stream(self, specs: list, buckets: list[list[int]], totals: dict) -> Iterator[list]:
        """The buckets of one sync as (name, tensor) lists; the next receive is posted before yielding."""
        import torch

        def post(bucket):
            dt = _dtype(specs[bucket[0]][1])
            numel = sum(_numel(specs[i][2]) for i in bucket)
            buf = torch.empty(numel, dtype=dt, device=self.device)
            return self._bcast(buf), buf

        nxt = post(buckets[0]) if buckets else None
        for k, bucket in enumerate(buckets):
            work, buf = nxt
            try:
                nxt = post(buckets[k + 1]) if k + 1 < len(buckets) else None
                work.wait(self.timeout)
            except BaseException:
                nxt = work = None
                self.close()  # broken: closing it ends the other ends' waits at once
                raise
            totals["bytes"] += buf.numel() * buf.element_size()
            out, offset = [], 0
            for i in bucket:
                name, _, shape = specs[i]
                n = _numel(shape)
                out.append((name, buf[offset:offset + n].view(shape)))
                offset += n
            yield out

    def close(self) -> None:
        """Leave the process group (best effort)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # already broken: dropping it is enough
                logger.debug("weight sync: process group shutdown failed", exc_info=True)
        self.store = None


class SetupRefused(RuntimeError):
    """An end's error when another end told the set-up gate that it failed (:meth:`WeightChannel.refuse`)."""


class SourceFailed(RuntimeError):
    """A receiver's error when the source told it that it failed (the channel stays in step)."""


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _is_dtensor(tensor: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2 / tensor-parallel shard), without importing it."""
    cls = type(tensor)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed")


def _local_part(target: Any, full: Any) -> Any:
    """This rank's slice of ``full`` for the DTensor ``target`` (same mesh and placements; no collective:
    every receiver holds the full tensor, so each takes its own part)."""
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=target.device, dtype=target.dtype)
    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()


def load_into(targets: Any, items: list[tuple[str, Any]]) -> list[str]:
    """Copy received (name, full tensor) pairs into ``targets`` in place; returns what did not fit.

    ``targets``: a dict name -> tensor (a model's own parameters and buffers, e.g.
    ``model.state_dict(keep_vars=True)``), or a callable taking ``items`` (returns ``[]``). A
    DTensor target (an FSDP2 or tensor-parallel shard) keeps only its local part of the full
    tensor: the shard inside the model changes, not a gathered copy.

    >>> import torch
    >>> w = torch.zeros(2)
    >>> load_into({"w": w}, [("w", torch.ones(2)), ("x", torch.ones(1))]), w.tolist()
    (["no tensor named 'x' here"], [1.0, 1.0])
    """
    import torch

    if callable(targets) and not isinstance(targets, dict):
        targets(items)
        return []
    problems = []
    with torch.no_grad():
        for name, value in items:
            target = targets.get(name)
            if target is None:
                problems.append(f"no tensor named {name!r} here")
            elif tuple(target.shape) != tuple(value.shape):
                problems.append(f"{name!r}: shape {tuple(value.shape)} sent, {tuple(target.shape)} here")
            elif _is_dtensor(target):
                target.to_local().copy_(_local_part(target, value))
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



# ------------------------------------------------------------------------------ a receiving end
class ReceiverEnd:
    """One receiving process's weight-sync channels, and what it does with each sync.

    ``consume(buckets)`` is called once per sync with an iterator over that sync's buckets (lists
    of (name, full tensor)); it resolves where they go once, then loads them (a model's own
    tensors via :func:`load_into`, an engine's ``reload_weights``, ...). ``index`` tells this end
    apart from the other receivers in the same worker (a vLLM engine's worker rank; 0 alone).

    The driver (:class:`~twinkle_ray.weights.WeightSync`) reaches every end through the worker's
    fan-out hook (:meth:`~twinkle_ray.weights.WeightSyncMixin.weight_sync_fanout`), which forwards
    ``call(op, *args)``; ``op`` is one of :attr:`OPS`.

    >>> end = ReceiverEnd(lambda buckets: None)
    >>> end.call("ready", "ws-1")
    False
    """

    OPS = ("probe", "join", "ready", "recv", "close")

    def __init__(self, consume: Callable[[Iterator[list[tuple[str, Any]]]], Any], index: int = 0):
        self.consume = consume
        self.index = int(index)
        self.channels: dict[str, WeightChannel] = {}

    def call(self, op: str, *args: Any) -> Any:
        """Run receiving-end operation ``op`` (what the fan-out hook forwards)."""
        if op not in self.OPS:
            raise ValueError(f"weight sync: unknown receiver operation {op!r} (one of {self.OPS})")
        return getattr(self, op)(*args)

    def probe(self) -> dict:
        """Facts for choosing the backend and this end's rank: {'cuda', 'ip', 'index'}."""
        import torch

        return {"cuda": bool(torch.cuda.is_available()), "ip": _node_ip(), "index": self.index}

    def join(self, channel: str, addr: str, port: int, ranks: Sequence[Sequence[int]], world_size: int,
             backend: str, timeout_s: float) -> int:
        """Join ``channel`` at the rank the driver gave this end: ``ranks`` is [[index, rank], ...]
        for the receivers of this worker."""
        mine = [r for i, r in ranks if int(i) == self.index]
        if len(mine) != 1:
            raise RuntimeError(f"weight sync channel {channel!r}: no rank for receiver index {self.index} "
                               f"in {list(ranks)} (was the engine resized since the set-up?)")
        self.close(channel)
        ch = WeightChannel.connect(addr, port, int(mine[0]), world_size, timeout_s)
        self.channels[channel] = ch.join(backend, prefix=f"twinkle-weights/{channel}")
        ch.peer_wait = timedelta(seconds=PEER_WAIT_S)  # the source's gang may still be busy
        return ch.rank

    def ready(self, channel: str) -> bool:
        """Whether this end holds a joined ``channel``."""
        ch = self.channels.get(channel)
        return ch is not None and ch.pg is not None

    def recv(self, channel: str) -> dict:
        """Take one sync into ``consume``; returns its figures (a plain dict: it may cross processes)."""
        ch = self.channels.get(channel)
        if ch is None or ch.pg is None:
            raise RuntimeError(
                f"weight sync channel {channel!r} is not set up in this receiver (was the gang "
                f"restarted?); WeightSync sets it up again on the next sync"
            )
        stats = ch.receive(self.consume)
        return {"tensors": stats.tensors, "bytes": stats.bytes, "buckets": stats.buckets,
                "seconds": stats.seconds, "backend": stats.backend, "receivers": stats.receivers}

    def close(self, channel: str) -> None:
        """Leave ``channel`` (nothing when not joined)."""
        ch = self.channels.pop(channel, None)
        if ch is not None:
            ch.close()
