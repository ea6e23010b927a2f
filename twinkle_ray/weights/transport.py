"""The weight-sync transport: point-to-point gloo (or NCCL) pairs between a trainer rank and a receiver.

Every trainer rank that holds weights hosts one :class:`Endpoint` per channel: a ``TCPStore`` (on
loopback when the node is). A receiver process joins one :class:`Pair` with each trainer rank it
takes bytes from: a two-rank process group (sender at rank 0, receiver at rank 1) built with
torch's public API on that endpoint's store, under a prefix of its own. Pairs are independent: a
receiver that dies breaks only its own pairs (their sockets close, so the peer's wait ends at once),
and a receiver rebuilt later makes new pairs without touching anyone else's. Why pairs over our own
groups and not Ray Direct Transport: docs/decisions/weight-transport.md.

One sync on one pair: a small JSON header (which planned pieces come, the bucket size, or an error
the sender hit before sending), then the pieces packed into flat buckets of one dtype. Both ends
derive the bucket layout from the header and the plan (:mod:`twinkle_ray.weights.plan`), so nothing
else is exchanged. Every wait is bounded by the channel's ``timeout_s``, a pair's first wait of a
sync too (the other gang may still run earlier calls: it has ``timeout_s`` to reach the sync); a
peer's death ends any wait at once (its sockets close).

>>> ep = Endpoint.host(timeout_s=10)          # on a trainer rank
>>> ep.address[0]
'127.0.0.1'
>>> ep.close()
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..runtime.net import is_loopback, loopback_listener

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_BUCKET_MB", "DEFAULT_TIMEOUT_S", "Endpoint", "Pair", "PeerFailed",
           "SetupRefused", "SourceFailed", "SyncStats", "bytes_written", "dtype_of", "node_ip", "open_pair", "peer_failed",
           "pair_order", "refuse_pair", "VLLM_NCCL", "choose_backend", "wait_all"]

DEFAULT_BUCKET_MB = 32
DEFAULT_TIMEOUT_S = 300.0  # bounds every wait of a sync and of a set-up, the first one included


class SetupRefused(RuntimeError):
    """An end's error when another end failed while the channel was being set up."""


class PeerFailed(RuntimeError):
    """An end's error when its transfer broke because another end failed and said why."""


class SourceFailed(RuntimeError):
    """A receiver's error when a sender told it that it failed before sending (pairs stay in step)."""


def peer_failed(key: str, error: BaseException) -> BaseException:
    """The error of an end whose pair ``key`` broke under it (its other end failed, left or died):
    a :class:`PeerFailed` (an echo: the other end's own error is the sync's), the transport's
    message kept. A timeout (Python's, or gloo's "Timed out ...") stays itself: nobody else failed.

    >>> peer_failed("0-ab", RuntimeError("Connection closed by peer"))
    PeerFailed('weight sync: pair 0-ab broke (its other end failed or left): Connection closed by peer')
    """
    if isinstance(error, PeerFailed | TimeoutError) or "timed out" in str(error).lower():
        return error
    failed = PeerFailed(f"weight sync: pair {key} broke (its other end failed or left): {error}")
    failed.__cause__ = error
    return failed


@dataclass
class SyncStats:
    """What one sync moved, as the trainer gang reports it (every sending rank's figures merged)."""

    tensors: int = 0
    bytes: int = 0  # payload bytes sent, all senders and receivers together
    buckets: int = 0
    seconds: float = 0.0  # the transfer, slowest sender
    prepare_s: float = 0.0  # choosing what to send (fingerprints) before the transfer
    names: list[str] = field(default_factory=list)
    backend: str = ""
    receivers: int = 0
    lanes: int = 1  # trainer ranks that sent
    path: str = ""  # which path the sync took (logged too): 'resharded' or 'gathered-source'
    # Per trainer rank ("rank r"): bytes the process wrote during the sync (its /proc/self/io wchar
    # delta: the wire bytes, and anything else it wrote meanwhile) and the payload it sent.
    sent_bytes: dict[str, int] = field(default_factory=dict)
    payload_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def busiest_sent(self) -> int:
        """Payload bytes sent by the busiest trainer process (0 when not measured)."""
        return max(self.payload_bytes.values(), default=0) or max(self.sent_bytes.values(), default=0)

    @property
    def gb_per_s(self) -> float:
        """Payload rate (GB/s, 1e9 bytes), all pairs together."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"{self.tensors} tensor(s), {self.bytes / 1e6:.1f} MB in {self.buckets} bucket(s) to "
                f"{self.receivers} receiver(s) from {self.lanes} sender(s), {self.seconds:.3f}s "
                f"({self.gb_per_s:.2f} GB/s, {self.backend}, {self.path}"
                + (f", busiest sender {self.busiest_sent / 1e6:.1f} MB" if self.payload_bytes else "") + ")")


def bytes_written() -> int:
    """Bytes this process has written so far (``wchar`` of ``/proc/self/io``; 0 where not reported)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def dtype_of(name: str) -> Any:
    """The torch dtype named ``name`` ('float32' or 'torch.float32')."""
    import torch

    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r}")
    return dt


def node_ip() -> str:
    """The address this node's endpoints listen on: Ray's node address, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # ray is a dependency; stay usable without it
        pass
    return "127.0.0.1"


class Endpoint:
    """A trainer rank's store for one channel: receivers' pairs rendezvous on it (one prefix each)."""

    def __init__(self, store: Any, address: tuple[str, int], timeout_s: float):
        self.store, self.address, self.timeout_s = store, address, timeout_s

    @classmethod
    def host(cls, timeout_s: float = DEFAULT_TIMEOUT_S, host_ip: str | None = None) -> Endpoint:
        """Start the store on a free port of this node (bound to loopback on a loopback-only node)."""
        import torch.distributed as dist

        ip = host_ip or node_ip()
        common = dict(is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        if not is_loopback(ip):
            store = dist.TCPStore(ip, 0, **common)
            return cls(store, (ip, int(store.port)), timeout_s)
        # torch's store server binds every interface for the address it is given: bind here.
        listener = loopback_listener(ip, 0, 64)
        port = listener.getsockname()[1]
        store = dist.TCPStore(ip, port, master_listen_fd=listener.fileno(), **common)
        listener.detach()  # the store owns the socket now
        return cls(store, (ip, port), timeout_s)

    @classmethod
    def connect(cls, addr: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> Endpoint:
        """A client of another process's endpoint (a receiver's view of a sender's store)."""
        import torch.distributed as dist

        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, (addr, int(port)), timeout_s)

    def generation(self, key: str, bump: int = 0) -> int:
        """The generation of pair ``key`` (``bump``: a broken pair moves it on, so both ends rebuild)."""
        return int(self.store.add(f"gen/{key}", bump))

    def close(self) -> None:
        """Drop the store (a hosted one stops serving when the last reference goes)."""
        self.store = None


class Pair:
    """One trainer rank <-> one receiver: a two-rank process group (sender 0, receiver 1)."""

    def __init__(self, endpoint: Endpoint, key: str, rank: int, backend: str, timeout_s: float,
                 attempt: str = ""):
        import torch
        import torch.distributed as dist

        self.endpoint, self.key, self.rank, self.backend = endpoint, key, rank, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.peer_wait = self.timeout  # a sync's first wait (the peer's gang may be busy): bounded alike
        self.gen = endpoint.generation(key)
        store = dist.PrefixStore(f"pair/{key}/{self.gen}/{attempt}", endpoint.store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, 2, self.timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"weight sync: backend must be 'gloo' or 'nccl', got {backend!r}")
        self.broken = False

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def send(self, tensor: Any) -> Any:
        """Post a send of ``tensor`` to the peer; returns the work."""
        return self.pg.send([tensor], self.peer, 0)

    def recv(self, tensor: Any) -> Any:
        """Post a receive into ``tensor`` from the peer; returns the work."""
        return self.pg.recv([tensor], self.peer, 0)

    def send_header(self, header: dict, first: bool = False) -> None:
        """Send a small JSON header (``first``: the sync's first step, bounded by ``peer_wait``)."""
        import torch

        data = json.dumps(header).encode()
        head = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.send(head).wait(self.peer_wait if first else self.timeout)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        self.send(body).wait(self.timeout)

    def post_header(self, header: dict) -> list:
        """Post a header's sends without waiting: [(work, buffer), ...] (see :func:`wait_all`)."""
        import torch

        data = json.dumps(header).encode()
        head = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        return [(self.send(head), head), (self.send(body), body)]

    def recv_header(self, first: bool = True) -> dict:
        """Receive a header; raises :class:`SourceFailed` when the sender reported an error."""
        import torch

        head = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.recv(head).wait(self.peer_wait if first else self.timeout)
        body = torch.empty(int(head.item()), dtype=torch.uint8, device=self.device)
        self.recv(body).wait(self.timeout)
        return json.loads(bytes(body.cpu().numpy()).decode())

    def healthy(self) -> bool:
        """Whether both ends may still use this pair (not broken, generation unchanged)."""
        if self.broken or self.pg is None:
            return False
        try:
            return self.endpoint.generation(self.key) == self.gen
        except Exception:  # the sender's store is gone: so is the pair
            return False

    def close(self, broken: bool = False) -> None:
        """Leave the pair. ``broken``: it failed here; tell the peer's next join to rebuild it."""
        pg, self.pg = self.pg, None
        if broken and not self.broken:
            self.broken = True
            try:
                self.endpoint.generation(self.key, 1)
            except Exception:  # the store went with its host: nothing to rebuild with it
                logger.debug("weight sync: could not mark pair %s broken", self.key, exc_info=True)
        if pg is not None:
            try:
                # broken: abort, which closes its connections now (a shut-down group whose posted
                # works are still referenced, e.g. from a raised error's frames, keeps them open
                # and the peer's receive waits on)
                if broken:
                    pg.abort()
                else:
                    pg.shutdown()
            except Exception:  # already broken: dropping it is enough
                logger.debug("weight sync: pair %s shutdown failed", self.key, exc_info=True)


# ------------------------------------------------------------------------------ opening a pair
def _hello(endpoint: Endpoint, key: str, gen: int, side: str, attempt: str) -> Any:
    import torch.distributed as dist

    return dist.PrefixStore(f"hello/{key}/{gen}/{attempt}/{side}", endpoint.store)


def open_pair(endpoint: Endpoint, key: str, rank: int, backend: str, timeout_s: float,
              attempt: str = "") -> Pair:
    """Open pair ``key`` at ``rank`` (0 sender, 1 receiver): say hello, wait for the peer's hello (a
    refusal raises :class:`SetupRefused` at once), then build the two-rank group. Every process
    opens its pairs in one global order (sender rank, receiver id), so no two wait on each other.
    ``attempt`` (the set-up's own id, ``plan['attempt']``) keeps a hello or refusal of an earlier
    set-up from being read by this one."""
    gen = endpoint.generation(key)
    _hello(endpoint, key, gen, str(rank), attempt).set("hello", "ok")
    peer = _hello(endpoint, key, gen, str(1 - rank), attempt)
    peer.wait(["hello"], timedelta(seconds=timeout_s))
    said = peer.get("hello").decode()
    if said != "ok":
        raise SetupRefused(f"weight sync: the other end of pair {key} failed at set-up: {said}")
    return Pair(endpoint, key, rank, backend, timeout_s, attempt)


def refuse_pair(endpoint: Endpoint, key: str, rank: int, message: str, attempt: str = "") -> None:
    """Tell the peer of pair ``key`` (waiting in :func:`open_pair` of set-up ``attempt``) that this
    end failed (best effort)."""
    try:
        _hello(endpoint, key, endpoint.generation(key), str(rank), attempt).set("hello", message)
    except Exception:  # the store's host is gone: nobody waits on it
        logger.debug("weight sync: could not refuse pair %s", key, exc_info=True)


def pair_order(key: str) -> tuple[int, str]:
    """The global order pairs are opened in: (sender rank, receiver id)."""
    rank, uid = key.split("-", 1)
    return int(rank), uid


VLLM_NCCL = "vllm_nccl"  # a receiver's probe 'transfer': it takes weights only through vLLM's NCCL engine


def choose_backend(backend: str | None, source: list[dict], targets: list[list[dict]]) -> str:
    """``backend`` if given, else ``nccl`` when every end has CUDA, ``gloo`` otherwise.

    >>> choose_backend(None, [{"cuda": True}], [[{"cuda": False}]])
    'gloo'
    """
    if backend is not None:
        return backend
    ends = [*source, *[x for gang in targets for x in gang]]
    return "nccl" if ends and all(x.get("cuda") for x in ends) else "gloo"


def wait_all(works: dict, limit_s: float) -> dict:
    """Wait for every pair's posted works (``works``: key -> [(work, buffer), ...]), all within
    ``limit_s`` together. Returns {key: error} of the pairs that failed (their peer failed, left or
    died) or were not done in time; the others are done. Each work is waited on in turn (gloo's
    ``is_completed()`` of a send stays False until it is: polling it never ends), each bounded by
    what is left of ``limit_s``: a failed peer costs its own pairs, never the others' syncs."""
    import time
    from datetime import timedelta

    deadline = time.monotonic() + limit_s
    failed: dict = {}
    for key, items in works.items():
        for w, _ in items:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError("deadline passed")
                w.wait(timedelta(seconds=left))
            except Exception as error:
                failed[key] = error if time.monotonic() < deadline else TimeoutError(
                    f"weight sync: pair {key} did not take the sync within {limit_s:g}s")
                break
    return failed
