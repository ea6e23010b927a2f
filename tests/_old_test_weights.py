"""Weight sync: the channel protocol in-process, and ~50 M parameters through real gangs,
bit-identical on every sampler worker (time and bandwidth are printed; run with -s)."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch

import twinkle_ray
from conftest import leftovers
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import WeightChannel, WeightSyncMixin, fingerprint, sync_weights


def big_model(seed: int) -> torch.nn.Module:
    """About 50 M parameters in several dtypes (float32, bfloat16, an int64 buffer)."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Embedding(16_000, 1024),        # 16.4 M
        torch.nn.Linear(1024, 4096),             # 4.2 M
        torch.nn.Linear(4096, 4096),             # 16.8 M
        torch.nn.Linear(4096, 3072),             # 12.6 M
    )
    m[1].to(torch.bfloat16)
    m.register_buffer("steps", torch.randint(0, 1 << 40, (7,)))
    return m


def digests(tensors: dict) -> dict[str, str]:
    """sha256 of every tensor's raw bytes."""
    return {n: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
            for n, t in tensors.items()}


# ------------------------------------------------------------------------------ in-process protocol
def _pair(n_receivers: int = 2, timeout_s: float = 20.0):
    host = WeightChannel.host(1 + n_receivers, timeout_s, host_ip="127.0.0.1")
    addr, port = host.address
    recv = [WeightChannel.connect(addr, port, r, 1 + n_receivers, timeout_s) for r in range(1, 1 + n_receivers)]
    threads = [threading.Thread(target=c.join, args=("gloo",)) for c in recv]
    for t in threads:
        t.start()
    host.join("gloo")
    for t in threads:
        t.join()
    return host, recv


def _run(host_fn, recv_fns):
    """Run the source and the receivers concurrently; return (source result, receiver results/errors)."""
    out: list = [None] * len(recv_fns)

    def wrap(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # returned for the test to inspect
            out[i] = e

    threads = [threading.Thread(target=wrap, args=(i, f)) for i, f in enumerate(recv_fns)]
    for t in threads:
        t.start()
    try:
        result = host_fn()
    finally:
        for t in threads:
            t.join(60)
    return result, out


def test_channel_buckets_dtypes_subsets_and_changes():
    src = {"a": torch.randn(300, 100), "b": torch.randn(50).to(torch.bfloat16), "c": torch.arange(10),
           "d": torch.randn(1000, 300)}
    dst = [{k: torch.zeros_like(v) for k, v in src.items()} for _ in range(2)]
    host, recv = _pair()
    try:
        stats, errs = _run(lambda: host.send(src.items(), bucket_mb=0.5),
                           [lambda c=c, d=d: c.recv(d) for c, d in zip(recv, dst, strict=True)])
        assert not any(isinstance(e, Exception) for e in errs), errs
        assert stats.tensors == 4 and stats.buckets == 4  # 'd' (1.2 MB) is its own bucket
        for d in dst:
            assert digests(d) == digests(src)

        stats, _ = _run(lambda: host.send(src.items(), names=["c"]), [lambda c=c, d=d: c.recv(d)
                                                                       for c, d in zip(recv, dst, strict=True)])
        assert stats.names == ["c"]

        # only_changed: the first such sync sends everything, then only what changed.
        def changed():
            return _run(lambda: host.send(src.items(), only_changed=True),
                        [lambda c=c, d=d: c.recv(d) for c, d in zip(recv, dst, strict=True)])[0]

        assert changed().tensors == 4
        assert changed().tensors == 0
        src["d"][3, 7] += 1.0
        src["b"][0] = -src["b"][0]
        assert sorted(changed().names) == ["b", "d"]
        for d in dst:
            assert digests(d) == digests(src)
    finally:
        host.close()
        for c in recv:
            c.close()


def test_channel_errors_reach_every_end_without_hanging():
    src = {"w": torch.randn(4, 4)}
    host, recv = _pair()
    try:
        # An unknown name: the source raises, the receivers are told (not left waiting).
        with pytest.raises(KeyError, match="nope"):
            _, errs = _run(lambda: host.send(src.items(), names=["nope"]), [lambda c=c: c.recv({}) for c in recv])
        # A receiver whose tensor does not fit still takes the whole sync, then raises.
        ok = {"w": torch.zeros(4, 4)}
        bad = {"w": torch.zeros(2, 8)}
        stats, errs = _run(lambda: host.send(src.items()), [lambda: recv[0].recv(ok), lambda: recv[1].recv(bad)])
        assert stats.tensors == 1 and torch.equal(ok["w"], src["w"])
        assert isinstance(errs[1], ValueError) and "shape" in str(errs[1])
    finally:
        host.close()
        for c in recv:
            c.close()


def test_channel_timeout():
    host, recv = _pair(n_receivers=1, timeout_s=2.0)
    try:
        start = time.monotonic()
        with pytest.raises(Exception, match="(?i)timed? ?out"):
            recv[0].recv({})  # nobody sends
        assert time.monotonic() - start < 30
    finally:
        host.close()
        recv[0].close()


def test_fingerprint_sees_single_bit_changes():
    t = torch.randn(3_000_000)
    base = fingerprint(t)
    u = t.clone()
    u.view(torch.int32)[2_500_000] ^= 1  # one bit, in the last chunk
    assert fingerprint(u) != base and fingerprint(t.clone()) == base
    v = t.clone()
    v[[0, 1]] = v[[1, 0]]  # a swap keeps the plain sum
    assert fingerprint(v) != base


# ------------------------------------------------------------------------------ through gangs
@remote_class()
class BigTrainer(WeightSyncMixin):
    def __init__(self, device_mesh: DeviceMesh):
        self.model = big_model(seed=1)

    @remote_function(dispatch="all", collect="none")
    def digests(self) -> dict:
        return {"rank": twinkle_ray.get_rank(), "digests": digests(self.weight_sync_tensors())}

    @remote_function(dispatch="all")
    def bump(self, name: str) -> None:
        with torch.no_grad():
            self.weight_sync_tensors()[name].add_(1)


@remote_class()
class BigSampler(WeightSyncMixin):
    def __init__(self, device_mesh: DeviceMesh):
        self.model = big_model(seed=2)

    @remote_function(dispatch="all", collect="none")
    def digests(self) -> dict:
        return {"rank": twinkle_ray.get_rank(), "digests": digests(self.weight_sync_tensors())}


@pytest.fixture(scope="module")
def gangs(ray_session):
    twinkle_ray.shutdown()
    twinkle_ray.initialize("ray", groups=[DeviceGroup("trainer", 2, "cpu"), DeviceGroup("sampler", 2, "cpu")])
    mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    yield BigTrainer(mesh, remote_group="trainer"), BigSampler(mesh, remote_group="sampler")
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors, f"leaked actors: {[a.get('name') for a in actors]}"
    assert not pgs, f"leaked placement groups: {pgs}"


def _check_identical(trainer, sampler) -> None:
    [t0] = [d["digests"] for d in trainer.digests()() if d["rank"] == 0]
    got = sampler.digests()()
    assert len(got) == 2
    for d in got:
        assert d["digests"] == t0, f"sampler rank {d['rank']} differs from the trainer"


@pytest.mark.slow
def test_sync_50m_params_bit_identical_on_every_sampler_worker(gangs):
    trainer, sampler = gangs
    n_params = sum(p.numel() for p in big_model(0).parameters())
    assert 45e6 < n_params < 55e6
    [t0] = [d["digests"] for d in trainer.digests()() if d["rank"] == 0]
    assert all(d["digests"] != t0 for d in sampler.digests()())  # different before

    start = time.perf_counter()
    first = sync_weights(trainer, sampler, bucket_mb=32)
    first_wall = time.perf_counter() - start
    _check_identical(trainer, sampler)
    assert first.tensors == 8 and first.buckets >= 7 and first.receivers == 2
    assert first.backend == "gloo"

    start = time.perf_counter()
    again = sync_weights(trainer, sampler, bucket_mb=32)  # reuses the group
    again_wall = time.perf_counter() - start
    print(f"\nweight sync, {n_params / 1e6:.1f} M params: first (with set-up) {first_wall:.2f}s wall; "
          f"{first}\nweight sync again: {again_wall:.2f}s wall; {again}")
    _check_identical(trainer, sampler)


@pytest.mark.slow
def test_sync_only_changed_and_named_subsets_through_gangs(gangs):
    trainer, sampler = gangs
    sync_weights(trainer, sampler, only_changed=True)  # starts tracking: sends everything
    trainer.bump("steps")()
    stats = sync_weights(trainer, sampler, only_changed=True)
    assert stats.names == ["steps"] and stats.bytes == 7 * 8
    _check_identical(trainer, sampler)
    trainer.bump("1.bias")()
    stats = sync_weights(trainer, sampler, names=["1.bias"])
    assert stats.names == ["1.bias"]
    _check_identical(trainer, sampler)
    with pytest.raises(KeyError, match="nope"):
        sync_weights(trainer, sampler, names=["nope"])
    trainer.bump("0.weight")()
    sync_weights(trainer, sampler)  # the channel recovers after a failed sync
    _check_identical(trainer, sampler)


# ------------------------------------------------------------------------------ receivers: the fan-out hook
def test_receiver_end_rejects_unknown_ops_and_missing_ranks():
    from twinkle_ray.weights import ReceiverEnd, WeightSync

    end = ReceiverEnd(lambda buckets: None, index=1)
    with pytest.raises(ValueError, match="unknown receiver operation 'send'"):
        end.call("send")
    with pytest.raises(RuntimeError, match="no rank for receiver index 1"):
        end.call("join", "ws-x", "127.0.0.1", 1, [[0, 1]], 2, "gloo", 5.0)
    with pytest.raises(RuntimeError, match="not set up in this receiver"):
        end.call("recv", "ws-x")
    assert end.call("probe")["index"] == 1 and end.call("ready", "ws-x") is False
    # Ranks are handed out once, by the driver: gang, worker, then receiver index order.
    plan = WeightSync._rank_plan([[{"rank": 1, "index": 0}, {"rank": 0, "index": 1}, {"rank": 0, "index": 0}],
                                  [{"rank": 0, "index": 0}]])
    assert plan == [{0: [[0, 1], [1, 2]], 1: [[0, 3]]}, {0: [[0, 4]]}]


def test_receive_drains_what_the_consumer_leaves_and_raises_its_error():
    src = {"a": torch.randn(100, 100), "b": torch.randn(100, 100), "c": torch.randn(10)}
    host, recv = _pair(n_receivers=1)
    try:
        def stops_early(buckets):
            next(buckets)
            raise RuntimeError("engine refused the weights")

        stats, errs = _run(lambda: host.send(src.items(), bucket_mb=0.05), [lambda: recv[0].receive(stops_early)])
        assert stats.buckets == 2  # a | b + c: the consumer takes the first only
        assert isinstance(errs[0], RuntimeError) and "engine refused" in str(errs[0])
        got = {}
        stats, errs = _run(lambda: host.send(src.items(), bucket_mb=0.05),  # the channel is still in step
                           [lambda: recv[0].receive(lambda bs: got.update({n: t.clone() for b in bs for n, t in b}))])
        assert errs[0].tensors == 3 and digests(got) == digests(src)
    finally:
        host.close()
        recv[0].close()


def _small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3))  # uneven shards of 10 rows


@remote_class()
class SmallTrainer(WeightSyncMixin):
    def __init__(self, device_mesh: DeviceMesh):
        self.model = _small_model(seed=5)

    @remote_function(dispatch="all", collect="first")
    def state(self) -> dict:
        return {n: t.clone() for n, t in self.model.state_dict().items()}

    @remote_function(dispatch="all")
    def bump(self, name: str) -> None:
        with torch.no_grad():
            self.model.state_dict()[name].add_(1)


class FakeEngine:
    """An engine with worker processes of its own, as vLLM with TP=2: here two threads, each a
    receiver (its own ReceiverEnd, index = its worker rank) loading into its own state dict."""

    def __init__(self, workers: int, seed: int):
        from twinkle_ray.weights import ReceiverEnd

        self.states = [_small_model(seed).state_dict() for _ in range(workers)]
        self.ends = [ReceiverEnd(lambda buckets, s=s: self._load(s, buckets), index=i)
                     for i, s in enumerate(self.states)]

    @staticmethod
    def _load(state, buckets):
        from twinkle_ray.weights import load_into

        for items in buckets:
            problems = load_into(state, items)
            assert not problems, problems

    def collective_rpc(self, op, *args):
        """Every worker runs the call concurrently (a rendezvous like join needs them all)."""
        out: list = [None] * len(self.ends)

        def run(i):
            try:
                out[i] = self.ends[i].call(op, *args)
            except Exception as e:  # re-raised below
                out[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.ends))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for o in out:
            if isinstance(o, Exception):
                raise o
        return out


@remote_class()
class EngineSampler(WeightSyncMixin):
    """A receiver that is not a torch module: only the fan-out hook is overridden."""

    def __init__(self, device_mesh: DeviceMesh):
        self.engine = FakeEngine(workers=2, seed=3)

    def weight_sync_tensors(self):
        raise AssertionError("a receiver must never call the source-side weight_sync_tensors()")

    def weight_sync_fanout(self, op, *args):
        return self.engine.collective_rpc(op, *args)

    @remote_function(dispatch="all", collect="none")
    def states(self) -> list[dict]:
        return [{n: t.clone() for n, t in s.items()} for s in self.engine.states]


@pytest.fixture
def small_groups(ray_session):
    twinkle_ray.shutdown()
    twinkle_ray.initialize("ray", groups=[DeviceGroup("trainer", 1, "cpu"), DeviceGroup("sampler", 2, "cpu")])
    yield DeviceMesh.from_sizes(dp_size=1, device_type="cpu"), DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_engine_receivers_through_the_fanout_hook(small_groups):
    one, two = small_groups
    trainer = SmallTrainer(one, remote_group="trainer")
    sampler = EngineSampler(two, remote_group="sampler")
    want = trainer.state()()
    stats = sync_weights(trainer, sampler)
    assert stats.receivers == 4  # 2 workers x 2 engine workers, each at its own channel rank
    got = sampler.states()()
    assert len(got) == 2 and all(len(w) == 2 for w in got)
    assert all(_equal(s, want) for w in got for s in w)
    assert sync_weights(trainer, sampler, only_changed=True).tensors == 4  # the first one sends all
    trainer.bump("1.bias")()
    assert sync_weights(trainer, sampler, only_changed=True).names == ["1.bias"]
    want = trainer.state()()
    assert all(_equal(s, want) for w in sampler.states()() for s in w)


@remote_class()
class ShardedSampler(WeightSyncMixin):
    """An FSDP2 receiver: its parameters are DTensor shards."""

    def __init__(self, device_mesh: DeviceMesh):
        from torch.distributed.fsdp import fully_shard

        self.model = _small_model(seed=6)
        fully_shard(self.model, mesh=device_mesh.to_torch())
        self.ptrs = {n: p.to_local().data_ptr() for n, p in self.model.named_parameters()}

    def weight_sync_tensors(self):
        raise AssertionError("a receiver must never call the source-side weight_sync_tensors()")

    @remote_function(dispatch="all", collect="none")
    def shards(self) -> dict:
        """This rank's local shards, whether they are still the model's own storage, and the full weights."""
        local = {n: p.to_local().detach().clone() for n, p in self.model.named_parameters()}
        same = all(p.to_local().data_ptr() == self.ptrs[n] for n, p in self.model.named_parameters())
        full = {n: p.full_tensor().detach() for n, p in self.model.named_parameters()}
        return {"rank": twinkle_ray.get_rank(), "local": local, "same_storage": same, "full": full}


@pytest.mark.slow
def test_sharded_receiver_loads_into_the_model_not_copies(small_groups):
    one, two = small_groups
    trainer = SmallTrainer(one, remote_group="trainer")
    sampler = ShardedSampler(two, remote_group="sampler")
    want = trainer.state()()
    assert not torch.equal(sampler.shards()()[0]["full"]["0.weight"], want["0.weight"])
    stats = sync_weights(trainer, sampler)
    assert stats.tensors == 4 and stats.receivers == 2
    for got in sampler.shards()():
        assert got["same_storage"], "the shards were replaced, not loaded into"
        assert _equal(got["full"], want)
        for name, full in want.items():  # each rank holds its own slice (torch.chunk on dim 0)
            assert torch.equal(got["local"][name], torch.chunk(full, 2, dim=0)[got["rank"]]), (got["rank"], name)
