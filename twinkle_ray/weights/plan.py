"""The transfer plan: which trainer rank sends which rows of which tensor to which receiver.

Computed once per (trainer layout, receivers' layouts, parameter set) from the ends' metadata
(:class:`~twinkle_ray.weights.layout.Slab`, :class:`~twinkle_ray.weights.layout.Want`) and replayed
every sync; a receiver rebuilt with the same layout only binds its new id to the cached assignment.

- Each receiver takes every tensor it wants from one data-parallel *replica* of the trainer (the
  ranks that together hold one copy): receiver ``i`` from replica ``i % R``, so R replicas share the
  receivers; when the receivers do not divide evenly, tensors rotate over the replicas.
- Inside the replica each rank sends only the rows it holds that the receiver keeps (the
  intersection of its slab and the want): no gather, nothing sent twice, and a tensor-parallel
  receiver gets only its own rows. A fused slab (Megatron QKV, gate/up) is several slabs.

A *piece* is ``[want index, slab index, source box, destination box, numel, dtype]``; a box lists
``[dim, start, length]`` in the local coordinates of the slab (source) or of the want (destination).

>>> src = [{"rank": 0, "replica": 0, "addr": "127.0.0.1", "port": 1, "slabs": [["w", "float32", [4, 2], 0, 0, 2]]},
...        {"rank": 1, "replica": 0, "addr": "127.0.0.1", "port": 2, "slabs": [["w", "float32", [4, 2], 0, 2, 2]]}]
>>> p = build_plan(src, [[{"rank": 0, "index": 0, "uid": "u", "wants": None}]])
>>> [(k, [x[2:] for x in v["pieces"]]) for k, v in sorted(p["pairs"].items())]
[('0-u', [[[[0, 0, 2]], [[0, 0, 2]], 4, 'float32']]), ('1-u', [[[[0, 0, 2]], [[0, 2, 2]], 4, 'float32']])]
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["assign", "build_plan", "buckets", "layout_key", "numel"]


def numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def layout_key(sources: list[dict], slots: list[tuple]) -> str:
    """A short digest of what decides the assignment: every slab, replica and want (not the ids)."""
    data = json.dumps([[(s["rank"], s["replica"], s["slabs"]) for s in sources], slots], sort_keys=True)
    return hashlib.sha1(data.encode()).hexdigest()[:16]


def _intersect(slab: list, want: list) -> list | None:
    """(source box, destination box, numel) of the rows of ``slab`` that ``want`` keeps, or None."""
    _, _, full, sd, s0, sl = slab
    _, _, _, wd, w0, wl = want
    if not full:  # a scalar: whole or nothing
        return [[], [], 1]
    ranges = {sd: (s0, s0 + sl)}
    lo, hi = ranges.get(wd, (0, full[wd]))
    ranges[wd] = (max(lo, w0), min(hi, w0 + wl))
    if any(b <= a for a, b in ranges.values()):
        return None
    src = [[d, a - (s0 if d == sd else 0), b - a] for d, (a, b) in sorted(ranges.items())]
    dst = [[d, a - (w0 if d == wd else 0), b - a] for d, (a, b) in sorted(ranges.items())]
    shape = list(full)
    for d, (a, b) in ranges.items():
        shape[d] = b - a
    return [src, dst, numel(shape)]


def _wants_of(sources: list[dict], wants: list | None) -> list[list]:
    """A receiver's wants; None: every tensor the trainer holds, whole, in first-seen order."""
    if wants is not None:
        return [list(w) for w in wants]
    seen: dict[str, list] = {}
    for s in sorted(sources, key=lambda s: s["rank"]):
        for name, dtype, full, *_ in s["slabs"]:
            seen.setdefault(name, [name, dtype, list(full), 0, 0, int(full[0]) if full else 1])
    return list(seen.values())


def _one_of_each(slabs: list, turn: int) -> list:
    """One holder per distinct region (a tensor replicated over tensor-parallel ranks, e.g. a norm,
    is held by each): the holders take turns over receivers and tensors."""
    regions: dict[tuple, list] = {}
    for rank, si, slab in slabs:
        regions.setdefault((slab[3], slab[4], slab[5]), []).append((rank, si, slab))
    return [same[turn % len(same)] for same in regions.values()]


def assign(sources: list[dict], slots: list[tuple]) -> list[dict]:
    """Per receiver slot ((gang, rank, index), wants): its wants and, per sender rank, its pieces."""
    holders: dict[str, dict[int, list[tuple[int, int, list]]]] = {}  # name -> replica -> (rank, slab i, slab)
    for s in sources:
        for i, slab in enumerate(s["slabs"]):
            holders.setdefault(slab[0], {}).setdefault(int(s["replica"]), []).append((int(s["rank"]), i, slab))
    replicas = sorted({int(s["replica"]) for s in sources if s["slabs"]})
    out = []
    for i, (slot, wants) in enumerate(slots):
        wants = _wants_of(sources, wants)
        per_rank: dict[int, list] = {}
        for k, want in enumerate(wants):
            name = want[0]
            cands = sorted(holders.get(name, {}))
            if not cands:
                raise ValueError(f"weight sync: receiver {slot} wants {name!r}, which no trainer rank holds")
            even = len(cands) == len(replicas) and len(slots) % len(cands) == 0
            replica = cands[i % len(cands)] if even else cands[(i + k) % len(cands)]
            got = 0
            for rank, si, slab in _one_of_each(holders[name][replica], i + k):
                hit = _intersect(slab, want)
                if hit is not None:
                    per_rank.setdefault(rank, []).append([k, si, *hit, slab[1]])
                    got += hit[2]
            need = numel([want[5] if d == want[3] else n for d, n in enumerate(want[2])]) if want[2] else 1
            if got != need:
                raise ValueError(f"weight sync: trainer replica {replica} holds {got} of the {need} elements of "
                                 f"{name!r} that receiver {slot} keeps (slabs missing or overlapping)")
        out.append({"slot": list(slot), "wants": wants, "pieces": per_rank})
    return out


def build_plan(sources: list[dict], receivers: list[list[dict]], cache: dict | None = None) -> dict:
    """The plan for trainer ``sources`` (one dict per rank) and each target gang's receivers.

    ``cache``: a dict the caller keeps (the trainer's rank 0): the assignment is reused for the
    same layouts, only receiver ids are bound again.
    """
    slots = sorted(((g, int(r["rank"]), int(r["index"])), r["wants"], r["uid"])
                   for g, gang in enumerate(receivers) for r in gang)
    key = layout_key(sources, [(s, w) for s, w, _ in slots])
    cached = cache is not None and cache.get("key") == key
    assignment = cache["assignment"] if cached else assign(sources, [(s, w) for s, w, _ in slots])
    if cache is not None and not cached:
        cache.clear()
        cache.update(key=key, assignment=assignment)
    pairs: dict[str, dict] = {}
    recv: dict[str, dict] = {}
    senders: dict[int, list[str]] = {int(s["rank"]): [] for s in sources}
    for (slot, _, uid), a in zip(slots, assignment, strict=True):
        mine = []
        for rank, pieces in sorted(a["pieces"].items()):
            pk = f"{rank}-{uid}"
            pairs[pk] = {"sender": int(rank), "receiver": uid, "pieces": pieces}
            senders[int(rank)].append(pk)
            mine.append(pk)
        recv[uid] = {"slot": list(slot), "wants": a["wants"], "pairs": mine}
    return {"key": key, "replayed": cached, "pairs": pairs, "receivers": recv, "senders": senders,
            "endpoints": {int(s["rank"]): [s["addr"], int(s["port"])] for s in sources}}


def buckets(pieces: list, selected: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of the selected pieces in runs of one dtype and at most ``bucket_bytes`` each."""
    from .transport import dtype_of

    out: list[list[int]] = []
    size, dtype = 0, None
    for i in selected:
        n = pieces[i][4] * dtype_of(pieces[i][5]).itemsize
        if not out or pieces[i][5] != dtype or size + n > bucket_bytes:
            out.append([])
            size, dtype = 0, pieces[i][5]
        out[-1].append(i)
        size += n
    return out
