"""Weight sync semantics: the pairs in-process (buckets, dtypes, subsets, errors, timeouts), resharded
transfer bit-exact for every W2 layout (tp x pp x dp trainers of Megatron-style fused layouts -> full or
tensor-parallel samplers), the plan replayed, ~50 M parameters through real gangs, names and
only_changed, receivers behind a fan-out hook (an engine's workers) and FSDP2 receivers loading into
their own shards, and ``wait=False`` taking its place in both gangs' call order."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch
from weights_helpers import InProcess, LayoutSampler, LayoutTrainer, expected_digests, model_bytes

import twinkle_ray
from conftest import leftovers
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import (
    ReceiverEnd,
    SourceFailed,
    WeightSync,
    WeightSyncMixin,
    fingerprint,
    sync_weights,
)


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


# ------------------------------------------------------------------------------ in-process: the pairs
def _collect(store: dict):
    def consume(buckets):
        for items in buckets:
            store.update({n: t.clone() for n, t in items})
    return consume


def test_a_broken_pair_is_an_echo_and_a_timeout_stays_itself():
    """A transport error from the other end's failure is PeerFailed (passed over for the failing
    end's own error), its message and cause kept; a timeout (Python's or gloo's) is not an echo."""
    from twinkle_ray.weights.handle import is_echo
    from twinkle_ray.weights.transport import PeerFailed, peer_failed

    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4315")
    e = peer_failed("0-ab", closed)
    assert isinstance(e, PeerFailed) and is_echo(e) and e.__cause__ is closed
    assert str(e) == f"weight sync: pair 0-ab broke (its other end failed or left): {closed}"
    assert peer_failed("0-cd", e) is e  # already an echo: kept
    for timeout in (TimeoutError("deadline passed"), RuntimeError("[pair.cc:598] Timed out waiting 120000ms")):
        assert peer_failed("0-ab", timeout) is timeout and not is_echo(timeout)


def test_pairs_buckets_dtypes_and_subsets():
    src = {"a": torch.randn(300, 100), "b": torch.randn(50).to(torch.bfloat16), "c": torch.arange(10),
           "d": torch.randn(1000, 300)}
    got = [{}, {}]
    ch = InProcess(src, [_collect(g) for g in got])
    try:
        stats, figs = ch.send(bucket_mb=0.5)
        assert not any(isinstance(f, Exception) for f in figs), figs
        assert stats["buckets"] == 2 * 4  # per receiver: 'a', 'b' (another dtype), 'c', 'd' (1.2 MB alone)
        for g in got:
            assert digests(g) == digests(src)
        assert all(f["tensors"] == 4 and f["bytes"] == sum(t.numel() * t.element_size() for t in src.values())
                   for f in figs)
        stats, figs = ch.send(names=["c"])
        assert stats["names"] == ["c"] and all(f["tensors"] == 1 for f in figs)
    finally:
        ch.close()


def test_pairs_errors_reach_every_end_without_hanging():
    src = {"w": torch.randn(4, 4)}
    ok, bad = {"w": torch.zeros(4, 4)}, {"w": torch.zeros(2, 8)}
    from twinkle_ray.weights import load_into

    def loader(targets):
        def consume(buckets):
            problems = [p for items in buckets for p in load_into(targets, items)]
            if problems:
                raise ValueError("; ".join(problems))
        return consume

    ch = InProcess(src, [loader(ok), loader(bad)])
    try:
        _, errs = ch.send(fail="the source could not gather")  # the sender's error reaches every receiver
        assert all(isinstance(e, SourceFailed) and "could not gather" in str(e) for e in errs)
        stats, errs = ch.send()  # a receiver whose tensor does not fit still takes the whole sync, then raises
        assert stats["receivers"] == 2 and torch.equal(ok["w"], src["w"])
        assert isinstance(errs[1], ValueError) and "shape" in str(errs[1])
        _, errs = ch.send()  # the pairs are still in step
        assert not isinstance(errs[0], Exception)
    finally:
        ch.close()


def test_pair_wait_is_bounded_and_a_gone_peer_ends_it():
    from datetime import timedelta

    ch = InProcess({"w": torch.randn(4)}, [lambda b: None], timeout_s=2.0)
    try:
        pair = next(iter(ch.ends[0].channels["ws-t"].pairs.values()))
        pair.peer_wait = timedelta(seconds=2)
        start = time.monotonic()
        with pytest.raises(Exception, match="(?i)timed? ?out"):
            ch.ends[0].recv("ws-t")  # nobody sends
        assert time.monotonic() - start < 30
    finally:
        ch.close()
    ch = InProcess({"w": torch.randn(4)}, [lambda b: None], timeout_s=60.0)
    threading.Timer(1.0, ch.source.close).start()  # the sender leaves while the receiver waits
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        ch.ends[0].recv("ws-t")
    assert time.monotonic() - start < 30
    ch.close()


def test_receive_drains_what_the_consumer_leaves_and_raises_its_error():
    src = {"a": torch.randn(100, 100), "b": torch.randn(100, 100), "c": torch.randn(10)}

    def stops_early(buckets):
        next(buckets)
        raise RuntimeError("engine refused the weights")

    got: dict = {}
    first = {"n": 0}

    def consume(buckets):
        first["n"] += 1
        if first["n"] == 1:
            stops_early(buckets)
        _collect(got)(buckets)

    ch = InProcess(src, [consume])
    try:
        stats, errs = ch.send(bucket_mb=0.05)
        assert stats["buckets"] == 2  # a | b + c: the consumer takes the first only
        assert isinstance(errs[0], RuntimeError) and "engine refused" in str(errs[0])
        stats, figs = ch.send(bucket_mb=0.05)  # the pairs are still in step
        assert figs[0]["tensors"] == 3 and digests(got) == digests(src)
    finally:
        ch.close()


def test_receiver_end_rejects_unknown_ops_and_places_not_planned():
    end = ReceiverEnd(lambda buckets: None, index=1)
    with pytest.raises(ValueError, match="unknown receiver operation 'send'"):
        end.call("send")
    with pytest.raises(RuntimeError, match="the plan has no place for receiver"):
        end.call("join", "ws-x", {"plan": {"receivers": {}}, "backend": "gloo", "timeout_s": 5.0})
    with pytest.raises(RuntimeError, match="not set up in this receiver"):
        end.call("recv", "ws-x")
    facts = end.call("probe")
    assert facts["index"] == 1 and facts["uid"] == end.uid and end.call("ready", "ws-x") is False


def test_plan_sends_each_row_once_spreads_replicas_and_is_replayed():
    from twinkle_ray.weights.plan import build_plan

    def src(rank, replica, start):
        return {"rank": rank, "replica": replica, "addr": "h", "port": rank,
                "slabs": [["w", "float32", [4, 2], 0, start, 2], ["n", "float32", [2], 0, 0, 2]]}

    sources = [src(0, 0, 0), src(1, 0, 2), src(2, 1, 0), src(3, 1, 2)]  # tp2 x dp2; 'n' replicated over tp
    rx = [[{"rank": i, "index": 0, "uid": f"u{i}", "wants": None} for i in range(2)]]
    cache: dict = {}
    plan = build_plan(sources, rx, cache)
    senders = {k: {p["sender"] for key, p in plan["pairs"].items() if key.endswith(k)} for k in ("u0", "u1")}
    assert senders == {"u0": {0, 1}, "u1": {2, 3}}  # each receiver pulls from one replica
    for uid in ("u0", "u1"):
        sent = sum(x[4] for p in plan["pairs"].values() if p["receiver"] == uid for x in p["pieces"])
        assert sent == 4 * 2 + 2  # every row once: w whole, n from one tp rank only
    again = build_plan(sources, [[{**r, "uid": r["uid"] + "x"} for r in rx[0]]], cache)
    assert again["replayed"] and not plan["replayed"]  # same layouts, new ids: the plan is replayed
    wants = [["w", "float32", [4, 2], 0, 2, 2]]  # a TP receiver keeping rows 2..3 of w
    tp = build_plan(sources[:2], [[{"rank": 0, "index": 0, "uid": "t", "wants": wants}]])
    assert list(tp["pairs"]) == ["1-t"]  # only the rank holding those rows sends


def test_fingerprint_sees_single_bit_changes():
    t = torch.randn(3_000_000)
    base = fingerprint(t)
    u = t.clone()
    u.view(torch.int32)[2_500_000] ^= 1  # one bit, in the last chunk
    assert fingerprint(u) != base and fingerprint(t.clone()) == base
    v = t.clone()
    v[[0, 1]] = v[[1, 0]]  # a swap keeps the plain sum
    assert fingerprint(v) != base


LAYOUTS = [  # (tp, pp, dp) -> samplers, sampler tp
    ((1, 1, 1), 1, 1),
    ((2, 2, 1), 2, 1),
    ((2, 2, 2), 4, 1),
    ((2, 1, 1), 2, 2),  # a tensor-parallel sampler: each worker keeps its own rows
]


def _gangs(runtime, tp, pp, dp, samplers, sampler_tp):
    n = tp * pp * dp
    runtime.initialize(groups=[DeviceGroup("trainer", n, "cpu", cpus_per_worker=0.25),
                               DeviceGroup("sampler", samplers, "cpu", cpus_per_worker=0.25)])
    trainer = LayoutTrainer(None, tp, pp, dp, version=1.0, remote_group="trainer")
    sampler = LayoutSampler(None, sampler_tp, remote_group="sampler")
    return trainer, sampler


def _check(sampler, version, sampler_tp):
    got = sampler.digests()()
    got = got if isinstance(got, list) else [got]
    for rank, d in enumerate(got):
        assert d == expected_digests(version, sampler_tp, rank), f"sampler rank {rank} differs"


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0][0]}pp{x[0][1]}dp{x[0][2]}-to-{x[1]}x{x[2]}")
def test_resharded_sync_is_bit_exact_and_sends_each_byte_once(runtime, layout):
    (tp, pp, dp), samplers, sampler_tp = layout
    trainer, sampler = _gangs(runtime, tp, pp, dp, samplers, sampler_tp)
    ws = WeightSync(trainer, sampler, timeout_s=60)
    stats = ws.sync()
    _check(sampler, 1.0, sampler_tp)
    assert stats.path == "resharded"
    if sampler_tp == 1:  # total bytes sent = what the samplers keep: a full model each
        assert stats.bytes == model_bytes() * samplers
    per_rank = stats.payload_bytes
    assert len(per_rank) == tp * pp * dp  # every rank sent: nothing gathered to a source
    fair = stats.bytes / len(per_rank)
    assert max(per_rank.values()) <= 1.1 * fair + 4096
    # the plan is replayed: a second sync of a new version, same pairs
    before = ws.channels()["trainer"]
    trainer.set_version(2.0)()
    ws.sync()
    _check(sampler, 2.0, sampler_tp)
    after = ws.channels()["trainer"]
    assert [r["sources"] for r in before] == [r["sources"] for r in after]
    ws.close()


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
    assert stats.names == ["steps"] and stats.bytes == 2 * 7 * 8  # once to each of the 2 receivers
    _check_identical(trainer, sampler)
    trainer.bump("1.bias")()
    stats = sync_weights(trainer, sampler, names=["1.bias"])
    assert stats.names == ["1.bias"]
    _check_identical(trainer, sampler)
    with pytest.raises(ValueError, match="nope"):
        sync_weights(trainer, sampler, names=["nope"])
    trainer.bump("0.weight")()
    sync_weights(trainer, sampler)  # the channel recovers after a failed sync
    _check_identical(trainer, sampler)


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
