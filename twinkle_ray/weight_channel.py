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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .runtime.net import is_loopback, loopback_listener

logger = logging.getLogger(__name__)

__all__ = ["ReceiverEnd", "SyncStats", "TensorSource", "WeightChannel", "bytes_written", "fingerprint",
           "load_into", "receive_lanes"]

DEFAULT_BUCKET_MB = 32
DEFAULT_TIMEOUT_S = 300.0
# How long an end waits for the other ends to reach a sync on an established channel (their gangs
# may still be running the calls made before it). Not the transfer's timeout: that starts once
# every end has arrived. A death ends this wait at once (the dead peer's connections close).
PEER_WAIT_S = 24 * 3600.0
PEER_FAILURE_READ_S = 2.0  # reading why a peer left a broken channel (its store's host may be dying)
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
    lanes: int = 1  # sources that sent in parallel (one per pipeline stage), each on its own group
    # Bytes each process wrote while it took part (its ``/proc/self/io`` wchar delta: the wire bytes
    # of the transfer, and of any gather the source ran to build its tensors), by process label.
    sent_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def busiest_sent(self) -> int:
        """Bytes written by the busiest process of the sync (0 when not measured)."""
        return max(self.sent_bytes.values(), default=0)

    @property
    def gb_per_s(self) -> float:
        """Payload rate (GB/s, 1e9 bytes) of one copy of the weights."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"{self.tensors} tensor(s), {self.bytes / 1e6:.1f} MB in {self.buckets} bucket(s), "
                f"{self.seconds:.3f}s ({self.gb_per_s:.2f} GB/s to each of {self.receivers} receiver(s), "
                f"{self.backend}" + (f", {self.lanes} lanes" if self.lanes > 1 else "")
                + (f", busiest process wrote {self.busiest_sent / 1e6:.1f} MB" if self.sent_bytes else "")
                + ")")


def bytes_written() -> int:
    """Bytes this process has written so far (``wchar`` of ``/proc/self/io``: files and sockets, every
    thread; 0 where the kernel does not report it). Deltas around a sync measure what it sent."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


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
    def host(cls, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, host_ip: str | None = None,
             lanes: int = 1) -> WeightChannel:
        """Rank 0's end: start the TCPStore on a free port of this node. ``lanes``: how many sources
        send in parallel (each on a group of its own over this store; see :func:`join_lanes`)."""
        ch = cls._host(world_size, timeout_s, host_ip)
        ch.store.set("lanes", str(int(lanes)))
        return ch

    @classmethod
    def _host(cls, world_size: int, timeout_s: float, host_ip: str | None) -> WeightChannel:
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
        """A receiver's end (or another lane's source, at rank 0 of its own group): connect to the
        host's TCPStore."""
        import torch.distributed as dist

        if not 0 <= rank < world_size:  # rank 0 too: a lane's source other than the host's
            raise ValueError(f"weight sync: rank {rank} is outside 0..{world_size - 1}")
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, rank, world_size, timeout_s, (addr, port))

    def join(self, backend: str = "gloo", prefix: str = "twinkle-weights") -> WeightChannel:
        """Create the process group (a rendezvous: every rank calls it concurrently)."""
        import torch
        import torch.distributed as dist

        self.pass_gate(prefix)
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

    def pass_gate(self, prefix: str = "twinkle-weights", count: int = 1) -> None:
        """Set-up: wait until every rank has reached the channel (group ``prefix``), or one failed.

        Each rank but the source (rank 0) counts itself in (``count``: the receivers this end stands
        for); the last one opens the gate. A rank that fails before it gets there writes its error
        into the gate instead (:meth:`refuse`), so no rank waits in the rendezvous for the whole
        timeout. Bounded by the channel's timeout.
        """
        import torch.distributed as dist

        store = dist.PrefixStore(prefix, self.store)
        if self.rank != 0 and store.add("arrived", count) == self.world_size - 1:
            store.set("gate", "open")
        store.wait(["gate"], self.timeout)
        state = store.get("gate").decode()
        if state != "open":
            raise SetupRefused(f"weight sync: the set-up failed on another end: {state}")

    @staticmethod
    def refuse(addr: str, port: int, message: str, prefix: str = "twinkle-weights",
               timeout_s: float = 10.0, channel: str | None = None) -> None:
        """Tell every end of a channel being set up that this one failed (best effort).

        The ends waiting at the set-up gate raise ``message`` at once instead of waiting for
        their timeout. ``channel``: refuse the gate of every lane the host announced
        (:func:`lane_prefix`; each lane's source waits at its own), instead of ``prefix`` alone.
        """
        import torch.distributed as dist

        try:
            store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            lanes = int(store.get("lanes")) if channel is not None else 1
            prefixes = [lane_prefix(channel, k) for k in range(lanes)] if channel is not None else [prefix]
            for p in prefixes:
                dist.PrefixStore(p, store).set("gate", message)
        except Exception:  # the host is gone too: nobody is left waiting on it
            logger.debug("weight sync: could not refuse the set-up at %s:%s", addr, port, exc_info=True)

    @staticmethod
    def leave(addr: str, port: int, message: str, timeout_s: float = PEER_FAILURE_READ_S / 2) -> None:
        """Say why this end leaves an established channel (best effort), before it closes: the ends
        whose wait its closing ends raise :class:`PeerFailed` with ``message`` (an echo, not a cause).
        Bounded by a short ``timeout_s``: when the failure was the host's death, connecting to its
        store only retries until then, and this end must leave within the sync's grace."""
        import torch.distributed as dist

        try:
            dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s)).set("failed", message)
        except Exception:  # the host is gone too: nobody is left waiting on it
            logger.debug("weight sync: could not say why this end left %s:%s", addr, port, exc_info=True)

    def peer_failure(self) -> str | None:
        """What an end that left this channel said (:meth:`leave`), or None; waits at most
        ``PEER_FAILURE_READ_S`` (the store's host may be going down too)."""
        try:
            if self.store is not None:
                self.store.set_timeout(timedelta(seconds=PEER_FAILURE_READ_S))  # the channel is closing
            if self.store is not None and self.store.check(["failed"]):
                return self.store.get("failed").decode()
        except Exception:  # the store went with its host
            logger.debug("weight sync: could not read why a peer left", exc_info=True)
        return None

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

    def lanes(self) -> int:
        """How many sources the host announced (waits for the key, within the timeout)."""
        return int(self.store.get("lanes"))

    def lane(self, k: int) -> WeightChannel:
        """Another end for lane ``k`` on the same store, at this end's rank (not joined yet)."""
        return WeightChannel(self.store, self.rank, self.world_size, self.timeout.total_seconds(), self.address)

    def _bcast(self, tensor: Any) -> Any:
        return self.pg.broadcast(tensor, 0, self.timeout)

    # -- source ---------------------------------------------------------------------------------
    def send(
        self,
        named_tensors: Any,
        *,
        names: Sequence[str] | None = None,
        only_changed: bool = False,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> SyncStats:
        """Broadcast tensors (rank 0). ``names``: only these; ``only_changed``: only the changed ones.

        ``named_tensors``: (name, tensor) pairs, or a lazy source (:class:`TensorSource`, or any object
        with ``metadata()`` -- (name, dtype, shape) per tensor, or vLLM's ``ParamMeta`` -- whose iteration
        yields the tensors in that order, each materialised as it is reached, e.g. by a TP all-gather).
        A lazy source's manifest goes out from its metadata, and its next bucket is materialised while
        the current one is on the wire. It is iterated to the end whatever ``names`` selects (its
        materialisation may be a collective the other ranks run too). ``only_changed`` materialises
        everything first (the fingerprints decide what is sent).
        """
        t0 = time.perf_counter()
        lazy = hasattr(named_tensors, "metadata") and not (only_changed or self.tracking)
        bucket_bytes = int(bucket_mb * 2**20)
        try:
            if lazy:
                specs = [_spec(m) for m in named_tensors.metadata()]
                wanted = _check_names([s[0] for s in specs], names)
                specs = [s for s in specs if wanted is None or s[0] in wanted]
                prints: dict = {}
                buckets = _runs(specs, bucket_bytes)
            else:
                items, prints = self._select(list(named_tensors), names, only_changed)
                specs = [(n, str(t.dtype), tuple(t.shape)) for n, t in items]
                buckets = _buckets(items, bucket_bytes)
        except Exception as e:
            self.fail(f"{type(e).__name__}: {e}")
            raise
        prepare_s = time.perf_counter() - t0
        try:
            self.arrive()
            if lazy:
                take, drain = _puller(iter(named_tensors), specs, wanted)
            else:
                take, drain = (lambda bucket: [items[i][1] for i in bucket]), (lambda: None)
            return self._send(specs, buckets, take, drain, prints, prepare_s)
        except BaseException as e:
            told = self.peer_failure()  # a receiver that failed said why before it left
            self.close()  # broken mid-transfer: closing it ends the peers' waits at once
            if told is not None:
                raise PeerFailed(f"weight sync: a receiver failed: {told}") from e
            raise

    def _send(self, specs: list, buckets: list, take: Any, drain: Any, prints: dict,
              prepare_s: float) -> SyncStats:
        import torch

        start = time.perf_counter()
        self._send_manifest({"seq": self.syncs, "tensors": [[n, d, list(sh)] for n, d, sh in specs],
                             "buckets": buckets})
        pending: list = []
        total = 0
        with torch.no_grad():
            for bucket in buckets:
                parts = [t.detach().reshape(-1) for t in take(bucket)]
                flat = parts[0] if len(parts) == 1 and parts[0].is_contiguous() else torch.cat(parts)
                if flat.device != self.device:
                    flat = flat.to(self.device)
                total += flat.numel() * flat.element_size()
                pending.append((self._bcast(flat), flat))
                if len(pending) > 1:  # the previous bucket; this one is already in flight
                    pending.pop(0)[0].wait(self.timeout)
            for work, _ in pending:
                work.wait(self.timeout)
            drain()
        self.sent.update(prints)
        self.syncs += 1
        return SyncStats(tensors=len(specs), bytes=total, buckets=len(buckets),
                         seconds=time.perf_counter() - start, prepare_s=prepare_s,
                         names=[s[0] for s in specs], backend=self.backend or "",
                         receivers=self.world_size - 1)

    def _select(self, items, names, only_changed):
        wanted = _check_names([n for n, _ in items], names)
        if wanted is not None:
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
        exception is raised afterwards. :func:`receive_lanes` takes one sync from several sources.

        >>> # ch.receive(lambda buckets: engine.reload_weights(i for b in buckets for i in b))
        """
        return receive_lanes([self], consume)

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

    def _post(self, specs: list, bucket: list[int]) -> tuple[Any, Any]:
        """Post the receive of one bucket: (work, flat buffer)."""
        import torch

        dt = _dtype(specs[bucket[0]][1])
        buf = torch.empty(sum(_numel(specs[i][2]) for i in bucket), dtype=dt, device=self.device)
        return self._bcast(buf), buf

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


class PeerFailed(RuntimeError):
    """An end's error when its transfer broke because another end failed and said why (:meth:`WeightChannel.leave`)."""


class SourceFailed(RuntimeError):
    """A receiver's error when the source told it that it failed (the channel stays in step)."""


def lane_prefix(channel: str, lane: int) -> str:
    """The store prefix of ``channel``'s group for ``lane`` (lane 0: the channel's own)."""
    return f"twinkle-weights/{channel}" + (f"/lane{lane}" if lane else "")


def join_lanes(first: WeightChannel, channel: str, backend: str) -> list[WeightChannel]:
    """A receiver's groups for every lane the host announced (same rank in each), joined in lane order
    (each a rendezvous with that lane's source and the other receivers)."""
    ends = [first] + [first.lane(k) for k in range(1, first.lanes())]
    return [ch.join(backend, prefix=lane_prefix(channel, k)) for k, ch in enumerate(ends)]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _spec(meta: Any) -> tuple[str, str, tuple[int, ...]]:
    """(name, dtype name, shape) from a (name, dtype, shape) tuple or an object with those attributes
    (vLLM's ``ParamMeta``)."""
    name, dtype, shape = (meta.name, meta.dtype, meta.shape) if hasattr(meta, "name") else meta
    return str(name), str(dtype), tuple(int(x) for x in shape)


def _check_names(have: list[str], names: Sequence[str] | None) -> set[str] | None:
    """``names`` as a set (None: all), after checking every one exists."""
    if names is None:
        return None
    known = set(have)
    missing = [n for n in names if n not in known]
    if missing:
        raise KeyError(f"weight sync: unknown tensor name(s) {missing[:5]} (of {len(missing)})")
    return set(names)


def _runs(specs: list, bucket_bytes: int) -> list[list[int]]:
    """Consecutive indices of ``specs`` in buckets of one dtype and at most ``bucket_bytes`` (a lazy
    source is materialised in order, so its buckets are runs)."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, dt, shape) in enumerate(specs):
        nbytes = _numel(shape) * _dtype(dt).itemsize
        if not buckets or dt != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _puller(it: Iterator, specs: list, wanted: set[str] | None) -> tuple[Callable, Callable]:
    """(take(bucket) -> its tensors, drain()) over a lazy source's iterator, checked against ``specs``."""
    pos = {"next": 0}

    def take(bucket: list[int]) -> list:
        out = []
        for i in bucket:
            name, dt, shape = specs[i]
            got, t = next(((n, x) for n, x in it if wanted is None or n in wanted), (None, None))
            if got is None:
                raise ValueError(f"weight sync: the source ended before {name!r} (its metadata() "
                                 f"declared {len(specs)} tensors)")
            if got != name or str(t.dtype) != dt or tuple(t.shape) != tuple(shape):
                raise ValueError(f"weight sync: the source's metadata() declared {name!r} {dt} {list(shape)} "
                                 f"at position {pos['next']} but iteration gave {got!r} {t.dtype} "
                                 f"{list(t.shape)}; both must list the same tensors in the same order")
            pos["next"] += 1
            out.append(t)
        return out

    def drain() -> None:
        for _ in it:  # the rest (names not selected): every rank materialises them in step
            pass

    return take, drain


class TensorSource:
    """A lazy, re-iterable source of named tensors: what ``weight_sync_tensors()`` may return instead
    of a dict, so the channel sends the manifest first and materialises bucket i+1 (e.g. a TP
    all-gather) while bucket i is on the wire. The same contract as vLLM's ``WeightSource``
    (``metadata()`` + iteration in that order), which the channel also takes as it is.

    >>> import torch
    >>> src = TensorSource([("w", torch.float32, (2,))], lambda: iter([("w", torch.ones(2))]))
    >>> [m[0] for m in src.metadata()], [n for n, _ in src]
    (['w'], ['w'])
    """

    def __init__(self, specs: Sequence[tuple[str, Any, Sequence[int]]],
                 produce: Callable[[], Iterator[tuple[str, Any]]]):
        self._specs = [(str(n), d, tuple(int(x) for x in s)) for n, d, s in specs]
        self._produce = produce

    def metadata(self) -> list[tuple[str, Any, tuple[int, ...]]]:
        """(name, dtype, full shape) of every tensor, in iteration order, with nothing materialised."""
        return list(self._specs)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self._produce())

    def __len__(self) -> int:
        return len(self._specs)


def receive_lanes(channels: Sequence[WeightChannel],
                  consume: Callable[[Iterator[list[tuple[str, Any]]]], Any]) -> SyncStats:
    """Receive one sync from several sources at once (one channel each, a *lane*: a pipeline stage's
    source sends its own layers), handing ``consume`` one iterator over every lane's buckets, in the
    order they arrive (round robin; each lane's next receive is posted before its bucket is yielded).

    What ``consume`` leaves is drained from every lane, so no source hangs. A sync is taken whole
    or not at all: when a lane's source failed before sending (its error manifest), ``consume`` is
    not called and the other lanes are drained unread, so the receiver keeps its previous weights
    entire (never some layers new and some old); the first error is raised at the end.
    """
    try:
        for ch in channels:
            ch.arrive()  # bounded by peer_wait: the sources may still be busy with earlier calls
    except BaseException as e:
        told = channels[0].peer_failure()  # another receiver that failed said why before it left
        for ch in channels:
            ch.close()  # broken: closing them ends the other ends' waits at once
        if told is not None:
            raise PeerFailed(f"weight sync: another receiver failed: {told}") from e
        raise
    start = time.perf_counter()  # the transfer: from the moment every end is here
    error: BaseException | None = None
    lanes, told = [], set()
    for ch in channels:
        try:
            manifest = ch._recv_manifest()
        except SourceFailed as e:  # told by its source: that lane is still in step
            error = error or e
            told.add(id(ch))
            continue
        except BaseException as e:  # the transfer itself
            error = error or e
            ch.close()
            continue
        lanes.append((ch, manifest["tensors"], [list(b) for b in manifest["buckets"] if b]))
    totals = {"bytes": 0}
    stream = _merged(lanes, totals)
    try:
        if error is None:  # else nothing is loaded: drained below
            consume(stream)
    except BaseException as e:  # re-raised once the sync is drained
        error = error or e
    try:
        for _ in stream:  # drain what consume left (a no-op when it took everything)
            pass
    except BaseException as e:  # the transfer itself failed (timeout, peer gone)
        error = error or e
        for ch in channels:
            ch.close()
    for ch in channels:
        if id(ch) not in told:  # a source that failed before sending counted no sync either
            ch.syncs += 1
    if error is not None:
        raise error
    specs = [s for _, lane_specs, _ in lanes for s in lane_specs]
    return SyncStats(tensors=len(specs), bytes=totals["bytes"], buckets=sum(len(b) for _, _, b in lanes),
                     seconds=time.perf_counter() - start, names=[s[0] for s in specs],
                     backend=channels[0].backend or "" if channels else "",
                     receivers=channels[0].world_size - 1 if channels else 0, lanes=len(channels))


def _merged(lanes: list, totals: dict) -> Iterator[list[tuple[str, Any]]]:
    """Every lane's buckets as (name, tensor) lists, round robin over the lanes still sending."""
    live = []
    for ch, specs, buckets in lanes:
        if buckets:
            live.append([ch, specs, buckets, ch._post(specs, buckets[0])])
    while live:
        still = []
        for lane in live:
            ch, specs, buckets, (work, buf) = lane
            bucket = buckets.pop(0)
            if buckets:
                lane[3] = ch._post(specs, buckets[0])
                still.append(lane)
            try:
                work.wait(ch.timeout)
            except BaseException:
                for other, _, _ in lanes:  # broken: closing every lane ends all sources' waits at once
                    other.close()
                raise
            totals["bytes"] += buf.numel() * buf.element_size()
            out, offset = [], 0
            for i in bucket:
                name, _, shape = specs[i]
                n = _numel(shape)
                out.append((name, buf[offset:offset + n].view(shape)))
                offset += n
            yield out
        live = still


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
        self.channels: dict[str, list[WeightChannel]] = {}  # channel -> one per lane

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
        for the receivers of this worker. One group per lane (per source), same rank in each."""
        mine = [r for i, r in ranks if int(i) == self.index]
        if len(mine) != 1:
            raise RuntimeError(f"weight sync channel {channel!r}: no rank for receiver index {self.index} "
                               f"in {list(ranks)} (was the engine resized since the set-up?)")
        self.close(channel)
        first = WeightChannel.connect(addr, port, int(mine[0]), world_size, timeout_s)
        self.channels[channel] = join_lanes(first, channel, backend)
        for ch in self.channels[channel]:
            ch.peer_wait = timedelta(seconds=PEER_WAIT_S)  # the sources' gang may still be busy
        return first.rank

    def ready(self, channel: str) -> bool:
        """Whether this end holds a joined ``channel`` (every lane)."""
        lanes = self.channels.get(channel)
        return bool(lanes) and all(ch.pg is not None for ch in lanes)

    def recv(self, channel: str) -> dict:
        """Take one sync (every lane) into ``consume``; returns its figures (a plain dict: it may cross
        processes)."""
        if not self.ready(channel):
            raise RuntimeError(
                f"weight sync channel {channel!r} is not set up in this receiver (was the gang "
                f"restarted?); WeightSync sets it up again on the next sync"
            )
        w0 = bytes_written()
        stats = receive_lanes(self.channels[channel], self.consume)
        return {"tensors": stats.tensors, "bytes": stats.bytes, "buckets": stats.buckets,
                "seconds": stats.seconds, "backend": stats.backend, "receivers": stats.receivers,
                "lanes": stats.lanes, "sent_bytes": {f"receiver {self.index}": bytes_written() - w0}}

    def close(self, channel: str) -> None:
        """Leave ``channel`` (nothing when not joined)."""
        for ch in self.channels.pop(channel, None) or []:
            ch.close()
