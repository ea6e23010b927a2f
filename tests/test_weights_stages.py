"""Weight sync with pipeline stages: every stage's first TP rank is a source of its own layers, the
stages send in parallel, nothing funnels through rank 0 (plain torch, tp=2 x pp=2 -> 2 receivers).

The rank-0 path (``funnel=True``: stage 1 sends its layers to rank 0, which sends the whole model)
is kept for the comparison of bytes written per process."""

from __future__ import annotations

import pytest
import torch

import twinkle_ray
from conftest import concurrently, leftovers
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import TensorSource, WeightSync, WeightSyncMixin

H = 512  # 1 MiB per weight: well above the background bytes a Ray worker writes meanwhile
LAYERS = 4


def full_state(seed: int) -> dict[str, torch.Tensor]:
    """The whole model: stage 0 holds embed + layers 0-1, stage 1 layers 2-3 + head (same sizes)."""
    g = torch.Generator().manual_seed(seed)
    out = {"embed.weight": torch.randn(H, H, generator=g)}
    for i in range(LAYERS):
        out[f"layers.{i}.weight"] = torch.randn(H, H, generator=g)
        out[f"layers.{i}.bias"] = torch.randn(H, generator=g)
    out["head.weight"] = torch.randn(H, H, generator=g)
    return out


def stage_names(stage: int, stages: int) -> list[str]:
    per = LAYERS // stages
    names = ["embed.weight"] if stage == 0 else []
    for i in range(stage * per, (stage + 1) * per):
        names += [f"layers.{i}.weight", f"layers.{i}.bias"]
    return names + (["head.weight"] if stage == stages - 1 else [])


@remote_class()
class StageTrainer(WeightSyncMixin):
    """A pp x tp trainer of plain tensors: each rank holds its stage's layers, row-sharded over tp."""

    def __init__(self, device_mesh: DeviceMesh, funnel: bool = False):
        import torch.distributed as dist

        self.mesh, self.funnel = device_mesh, funnel
        has_tp = device_mesh.has_dim("tp")
        self.pp, self.tp = device_mesh.get_dim_size("pp"), device_mesh.get_dim_size("tp") if has_tp else 1
        self.pp_rank, self.tp_rank = device_mesh.get_local_rank("pp"), device_mesh.get_local_rank("tp") if has_tp else 0
        self.names = stage_names(self.pp_rank, self.pp)
        full = full_state(seed=1)
        self.shards = {n: torch.chunk(full[n], self.tp, dim=0)[self.tp_rank].clone() for n in self.names}
        self.shapes = {n: tuple(full[n].shape) for n in self.names}
        self.tp_group = None
        for ranks in device_mesh.get_dim_groups("tp") if self.tp > 1 else []:  # every rank: every group, in order
            group = dist.new_group(ranks)
            if twinkle_ray.get_rank() in ranks:
                self.tp_group = group

    def _full(self, name: str) -> torch.Tensor:
        import torch.distributed as dist

        if self.tp == 1:
            return self.shards[name]
        parts = [torch.empty_like(self.shards[name]) for _ in range(self.tp)]
        dist.all_gather(parts, self.shards[name], group=self.tp_group)
        return torch.cat(parts, 0)

    def weight_sync_lane(self):
        if self.funnel:
            return super().weight_sync_lane()
        return (self.pp_rank if self.tp_rank == 0 else None), self.pp

    def weight_sync_tensors(self):
        source = TensorSource([(n, torch.float32, self.shapes[n]) for n in self.names],
                              lambda: ((n, self._full(n)) for n in self.names))
        if not self.funnel:
            return source  # lazy: each tensor is gathered while the previous bucket is on the wire
        import torch.distributed as dist

        mine = dict(iter(source))  # every tp rank takes part in the gathers
        rank = twinkle_ray.get_rank()
        if self.tp_rank != 0:
            return {}
        if self.pp_rank > 0:  # the funnel: this stage's layers go to rank 0 first
            for n in self.names:
                dist.send(mine[n].contiguous(), dst=0)
            return {}
        for stage in range(1, self.pp):
            src = self.mesh.get_pp_stage_ranks(stage)[0]
            for n in stage_names(stage, self.pp):
                t = torch.empty(full_state_shape(n))
                dist.recv(t, src=src)
                mine[n] = t
        return mine if rank == 0 else {}


def full_state_shape(name: str) -> tuple[int, ...]:
    return (H,) if name.endswith("bias") else (H, H)


@remote_class()
class StateSampler(WeightSyncMixin):
    """A receiver holding the whole model (as a TP=1 vLLM engine does)."""

    def __init__(self, device_mesh: DeviceMesh):
        self.state = {n: torch.zeros_like(t) for n, t in full_state(seed=1).items()}

    def weight_sync_targets(self):
        return self.state

    @remote_function(dispatch="all", collect="none")
    def get_state(self) -> dict:
        return {n: t.clone() for n, t in self.state.items()}


@pytest.fixture(params=[2], ids=["tp2"])
def stages(request, ray_session):
    """A pp=2 x tp=<param> trainer group and a 2-worker sampler group."""
    tp = request.param
    twinkle_ray.shutdown()
    twinkle_ray.initialize("ray", groups=[DeviceGroup("trainer", 2 * tp, "cpu"), DeviceGroup("sampler", 2, "cpu")])
    yield (DeviceMesh.from_sizes(pp_size=2, tp_size=tp, device_type="cpu"),
           DeviceMesh.from_sizes(dp_size=2, device_type="cpu"))
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


def _nbytes(names: list[str]) -> int:
    full = full_state(seed=1)
    return sum(full[n].numel() * 4 for n in names)


def _check_bit_exact(sampler) -> None:
    want = full_state(seed=1)
    got = sampler.get_state()()
    assert len(got) == 2
    for state in got:
        assert state.keys() == want.keys()
        assert all(torch.equal(state[n], want[n]) for n in want)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 6 workers on a shared 2-core machine
def test_each_stage_sends_its_own_layers_in_parallel(stages):
    train_mesh, sample_mesh = stages
    trainer = StageTrainer(train_mesh, remote_group="trainer")
    sampler = StateSampler(sample_mesh, remote_group="sampler")
    ws = WeightSync(trainer, sampler)
    try:
        stats = ws.sync()
        _check_bit_exact(sampler)
        assert stats.lanes == 2 and stats.receivers == 2
        assert sorted(stats.names) == sorted(full_state(seed=1))
        stage = [_nbytes(stage_names(k, 2)) for k in range(2)]
        assert stats.bytes == sum(stage)  # one copy of the model, split over the two lanes
        sources = {f"rank {train_mesh.get_pp_stage_ranks(k)[0]}": k for k in range(2)}
        print(f"\nbytes written per trainer process: {stats.sent_bytes}; {stats}")
        assert set(stats.sent_bytes) == {f"rank {r}" for r in range(4)}
        for label, k in sources.items():
            # 2 receivers: each source writes its own stage twice (gloo's broadcast tree from a root
            # of 3), plus its half of the TP all-gather; never the other stage's layers.
            wrote = stats.sent_bytes[label]
            assert 2 * stage[k] <= wrote < 2 * stage[k] + stage[k] // 2 + stage[1 - k] // 2, (label, wrote)
        trainer_again = ws.sync()  # the lanes are reused
        assert trainer_again.lanes == 2
        _check_bit_exact(sampler)
    finally:
        ws.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stages", [1], ids=["tp1"], indirect=True)
def test_per_stage_sources_halve_the_busiest_process_against_the_rank0_path(stages):
    train_mesh, sample_mesh = stages
    sampler = StateSampler(sample_mesh, remote_group="sampler")
    busiest = {}
    for funnel in (True, False):
        trainer = StageTrainer(train_mesh, funnel=funnel, remote_group="trainer")
        ws = WeightSync(trainer, sampler)
        try:
            stats = ws.sync()
            _check_bit_exact(sampler)
            assert stats.lanes == (1 if funnel else 2)
            busiest[funnel] = stats.busiest_sent
        finally:
            ws.close()
            trainer.close()
    model = _nbytes(list(full_state(seed=1)))
    print(f"\nbusiest trainer process wrote: rank-0 path {busiest[True] / 1e6:.1f} MB, "
          f"per-stage {busiest[False] / 1e6:.1f} MB ({busiest[False] / busiest[True]:.2f}x)")
    assert busiest[True] >= 2 * model  # rank 0 sends the whole model to each of 2 receivers
    assert busiest[False] <= 0.55 * busiest[True]


# ------------------------------------------------------------------------------ in-process: lanes, lazy sources
def _lanes(n_receivers: int = 2, timeout_s: float = 20.0):
    """Two lanes over one store: lane 0's source hosts it, lane 1's connects; receivers join both."""
    import threading

    from twinkle_ray.weight_channel import WeightChannel, join_lanes, lane_prefix

    world = 1 + n_receivers
    host = WeightChannel.host(world, timeout_s, host_ip="127.0.0.1", lanes=2)
    addr, port = host.address
    other = WeightChannel.connect(addr, port, 0, world, timeout_s)
    ends: list = [None] * n_receivers

    def recv_join(i):
        ends[i] = join_lanes(WeightChannel.connect(addr, port, i + 1, world, timeout_s), "c", "gloo")

    threads = [threading.Thread(target=recv_join, args=(i,)) for i in range(n_receivers)]
    threads.append(threading.Thread(target=other.join, args=("gloo", lane_prefix("c", 1))))
    for t in threads:
        t.start()
    host.join("gloo", prefix=lane_prefix("c", 0))
    for t in threads:
        t.join()
    return host, other, ends


def test_two_lanes_lazy_sources_one_receive_each():
    from twinkle_ray.weight_channel import receive_lanes

    full = full_state(seed=2)
    names = [stage_names(k, 2) for k in range(2)]
    pulled: list[str] = []

    def lazy(k):
        def produce():
            for n in names[k]:
                pulled.append(n)
                yield n, full[n]
        return TensorSource([(n, torch.float32, tuple(full[n].shape)) for n in names[k]], produce)

    lane0, lane1, ends = _lanes()
    got = [{}, {}]
    stats = concurrently(lambda: lane0.send(lazy(0), bucket_mb=1.5), lambda: lane1.send(lazy(1), bucket_mb=1.5),
                          *[lambda i=i: receive_lanes(ends[i], lambda b, i=i: [got[i].update(x) for x in b])
                            for i in range(2)])
    assert not [s for s in stats if isinstance(s, Exception)], stats
    assert [s.tensors for s in stats[:2]] == [len(names[0]), len(names[1])]
    assert stats[0].buckets == 3  # runs of <= 1.5 MiB in order: embed + layer 0 | layer 1 | ...
    for g, s in zip(got, stats[2:], strict=True):
        assert s.lanes == 2 and s.tensors == len(full)
        assert g.keys() == full.keys() and all(torch.equal(g[n], full[n]) for n in full)
    assert sorted(pulled) == sorted(full)

    # names= selects from a lazy source, which is still iterated to the end (its gathers are collectives)
    pulled.clear()
    got = [{}, {}]
    stats = concurrently(lambda: lane0.send(lazy(0), names=["layers.1.bias"]), lambda: lane1.send(lazy(1), names=[]),
                          *[lambda i=i: receive_lanes(ends[i], lambda b, i=i: [got[i].update(x) for x in b])
                            for i in range(2)])
    assert not [s for s in stats if isinstance(s, Exception)], stats
    assert all(list(g) == ["layers.1.bias"] for g in got) and sorted(pulled) == sorted(full)

    # a source that fails before sending: the receivers raise its message and load nothing of the
    # sync (the other lane is received and dropped, so its source does not hang): all or nothing
    got = [{}, {}]
    stats = concurrently(lambda: lane1.send([(n, full[n]) for n in names[1]]),
                          lambda: lane0.fail("weight_sync_tensors() raised KeyError: 'x'"),
                          *[lambda i=i: receive_lanes(ends[i], lambda b, i=i: [got[i].update(x) for x in b])
                            for i in range(2)])
    assert stats[0].tensors == len(names[1])
    assert all(isinstance(s, RuntimeError) and "KeyError: 'x'" in str(s) for s in stats[2:]), stats
    assert got == [{}, {}]
    # the channel is still in step: the next sync arrives whole
    stats = concurrently(lambda: lane0.send([(n, full[n]) for n in names[0]]),
                          lambda: lane1.send([(n, full[n]) for n in names[1]]),
                          *[lambda i=i: receive_lanes(ends[i], lambda b, i=i: [got[i].update(x) for x in b])
                            for i in range(2)])
    assert not [s for s in stats if isinstance(s, Exception)], stats
    assert all(g.keys() == full.keys() for g in got)
    for ch in [lane0, lane1, *[c for e in ends for c in e]]:
        ch.close()
