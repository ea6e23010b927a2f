"""A receiving process's side of a channel: its pairs, the assembly of what it keeps, and loading it.

A :class:`ReceiverEnd` lives in every receiving process (a sampler worker, or each vLLM worker
when a sampler fans the sync out to its engine). It joins one pair per trainer rank the plan names
for it, takes each sync from all of them at once, assembles every tensor it keeps (its full tensor,
or its own rows) from the pieces, and hands complete tensors to ``consume`` as they are ready. A
sync is taken whole or not at all when a sender failed before sending: nothing is handed on, the
other pairs are drained, and the sender's error is raised.

>>> end = ReceiverEnd(lambda buckets: None)
>>> end.call("ready", "ws-1")
False
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .layout import is_dtensor
from .plan import buckets
from .sender import piece_view
from .transport import (
    Endpoint,
    Pair,
    SourceFailed,
    bytes_written,
    dtype_of,
    node_ip,
    open_pair,
    pair_order,
    peer_failed,
    refuse_pair,
)

logger = logging.getLogger(__name__)

__all__ = ["ReceiverEnd", "endpoint_of", "load_into", "refuse_receivers"]


class _Channel:
    """One channel as a receiver holds it: the plan's part for it, and its pairs."""

    def __init__(self, wants: list, pieces: dict[str, list], pairs: dict[str, Pair], taken: dict | None = None):
        self.wants, self.pieces, self.pairs = wants, pieces, pairs
        # pair -> syncs taken whole since its sender's record started (-1: one was not; see recv)
        self.taken: dict[str, int] = {k: v for k, v in (taken or {}).items() if k in pairs}


class ReceiverEnd:
    """One receiving process's channels, and what it does with each sync (``consume``).

    ``consume(buckets)`` is called once per sync with an iterator over lists of (name, tensor):
    each tensor complete, full or this receiver's rows. ``index`` tells this end apart from other
    receivers of the same worker (a vLLM engine's worker rank); ``uid`` is new in every process.
    """

    OPS = ("probe", "join", "ready", "recv", "close")

    def __init__(self, consume: Callable[[Iterator[list[tuple[str, Any]]]], Any], index: int = 0,
                 wants: Callable[[], list | None] | None = None):
        self.consume = consume
        self.index = int(index)
        self.wants = wants or (lambda: None)
        self.uid = uuid.uuid4().hex[:12]
        self.channels: dict[str, _Channel] = {}
        self.stores: dict[tuple[str, int], Endpoint] = {}  # sender endpoint clients, shared by channels
        self.opened = 0

    def call(self, op: str, *args: Any) -> Any:
        """Run receiving-end operation ``op`` (what a sampler's fan-out hook forwards)."""
        if op not in self.OPS:
            raise ValueError(f"weight sync: unknown receiver operation {op!r} (one of {self.OPS})")
        return getattr(self, op)(*args)

    def probe(self) -> dict:
        """Facts for the plan: {'cuda', 'ip', 'index', 'uid', 'wants'} (wants None: everything, whole)."""
        import torch

        wants = self.wants()
        return {"cuda": bool(torch.cuda.is_available()), "ip": node_ip(), "index": self.index, "uid": self.uid,
                "wants": None if wants is None else [w.meta() if hasattr(w, "meta") else list(w) for w in wants]}

    def _store(self, addr: str, port: int, timeout_s: float) -> Endpoint:
        key = (addr, int(port))
        if key not in self.stores:
            self.stores[key] = Endpoint.connect(addr, port, timeout_s)
        return self.stores[key]

    def join(self, channel: str, setup: dict) -> int:
        """Join ``channel`` as ``setup`` (the plan, the backend, the timeout) says: keep healthy pairs,
        open new ones in the global order, close the rest. Returns how many pairs it opened now."""
        plan, backend, timeout_s = setup["plan"], setup["backend"], float(setup["timeout_s"])
        mine = plan["receivers"].get(self.uid)
        if mine is None and "rank" in setup:  # a receiver the sampler probed for (a vLLM worker): by its slot
            slot = [setup.get("gang", 0), setup["rank"], self.index]
            for uid, r in plan["receivers"].items():
                if list(r["slot"]) == slot:
                    self.uid, mine = uid, r
        if mine is None:
            raise RuntimeError(f"weight sync channel {channel!r}: the plan has no place for receiver {self.uid} "
                               f"(index {self.index}); was it rebuilt after the plan was made?")
        old = self.channels.pop(channel, None)
        pairs = dict(old.pairs) if old is not None else {}
        keys = sorted(mine["pairs"], key=pair_order)
        for key in [k for k in pairs if k not in keys]:
            pairs.pop(key).close()
        opened = 0
        try:
            for i, key in enumerate(keys):
                pair = pairs.get(key)
                if pair is not None and pair.healthy():
                    continue
                if pair is not None:
                    pairs.pop(key).close()
                addr, port = endpoint_of(plan, plan["pairs"][key]["sender"])
                store = self._store(addr, port, timeout_s)
                try:
                    pairs[key] = open_pair(store, key, 1, backend, timeout_s, plan.get("attempt", ""))
                except BaseException as e:
                    self.refuse(channel, setup, f"receiver {self.uid}: {type(e).__name__}: {e}", keys[i + 1:])
                    raise
                opened += 1
        except BaseException:
            for pair in pairs.values():  # broken: their senders rebuild them at the next set-up
                pair.close(broken=True)
            raise
        self.opened += opened
        kept = {} if old is None else {k: n for k, n in old.taken.items()  # pairs kept with the same pieces
                                       if k in old.pairs and pairs.get(k) is old.pairs[k]
                                       and old.pieces.get(k) == plan["pairs"][k]["pieces"]}
        self.channels[channel] = _Channel(mine["wants"], {k: plan["pairs"][k]["pieces"] for k in keys}, pairs, kept)
        return opened

    def refuse(self, channel: str, setup: dict, message: str, keys: list[str] | None = None) -> None:
        """This end failed before joining: tell the trainer ranks waiting for its hello (best effort)."""
        plan = setup["plan"]
        mine = plan["receivers"].get(self.uid, {"pairs": []})
        for key in keys if keys is not None else mine["pairs"]:
            addr, port = endpoint_of(plan, plan["pairs"][key]["sender"])
            try:
                refuse_pair(self._store(addr, port, 10.0), key, 1, message, plan.get("attempt", ""))
            except Exception:  # that trainer rank is gone too
                logger.debug("weight sync: could not refuse %s", key, exc_info=True)

    def ready(self, channel: str) -> bool:
        """Whether this end holds ``channel`` with every planned pair open."""
        ch = self.channels.get(channel)
        return ch is not None and all(p.pg is not None for p in ch.pairs.values())

    def counts(self, channel: str) -> dict:
        """Pairs this end holds in ``channel``, and how many it opened over its life."""
        ch = self.channels.get(channel)
        return {"uid": self.uid, "pairs": len(ch.pairs) if ch else 0, "opened": self.opened}

    def recv(self, channel: str) -> dict:
        """Take one sync from every pair into ``consume``; returns its figures (a plain dict)."""
        ch = self.channels.get(channel)
        if ch is None or not self.ready(channel):
            raise RuntimeError(f"weight sync channel {channel!r} is not set up in this receiver (was the gang "
                               f"restarted?); WeightSync sets it up again on the next sync")
        w0 = bytes_written()
        start = time.perf_counter()
        error: BaseException | None = None
        lanes = []
        data: list[tuple[str, int, bool]] = []  # (pair, its sender's base, all its pieces?) of those that sent
        for key in sorted(ch.pairs, key=pair_order):
            pair = ch.pairs[key]
            try:
                head = pair.recv_header(first=True)
            except BaseException as e:  # the sender is gone: so is this pair
                error = error or peer_failed(key, e)
                pair.close(broken=True)
                continue
            if "error" in head:
                error = error or SourceFailed(f"weight sync: the source failed: {head['error']}")
                continue
            base = int(head.get("base", 0))
            if head.get("only_changed") and base and ch.taken.get(key, 0) != base:
                # the sender's record says this end holds what an earlier sync sent, but this end did
                # not take that sync whole: what changed since cannot be known here. Drained, not loaded.
                error = error or RuntimeError(
                    f"weight sync: receiver {self.uid} (index {self.index}) did not take an earlier sync on pair "
                    f"{key} whole, so an only_changed sync cannot know what it lacks; nothing of this sync "
                    f"was loaded, the next sync sends everything")
            data.append((key, base, bool(head.get("full"))))
            lanes.append((pair, ch.pieces[key], buckets(ch.pieces[key], head["pieces"], head["bucket_bytes"])))
        got = {"bytes": 0, "buckets": 0, "tensors": 0}
        stream = _assemble(ch.wants, lanes, got)
        try:
            if error is None:
                self.consume(stream)
        except BaseException as e:  # re-raised once the sync is drained: the senders must not hang
            error = error or e
        try:
            for _ in stream:  # drain what consume left (nothing when it took everything)
                pass
        except BaseException as e:
            error = error or e
        for key, base, full in data:  # in step with each sender's record: its count; else -1 (a sync
            # it recorded was not taken whole here) until a fresh record (base 0) or a full sync
            in_step = base == 0 or full or ch.taken.get(key, 0) == base
            ch.taken[key] = base + 1 if error is None and in_step else -1
        if error is not None:
            raise error
        return {"tensors": got["tensors"], "bytes": got["bytes"], "buckets": got["buckets"],
                "seconds": time.perf_counter() - start, "receivers": 1, "lanes": len(lanes),
                "sent_bytes": {f"receiver {self.index}": bytes_written() - w0}}

    def close(self, channel: str, broken: bool = False) -> None:
        """Leave ``channel`` (nothing when not joined). ``broken``: its pairs are out of step (a
        failed sync): each sender rebuilds them at the next set-up, not only this end."""
        ch = self.channels.pop(channel, None)
        for pair in (ch.pairs.values() if ch else ()):
            pair.close(broken=broken)
        if not self.channels:
            self.stores.clear()


def _assemble(wants: list, lanes: list, got: dict) -> Iterator[list[tuple[str, Any]]]:
    """Every lane's buckets, round robin (the next receive posted before a bucket is handled), copied
    into each wanted tensor; yields the tensors each bucket completed."""
    import torch

    expected: dict[int, int] = {}
    for _, pieces, bl in lanes:
        for b in bl:
            for i in b:
                expected[pieces[i][0]] = expected.get(pieces[i][0], 0) + 1
    total = {}
    for _, pieces, _ in lanes:
        for p in pieces:
            total[p[0]] = total.get(p[0], 0) + 1
    partial = [wants[k][0] for k, n in expected.items() if n != total[k]]
    if partial:
        raise RuntimeError(f"weight sync: only part of {partial[:3]} came (the senders disagree on what "
                           f"changed); the next full sync repairs it")
    arrived: dict[int, int] = {}
    out: dict[int, Any] = {}
    live = []
    for pair, pieces, bl in lanes:
        if bl:
            live.append([pair, pieces, bl, _post(pair, pieces, bl[0])])
    while live:
        still = []
        for lane in live:
            pair, pieces, bl, (work, buf) = lane
            bucket = bl.pop(0)
            if bl:
                lane[3] = _post(pair, pieces, bl[0])
                still.append(lane)
            try:
                work.wait(pair.timeout)
            except BaseException as e:
                pair.close(broken=True)
                failed = peer_failed(pair.key, e)
                raise failed from (None if failed is e else e)  # never e as its own cause
            got["bytes"] += buf.numel() * buf.element_size()
            got["buckets"] += 1
            done, offset = [], 0
            for i in bucket:
                k, _, _, dst, n, _ = pieces[i]
                name, _, full, wd, _, wl = wants[k]
                shape = [wl if d == wd else s for d, s in enumerate(full)]
                part = buf[offset:offset + n]
                offset += n
                if expected[k] == 1:
                    out[k] = part.view(shape)  # the whole tensor in one piece: a view of the bucket, no copy
                else:
                    if k not in out:
                        out[k] = torch.empty(shape, dtype=buf.dtype, device=buf.device)
                    box = piece_view(out[k], dst)
                    box.copy_(part.view(box.shape))
                arrived[k] = arrived.get(k, 0) + 1
                if arrived[k] == expected[k]:
                    done.append((name, out.pop(k)))
            got["tensors"] += len(done)
            if done:
                yield done
        live = still


def _post(pair: Pair, pieces: list, bucket: list[int]) -> tuple[Any, Any]:
    import torch

    buf = torch.empty(sum(pieces[i][4] for i in bucket), dtype=dtype_of(pieces[bucket[0]][5]), device=pair.device)
    return pair.recv(buf), buf


def _local_part(target: Any, value: Any) -> Any:
    """``value`` (full, or already this rank's rows) fitted to the DTensor ``target``'s local shard."""
    local = target.to_local()
    if tuple(value.shape) == tuple(local.shape):
        return value
    from torch.distributed.tensor import distribute_tensor

    full = value.to(device=target.device, dtype=target.dtype)
    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()


def load_into(targets: Any, items: list[tuple[str, Any]]) -> list[str]:
    """Copy received (name, tensor) pairs into ``targets`` in place; returns what did not fit.

    ``targets``: a dict name -> tensor (a model's own parameters and buffers), or a callable taking
    ``items`` (returns ``[]``). A tensor may be full or the receiver's own rows (its target's shape);
    a DTensor target takes its local shard.

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
            elif is_dtensor(target):
                target.to_local().copy_(_local_part(target, value))
            elif tuple(target.shape) != tuple(value.shape):
                problems.append(f"{name!r}: shape {tuple(value.shape)} sent, {tuple(target.shape)} here")
            else:
                target.copy_(value)
    return problems


def endpoint_of(plan: dict, sender: Any) -> tuple[str, int]:
    """(addr, port) of trainer rank ``sender``'s endpoint (keys are ints, or strings after JSON)."""
    eps = plan["endpoints"]
    addr, port = eps[sender] if sender in eps else eps[str(sender)]
    return str(addr), int(port)


def refuse_receivers(setup: dict, gang: int, rank: int, message: str) -> None:
    """A sampler worker failed before its receivers joined: tell their trainer ranks (best effort)."""
    plan = setup["plan"]
    for r in plan["receivers"].values():
        if list(r["slot"][:2]) != [gang, rank]:
            continue
        for key in r["pairs"]:
            try:
                addr, port = endpoint_of(plan, plan["pairs"][key]["sender"])
                refuse_pair(Endpoint.connect(addr, port, 10.0), key, 1, message, plan.get("attempt", ""))
            except Exception:  # that trainer rank is gone too
                logger.debug("weight sync: could not refuse %s", key, exc_info=True)
