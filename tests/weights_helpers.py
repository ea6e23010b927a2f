"""Shared set-up of the weight-sync tests: a reference model, trainer layouts (tp x pp x dp, Megatron-
style fused QKV and gate/up), full and tensor-parallel samplers, and bit-exact digests.

The reference model is a dict of tensors made from a version number (so any process can rebuild what
the trainer holds at that version). A :class:`LayoutTrainer` rank holds only its own rows: q/k/v of
each layer fused into one local ``qkv`` tensor (per TP rank: its q rows, then k, then v) and gate/up
fused into ``gate_up`` (both split by rows), ``down`` split by columns (row-parallel), the norm
replicated over TP, the embedding split by vocabulary rows; layers split over pipeline stages;
data-parallel replicas hold the same. A :class:`LayoutSampler` keeps full tensors (``tp=1``) or its
own rows of a tensor-parallel layout.
"""

from __future__ import annotations

import hashlib
import os

import torch

from twinkle_ray import get_rank, remote_class, remote_function
from twinkle_ray.weights import Slab, Want, WeightSyncMixin, fused_slabs

H, FF, VOCAB = 64, 128, 256  # small per-rank tensors: 8-rank gangs on 2 cores


def reference(version: float, layers: int = 4, hidden: int = H, ff: int = FF, vocab: int = VOCAB,
              ) -> dict[str, torch.Tensor]:
    """The full tensors at ``version`` (float32, deterministic)."""
    g = torch.Generator().manual_seed(int(version * 1000) + 7)
    out = {"embed.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        for n, shape in [("q.weight", (hidden, hidden)), ("k.weight", (hidden // 2, hidden)),
                         ("v.weight", (hidden // 2, hidden)), ("gate.weight", (ff, hidden)),
                         ("up.weight", (ff, hidden)), ("down.weight", (hidden, ff)), ("norm.weight", (hidden,))]:
            out[p + n] = torch.randn(*shape, generator=g)
    out["head.weight"] = torch.randn(vocab, hidden, generator=g)
    return out


def model_bytes(**kw) -> int:
    return sum(t.numel() * t.element_size() for t in reference(0.0, **kw).values())


def rows(t: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``t`` split ``n`` ways along ``dim`` (even splits)."""
    per = t.shape[dim] // n
    return t.narrow(dim, rank * per, per)


def coords(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """(pp, dp, tp) coordinates of a gang rank: dims outermost first pp, dp, tp."""
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def stage_layers(stage: int, pp: int, layers: int) -> range:
    per = layers // pp
    return range(stage * per, (stage + 1) * per)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


@remote_class()
class LayoutTrainer(WeightSyncMixin):
    """A trainer rank of a tp x pp x dp layout holding only its own rows (Megatron-style fused tensors)."""

    def __init__(self, device_mesh=None, tp: int = 1, pp: int = 1, dp: int = 1, layers: int = 4,
                 version: float = 1.0, scale: int = 1):
        self.tp, self.pp, self.dp, self.layers, self.scale = tp, pp, dp, layers, scale
        self.pp_rank, self.dp_rank, self.tp_rank = coords(get_rank(), tp, pp, dp)
        self.fail: str | None = None
        self._fill(version)

    def _fill(self, version: float) -> None:
        ref = reference(version, self.layers, H * self.scale, FF * self.scale, VOCAB * self.scale)
        self.version = version
        tp, r = self.tp, self.tp_rank
        local: dict[str, torch.Tensor] = {}
        self.blocks: dict[str, list] = {}
        for i in stage_layers(self.pp_rank, self.pp, self.layers):
            p = f"layers.{i}."
            parts = [(p + n, ref[p + n]) for n in ("q.weight", "k.weight", "v.weight")]
            local[p + "qkv"] = torch.cat([rows(t, 0, r, tp) for _, t in parts])
            self.blocks[p + "qkv"] = [(n, tuple(t.shape), r * (t.shape[0] // tp), t.shape[0] // tp) for n, t in parts]
            parts = [(p + n, ref[p + n]) for n in ("gate.weight", "up.weight")]
            local[p + "gate_up"] = torch.cat([rows(t, 0, r, tp) for _, t in parts])
            self.blocks[p + "gate_up"] = [(n, tuple(t.shape), r * (t.shape[0] // tp), t.shape[0] // tp)
                                          for n, t in parts]
            local[p + "down"] = rows(ref[p + "down.weight"], 1, r, tp).clone()
            local[p + "norm"] = ref[p + "norm.weight"].clone()
        if self.pp_rank == 0:
            local["embed"] = rows(ref["embed.weight"], 0, r, tp).clone()
        if self.pp_rank == self.pp - 1:
            local["head"] = rows(ref["head.weight"], 0, r, tp).clone()
        self.local, self.full_shapes = local, {n: tuple(t.shape) for n, t in ref.items()}

    @remote_function(dispatch="all")
    def set_version(self, version: float) -> None:
        self._fill(version)

    @remote_function(dispatch="all")
    def fail_next(self, what: str | None) -> None:
        self.fail = what

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    @remote_function(dispatch="all", collect="none")
    def open_fds(self) -> int:
        return len(os.listdir("/proc/self/fd"))

    def weight_sync_replica(self) -> int:
        return self.dp_rank

    def weight_sync_shards(self) -> list[Slab]:
        if self.fail == "shards":
            raise ValueError("no shards today")
        tp, r, out = self.tp, self.tp_rank, []
        for name, t in self.local.items():
            if name in self.blocks:
                out += fused_slabs(t, self.blocks[name])
            elif name.endswith("down"):
                full = self.full_shapes[name + ".weight"]
                out.append(Slab(name + ".weight", t, full, 1, r * (full[1] // tp)))
            elif name.endswith("norm"):
                out.append(Slab(name + ".weight", t))
            else:
                full = self.full_shapes[name + ".weight"]
                out.append(Slab(name + ".weight", t, full, 0, r * (full[0] // tp)))
        return out


@remote_class()
class LayoutSampler(WeightSyncMixin):
    """A sampler worker keeping the full model (``tp=1``) or its rows of a ``tp``-way layout (its gang
    rank is its TP rank): q/k/v/gate/up/embed/head by rows, down by columns, norms whole."""

    def __init__(self, device_mesh=None, tp: int = 1, layers: int = 4, scale: int = 1):
        self.tp, self.r = tp, get_rank() % tp
        ref = reference(0.0, layers, H * scale, FF * scale, VOCAB * scale)
        self.keep = {n: self._mine(n, t).clone().zero_() for n, t in ref.items()}
        self.full_shapes = {n: tuple(t.shape) for n, t in ref.items()}
        self.fail: str | None = None

    def _dim(self, name: str) -> int | None:
        if self.tp == 1 or name.endswith("norm.weight"):
            return None
        return 1 if name.endswith("down.weight") else 0

    def _mine(self, name: str, t: torch.Tensor) -> torch.Tensor:
        d = self._dim(name)
        return t if d is None else rows(t, d, self.r, self.tp)

    @remote_function(dispatch="all")
    def fail_next(self, what: str | None) -> None:
        self.fail = what

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    @remote_function(dispatch="all", collect="none")
    def digests(self) -> dict[str, str]:
        return {n: digest(t) for n, t in self.keep.items()}

    def weight_sync_wants(self) -> list[Want]:
        out = []
        for n, t in self.keep.items():
            d = self._dim(n)
            full = self.full_shapes[n]
            out.append(Want(n, full, "float32") if d is None else
                       Want(n, full, "float32", d, self.r * t.shape[d], t.shape[d]))
        return out

    def weight_sync_targets(self) -> dict[str, torch.Tensor]:
        return self.keep

    def weight_sync_fanout(self, op, *args):
        if op == "join" and self.fail == "join":
            raise RuntimeError(f"refused to join on rank {get_rank()}")
        if op == "recv" and self.fail == "load":
            raise ValueError("cannot load today")
        return super().weight_sync_fanout(op, *args)


def expected_digests(version: float, tp: int, rank: int, layers: int = 4, scale: int = 1) -> dict[str, str]:
    """What a LayoutSampler of ``tp`` at gang ``rank`` holds after a sync of ``version``."""
    out = {}
    for n, t in reference(version, layers, H * scale, FF * scale, VOCAB * scale).items():
        if tp == 1 or n.endswith("norm.weight"):
            out[n] = digest(t)
        else:
            out[n] = digest(rows(t, 1 if n.endswith("down.weight") else 0, rank % tp, tp))
    return out


# ------------------------------------------------------------------------------ in-process ends
class InProcess:
    """A trainer end and ``n`` receiver ends in this process (threads), joined by a plan: the transport
    without gangs. ``send(src, ...)`` runs one sync; each receiver's ``consume`` gets its buckets."""

    def __init__(self, src: dict, consumers: list, timeout_s: float = 20.0):
        import threading

        from twinkle_ray.weights import ReceiverEnd, Slab
        from twinkle_ray.weights.plan import build_plan
        from twinkle_ray.weights.sender import SourceEnd

        self.threading = threading
        self.source = SourceEnd("ws-t", timeout_s)
        self.slabs = [Slab(n, t) for n, t in src.items()]
        self.ends = [ReceiverEnd(c, index=0) for c in consumers]
        addr, port = self.source.endpoint.address
        sources = [{"rank": 0, "replica": 0, "addr": addr, "port": port, "slabs": [s.meta() for s in self.slabs]}]
        plan = build_plan(sources, [[{"rank": i, "index": 0, "uid": e.uid, "wants": None}]
                                    for i, e in enumerate(self.ends)])
        self.setup = {"plan": plan, "backend": "gloo", "timeout_s": timeout_s}
        self.both(lambda: self.source.join(plan, 0, "gloo"), [lambda e=e: e.join("ws-t", self.setup) for e in self.ends])

    def both(self, src_fn, recv_fns):
        """Run the trainer end and the receivers concurrently: (source result, receiver results/errors)."""
        out: list = [None] * len(recv_fns)

        def wrap(i, fn):
            try:
                out[i] = fn()
            except Exception as e:  # returned for the test to inspect
                out[i] = e

        threads = [self.threading.Thread(target=wrap, args=(i, f)) for i, f in enumerate(recv_fns)]
        for t in threads:
            t.start()
        try:
            result = src_fn()
        finally:
            for t in threads:
                t.join(60)
        return result, out

    def send(self, names=None, bucket_mb: float = 32.0, fail: str | None = None):
        """One sync of the slabs (``fail``: the trainer end reports this error instead)."""
        def src():
            if fail is not None:
                self.source.fail(fail)
                return None
            return self.source.send(self.slabs, set(names) if names is not None else None, None, None,
                                    int(bucket_mb * 2**20))

        return self.both(src, [lambda e=e: e.recv("ws-t") for e in self.ends])

    def close(self):
        self.source.close()
        for e in self.ends:
            e.close("ws-t")
