"""A trainer rank's side of a channel: its endpoint, its pairs, and one sync's sends.

The plan (:mod:`~twinkle_ray.weights.plan`) gives this rank, per pair, the pieces it sends (rows of
its own slabs); a sync replays it: a header per pair (which pieces, or an error), then the buckets,
round robin over the pairs so every receiver is served at once. A bucket of one contiguous piece
goes out as a view of the weights (no copy); others are packed into one flat tensor. One failed pair
(its receiver died) is closed and the others go on; the error is raised at the end.

>>> # end = SourceEnd("ws-1", timeout_s=60); end.join(plan, rank=0, backend="gloo")
>>> # figures = end.send(slabs, selected={"*"}, changed=None, bucket_bytes=32 << 20)
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .plan import buckets
from .transport import (
    Endpoint,
    Pair,
    open_pair,
    pair_order,
    peer_failed,
    refuse_pair,
    wait_all,
)

logger = logging.getLogger(__name__)

__all__ = ["SourceEnd", "piece_view"]


def piece_view(tensor: Any, box: list) -> Any:
    """The rows ``box`` ([[dim, start, length], ...]) of ``tensor``, as a view."""
    for d, a, n in box:
        tensor = tensor.narrow(d, a, n)
    return tensor


class SourceEnd:
    """One trainer rank's end of a channel (hosted once; pairs added and dropped as receivers come and go)."""

    def __init__(self, channel: str, timeout_s: float):
        self.channel, self.timeout_s = channel, timeout_s
        self.endpoint = Endpoint.host(timeout_s)
        self.pairs: dict[str, Pair] = {}
        self.pieces: dict[str, list] = {}  # pair -> its pieces (this rank's part of the plan)
        self.receiver_of: dict[str, str] = {}  # pair -> receiver id
        # pair -> slab index -> fingerprint of what that pair's receiver last got of the slab (kept
        # while only_changed is tracked; a pair opened, rebuilt or replanned starts empty)
        self.sent: dict[str, dict[int, str]] = {}
        # pair -> syncs its receiver took whole since that record started (sent in each header as
        # 'base': a receiver whose own count differs did not take what the record says it holds)
        self.taken: dict[str, int] = {}
        self.backend = ""
        self.opened = 0  # pairs opened over this end's life (a diagnostic: what a rejoin rebuilt)
        self.syncs = 0

    def join(self, plan: dict, rank: int, backend: str) -> list[str]:
        """Bring this rank's pairs in line with ``plan``: keep the healthy ones, close those no longer
        planned, open the new ones (in the global order). Returns this rank's pair keys."""
        mine = sorted(plan["senders"].get(rank, []), key=pair_order)
        self.backend = backend
        for key in [k for k in self.pairs if k not in mine]:
            self.pairs.pop(key).close()
            self.receiver_of.pop(key, None)
        for key in list(self.sent) + list(self.taken):  # a pair gone, or with other pieces now: its
            if key not in mine or self.pieces.get(key) != plan["pairs"][key]["pieces"]:  # record is void
                self.forget(key)
        try:
            for i, key in enumerate(mine):
                pair = self.pairs.get(key)
                if pair is not None and pair.healthy():
                    continue
                if pair is not None:
                    pair.close()
                self.pairs.pop(key, None)
                self.forget(key)
                try:
                    self.pairs[key] = open_pair(self.endpoint, key, 0, backend, self.timeout_s,
                                                plan.get("attempt", ""))
                except BaseException as e:
                    for later in mine[i + 1:]:  # their receivers wait for this rank's hello
                        if later not in self.pairs:
                            refuse_pair(self.endpoint, later, 0, f"trainer rank {rank}: {type(e).__name__}: {e}",
                                        plan.get("attempt", ""))
                    raise
                self.opened += 1
        finally:
            self.pieces = {k: plan["pairs"][k]["pieces"] for k in mine}
            self.receiver_of = {k: plan["pairs"][k]["receiver"] for k in mine}
        return mine

    def forget(self, key: str | None = None) -> None:
        """Drop the record of what pair ``key``'s receiver holds (None: every pair's): it gets
        everything asked for next."""
        for book in (self.sent, self.taken):
            if key is None:
                book.clear()
            else:
                book.pop(key, None)

    def refuse(self, plan: dict, rank: int, message: str) -> None:
        """This rank failed before joining: tell the receivers waiting for its hello."""
        for key in plan["senders"].get(rank, []):
            if key not in self.pairs:
                refuse_pair(self.endpoint, key, 0, message, plan.get("attempt", ""))

    def fail(self, message: str) -> None:
        """End this sync with ``message`` on every receiver of this rank (the pairs stay in step)."""
        for key in sorted(self.pairs, key=pair_order):
            try:
                self.pairs[key].send_header({"error": message}, first=True)
            except Exception:  # that receiver is gone: its pair is
                self.pairs[key].close(broken=True)

    def stale(self, slabs: list, prints: list, names: set[str] | None) -> dict[str, set[str]]:
        """Per receiver id: the tensors (of ``names``; None: all) of which this rank sends it pieces
        whose slab differs from what that receiver last got (``prints``: this sync's fingerprint of
        each slab). A pair with no record (new, rebuilt, after a failed sync) gets everything."""
        out: dict[str, set[str]] = {}
        for key in self.pairs:
            last = self.sent.get(key, {})
            mine = out.setdefault(self.receiver_of[key], set())
            for p in self.pieces[key]:
                name = slabs[p[1]].name
                if (names is None or name in names) and last.get(p[1]) != prints[p[1]]:
                    mine.add(name)
        return out

    def send(self, slabs: list, names: set[str] | None, prints: list | None, chosen: dict | None,
             bucket_bytes: int) -> dict:
        """One sync: every pair's selected pieces. ``names``: only these tensors (None: all);
        ``chosen``: receiver id -> the tensors to send it (only_changed; None: all of ``names``);
        ``prints``: this sync's fingerprint of each slab (None: changes are not tracked), recorded
        per pair for the pieces it really sent. Returns this rank's figures."""
        import torch

        start = time.perf_counter()
        jobs, error, posted_headers = [], None, {}
        for key in sorted(self.pairs, key=pair_order):
            pieces, uid = self.pieces[key], self.receiver_of[key]
            want = None if chosen is None else chosen.get(uid, set())
            sel = [i for i, p in enumerate(pieces) if (names is None or slabs[p[1]].name in names)
                   and (want is None or slabs[p[1]].name in want)]
            try:
                posted_headers[key] = self.pairs[key].post_header(
                    {"seq": self.syncs, "pieces": sel, "bucket_bytes": bucket_bytes,
                     "base": self.taken.get(key, 0), "only_changed": chosen is not None,
                     "full": len(sel) == len(pieces)})
            except Exception as e:  # this receiver is gone
                error = error or peer_failed(key, e)
                self.pairs.pop(key).close(broken=True)
                continue
            jobs.append([key, pieces, buckets(pieces, sel, bucket_bytes), sel])
        # Every receiver reaches the sync in its own time (its gang may be busy): wait for all.
        # A receiver that failed, left or died costs only its own pairs: they are closed as broken
        # (rebuilt at the next set-up) and the sync raises once the others have had theirs (a
        # receiver that took its header waits for its buckets: leaving it would leave it stuck).
        for key, e in wait_all(posted_headers, self.timeout_s).items():
            error = error or peer_failed(key, e)
            self.pairs.pop(key).close(broken=True)
        total, nbuckets = 0, 0
        inflight: list = []
        with torch.no_grad():
            while any(job[2] for job in jobs):
                posted = []
                for job in jobs:
                    key, pieces, todo, _ = job
                    if key not in self.pairs:  # its receiver failed: nothing more goes to it
                        todo.clear()
                    if not todo:
                        continue
                    parts = [piece_view(slabs[pieces[i][1]].tensor, pieces[i][2]) for i in todo.pop(0)]
                    flat = (parts[0].reshape(-1) if len(parts) == 1 and parts[0].is_contiguous()
                            else torch.cat([p.reshape(-1) for p in parts]))
                    try:
                        posted.append((key, self.pairs[key].send(flat), flat))
                    except Exception as e:
                        error = error or peer_failed(key, e)
                        self.pairs.pop(key).close(broken=True)
                        continue
                    total += flat.numel() * flat.element_size()
                    nbuckets += 1
                for key, work, _ in inflight:  # the previous round; this one is in flight already
                    error = self._wait(key, work) or error
                inflight = posted
            for key, work, _ in inflight:
                error = self._wait(key, work) or error
        names_sent = set()
        for key, pieces, _, sel in jobs:
            if key in self.pairs:  # taken whole by its receiver's pair: what it holds now
                self.taken[key] = self.taken.get(key, 0) + 1
                last = self.sent.setdefault(key, {})
                for i in sel:
                    names_sent.add(slabs[pieces[i][1]].name)
                    if prints is not None:
                        last[pieces[i][1]] = prints[pieces[i][1]]
            else:  # broken under this sync: its receiver may hold part of it
                self.forget(key)
        self.syncs += 1
        if error is not None:
            raise error
        return {"bytes": total, "buckets": nbuckets, "seconds": time.perf_counter() - start,
                "names": sorted(names_sent), "receivers": len(jobs), "backend": self.backend}

    def _wait(self, key: str, work: Any) -> BaseException | None:
        from datetime import timedelta

        pair = self.pairs.get(key)
        if pair is None:
            return None
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as e:
            self.pairs.pop(key).close(broken=True)
            return peer_failed(key, e)
        return None

    def counts(self) -> dict:
        """What this end holds now: pairs, and how many it opened over its life."""
        return {"endpoints": 1, "pairs": len(self.pairs), "opened": self.opened,
                "pair_keys": sorted(self.pairs, key=pair_order)}

    def close(self) -> None:
        """Close every pair and the endpoint."""
        for pair in self.pairs.values():
            pair.close()
        self.pairs.clear()
        self.endpoint.close()
