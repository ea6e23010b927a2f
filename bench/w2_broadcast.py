"""The W2 baseline, bench-only: the weight sync as it was before the resharded plan.

Per pipeline stage one source (its first TP rank of data rank 0) gathers its stage's tensor-parallel
shards (``gather_object`` over the stage's TP ranks), assembles full tensors and broadcasts them in
buckets to every sampler over a group of its own (the source at rank 0, the samplers after it). Every
sampler receives every full tensor and keeps its part. Kept here, not in the library, so nothing can
pick it by accident.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from weights_helpers import LayoutSampler, LayoutTrainer, stage_layers

from twinkle_ray import get_rank, remote_class, remote_function
from twinkle_ray.weights.transport import Endpoint, bytes_written

BUCKET = 32 << 20


def stage_names(full_shapes: dict, stage: int, pp: int, layers: int) -> list[str]:
    """The full tensors stage ``stage`` owns, in one order both ends know."""
    mine = [f"layers.{i}." for i in stage_layers(stage, pp, layers)]
    out = [n for n in sorted(full_shapes) if any(n.startswith(p) for p in mine)]
    if stage == 0:
        out.insert(0, "embed.weight")
    if stage == pp - 1:
        out.append("head.weight")
    return out


def buckets_of(names: list[str], shapes: dict) -> list[list[str]]:
    out, size = [], 0
    for n in names:
        nbytes = 4 * int(torch.Size(shapes[n]).numel())
        if not out or size + nbytes > BUCKET:
            out.append([])
            size = 0
        out[-1].append(n)
        size += nbytes
    return out


@remote_class()
class BcastTrainer(LayoutTrainer):
    """LayoutTrainer plus the old path: per-stage TP gather, then a broadcast per stage."""

    @remote_function(dispatch="all", collect="flatten")
    def bcast_host(self) -> list:
        """Ranks that source a lane host a store for it: [(stage, addr, port)]."""
        self.tp_groups = None
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank creates every group
            self.tp_groups = [dist.new_group([(s * self.dp) * self.tp + t for t in range(self.tp)])
                              for s in range(self.pp)]
        if self.dp_rank == 0 and self.tp_rank == 0:
            self.ep = Endpoint.host(120)
            return [(self.pp_rank, *self.ep.address)]
        return []

    @remote_function(dispatch="all")
    def bcast_join(self, samplers: int) -> None:
        if self.dp_rank == 0 and self.tp_rank == 0:
            store = dist.PrefixStore("bcast", self.ep.store)
            self.bpg = dist.ProcessGroupGloo(store, 0, 1 + samplers, timedelta(seconds=120))

    @remote_function(dispatch="all", collect="flatten")
    def bcast_send(self) -> list[dict]:
        """One sync the old way; each rank's figures (bytes written, payload broadcast)."""
        w0 = bytes_written()
        payload = 0
        if self.dp_rank == 0:
            mine = [(s.name, s.meta(), s.tensor.contiguous()) for s in self.weight_sync_shards()]
            got = [mine]
            if self.tp > 1:
                group = self.tp_groups[self.pp_rank]
                got = [None] * self.tp if self.tp_rank == 0 else None
                dist.gather_object(mine, got, dst=dist.get_global_rank(group, 0), group=group)
            if self.tp_rank == 0:
                full = {}
                for part in got:
                    for name, (_, _, shape, d, start, n), t in part:
                        if name not in full:
                            full[name] = torch.empty(shape)
                        full[name].narrow(d, start, n).copy_(t) if shape else full[name].copy_(t)
                shapes = {n: tuple(t.shape) for n, t in full.items()}
                for b in buckets_of(stage_names(shapes, self.pp_rank, self.pp, self.layers), shapes):
                    flat = torch.cat([full[n].reshape(-1) for n in b])
                    self.bpg.broadcast([flat], dist.BroadcastOptions()).wait()
                    payload += flat.numel() * 4
        return [{"rank": get_rank(), "written": bytes_written() - w0, "payload": payload}]


@remote_class()
class BcastSampler(LayoutSampler):
    """LayoutSampler plus the old path: one group per trainer stage, full tensors, keeps its part."""

    @remote_function(dispatch="all")
    def bcast_join(self, lanes: list, samplers: int) -> None:
        self.bpgs = []
        for stage, addr, port in sorted(lanes):
            ep = Endpoint.connect(addr, port, 120)
            store = dist.PrefixStore("bcast", ep.store)
            self.bpgs.append((stage, ep, dist.ProcessGroupGloo(store, 1 + get_rank(), 1 + samplers,
                                                               timedelta(seconds=120))))

    @remote_function(dispatch="all", collect="flatten")
    def bcast_recv(self, pp: int, layers: int) -> list[dict]:
        w0 = bytes_written()
        got = 0
        for stage, _, pg in self.bpgs:
            for b in buckets_of(stage_names(self.full_shapes, stage, pp, layers), self.full_shapes):
                flat = torch.empty(sum(int(torch.Size(self.full_shapes[n]).numel()) for n in b))
                pg.broadcast([flat], dist.BroadcastOptions()).wait()
                got += flat.numel() * 4
                off = 0
                for n in b:
                    k = int(torch.Size(self.full_shapes[n]).numel())
                    full = flat[off:off + k].view(self.full_shapes[n])
                    self.keep[n].copy_(self._mine(n, full))
                    off += k
        return [{"rank": get_rank(), "received": got, "written": bytes_written() - w0}]
