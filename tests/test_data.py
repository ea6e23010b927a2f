"""DataLoader: in-process rules, and through Ray: batches routed by data rank to a dp=2 gang,
clean end of epoch, resume, and a Ray Data source read as a stream."""

from __future__ import annotations

import functools
import itertools

import pytest

import twinkle_ray
from conftest import leftovers
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.data import DataLoader
from twinkle_ray.sampler import DeviceMeshSampler

MESH = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")


@remote_class()
class Consumer:
    """A dp=2 gang that reports which items each rank received."""

    def __init__(self, device_mesh: DeviceMesh):
        self.mesh = device_mesh

    @remote_function(dispatch="slice_dp", collect="none")
    def take(self, items: list) -> dict:
        return {"rank": twinkle_ray.get_rank(), "items": list(items)}


def _make(n: int) -> list[int]:
    return list(range(n))


# ------------------------------------------------------------------------------ in-process
def test_local_loader_batches_collate_and_data_rank():
    loader = DataLoader(functools.partial(_make, 10), batch_size=4, data_world_size=2,
                        collate_fn=lambda b: {"x": b})
    assert [b["x"] for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(loader) == 3
    rank1 = DataLoader(list(range(10)), batch_size=4, data_world_size=2, data_rank=1)
    assert list(rank1) == [[2, 3], [6, 7], [9]]


def test_local_loader_errors():
    with pytest.raises(TypeError, match="sequence"):
        DataLoader(iter(range(3)), batch_size=2)
    with pytest.raises(ValueError, match="divisible"):
        DataLoader(list(range(10)), batch_size=3, device_mesh=MESH)
    with pytest.raises(ValueError, match="out of range"):
        DataLoader(list(range(10)), batch_size=2, device_mesh=MESH, data_rank=2)


def test_local_loader_resume_matches_uninterrupted_run():
    ref = DataLoader(list(range(30)), batch_size=4, data_world_size=2, shuffle=True, seed=3)
    expected = list(ref) + list(ref)
    a = DataLoader(list(range(30)), batch_size=4, data_world_size=2, shuffle=True, seed=3)
    head = list(itertools.islice(a, 5))
    b = DataLoader(list(range(30)), batch_size=4, data_world_size=2, shuffle=True, seed=3)
    b.load_state_dict(a.state_dict())
    assert head + list(b) + list(b) == expected


class _Rows:
    def __init__(self, rows):
        self.rows = rows

    def to_pylist(self):
        return self.rows


class Dataset:
    """A stand-in for a ray.data.Dataset read as a stream (what DataLoader uses of one)."""

    __module__ = "ray.data.dataset"

    def __init__(self, n: int):
        import types

        self.n = n
        self.context = types.SimpleNamespace(execution_options=types.SimpleNamespace())

    def count(self) -> int:
        return self.n

    def iter_batches(self, batch_size: int, **kwargs):
        for start in range(0, self.n, batch_size):
            yield _Rows([{"id": i} for i in range(start, min(self.n, start + batch_size))])


def test_a_streamed_loaders_resume_checks_drop_last_and_shuffle_buffer_size():
    """Neither was checked: a changed buffer size changes the resumed order."""
    kwargs = dict(batch_size=4, data_world_size=2, shuffle=True, seed=1)
    saved = DataLoader(Dataset(20), shuffle_buffer_size=8, **kwargs).state_dict()
    assert saved["shuffle_buffer_size"] == 8 and saved["drop_last"] is False
    with pytest.raises(ValueError, match="shuffle_buffer_size=8, this loader 16"):
        DataLoader(Dataset(20), shuffle_buffer_size=16, **kwargs).load_state_dict(saved)
    with pytest.raises(ValueError, match="drop_last=False, this loader True"):
        DataLoader(Dataset(20), shuffle_buffer_size=8, drop_last=True, **kwargs).load_state_dict(saved)
    same = DataLoader(Dataset(20), shuffle_buffer_size=8, **kwargs)
    same.load_state_dict({**saved, "step": 2})
    assert same.state_dict()["step"] == 2
    unshuffled = DataLoader(Dataset(20), batch_size=4, data_world_size=2, seed=1, shuffle_buffer_size=99)
    unshuffled.load_state_dict({**saved, "shuffle": False})  # no shuffle: the buffer plays no part


def test_skipping_past_a_streams_end_is_an_error_not_a_silent_epoch_end():
    loader = DataLoader(Dataset(20), batch_size=4, data_world_size=2)  # 5 batches an epoch
    loader.skip(2)
    with pytest.raises(ValueError, match=r"skip\(4\): at step 2 of epoch 0, a streamed epoch of 5 "
                                         r"batch\(es\) has only 3 left"):
        loader.skip(4)
    assert loader.state_dict()["step"] == 2  # unchanged
    assert [b[0]["id"] for b in loader] == [8, 12, 16]
    loader.skip(5)  # epoch 1, to its end: the next epoch starts, as iterating there does
    assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (2, 0)


# ------------------------------------------------------------------------------ through Ray
@pytest.fixture(scope="module")
def rt(ray_session):
    twinkle_ray.shutdown()
    twinkle_ray.initialize("ray", groups=[DeviceGroup("data", 1, "cpu"), DeviceGroup("actor", 2, "cpu")])
    yield twinkle_ray
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors, f"leaked actors: {[a.get('name') for a in actors]}"
    assert not pgs, f"leaked placement groups: {pgs}"


@pytest.fixture(scope="module")
def consumer(rt):
    return Consumer(MESH, remote_group="actor")


def _drain(loader, consumer) -> tuple[list[list], list[list]]:
    """Feed every batch of one epoch to the consumer: (per-batch rank parts, global batches)."""
    outs = [consumer.take(batch) for batch in loader]  # batches stay in the loader's worker
    parts = [[r["items"] for r in sorted(o(), key=lambda r: r["rank"])] for o in outs]
    return parts, [p[0] + p[1] for p in parts]


@pytest.mark.slow
def test_loader_batches_reach_each_dp_rank_exactly_once(rt, consumer):
    n = 53  # uneven: 6 full batches of 8, then a 5-item tail
    loader = DataLoader(functools.partial(_make, n), batch_size=8, device_mesh=MESH, shuffle=True,
                        seed=11, remote_group="data")
    assert isinstance(loader, twinkle_ray.runtime.proxy.GangProxy) and len(loader) == 7
    parts, batches = _drain(loader, consumer)
    sampler = DeviceMeshSampler(n, 8, device_mesh=MESH, shuffle=True, seed=11)
    assert batches == list(sampler)  # the loader yields the sampler's global batches
    for p, b in zip(parts, batches, strict=True):
        assert p == [sampler.rank_part(b, 0), sampler.rank_part(b, 1)]
    assert [len(x) for x in parts[-1]] == [3, 2]
    assert sorted(itertools.chain.from_iterable(batches)) == list(range(n))
    state = loader.state_dict()
    assert (state["epoch"], state["step"]) == (1, 0)
    # The next pass is the next epoch, reshuffled, and ends cleanly again.
    _, second = _drain(loader, consumer)
    assert second != batches and sorted(itertools.chain.from_iterable(second)) == list(range(n))
    assert loader.state_dict()["epoch"] == 2


@pytest.mark.slow
def test_loader_resumes_through_ray(rt, consumer):
    kwargs = dict(batch_size=4, device_mesh=MESH, shuffle=True, seed=5, drop_last=True)
    loader = DataLoader(list(range(30)), remote_group="data", **kwargs)
    it = iter(loader)
    head = [consumer.take(next(it)) for _ in range(3)]
    state = loader.state_dict()
    assert (state["epoch"], state["step"]) == (0, 3)
    fresh = DataLoader(list(range(30)), remote_group="data", **kwargs)
    fresh.load_state_dict(state)
    _, rest = _drain(fresh, consumer)
    got = [r[0]["items"] + r[1]["items"] for r in (h() for h in head)] + rest
    assert got == list(DeviceMeshSampler(30, 4, device_mesh=MESH, shuffle=True, seed=5, drop_last=True))
    fresh.set_epoch(4)
    assert fresh.state_dict()["epoch"] == 4


@pytest.mark.slow
def test_ray_data_source_streams_to_dp_ranks(rt, consumer):
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.from_items([{"id": i} for i in range(49)])
    kwargs = dict(batch_size=8, device_mesh=MESH, shuffle=True, seed=2, shuffle_buffer_size=16)
    loader = DataLoader(ds, remote_group="data", **kwargs)
    parts, batches = _drain(loader, consumer)
    ids = [row["id"] for row in itertools.chain.from_iterable(batches)]
    assert sorted(ids) == list(range(49))
    assert ids != list(range(49))  # shuffled
    assert [len(b) for b in batches] == [8] * 5 + [9]  # the 1-row tail merges into the last batch
    assert [(len(p[0]), len(p[1])) for p in parts] == [(4, 4)] * 5 + [(5, 4)]
    assert loader.state_dict()["epoch"] == 1

    # Resume in the middle of epoch 1: the same rows as an uninterrupted epoch 1.
    _, epoch1 = _drain(loader, consumer)
    assert sorted(r["id"] for r in itertools.chain.from_iterable(epoch1)) == list(range(49))
    resumed = DataLoader(ds, remote_group="data", **kwargs)
    resumed.load_state_dict({**loader.state_dict(), "epoch": 1, "step": 2})
    _, rest = _drain(resumed, consumer)
    assert rest == epoch1[2:]


@pytest.mark.slow
def test_ray_data_source_is_read_as_a_stream(rt, consumer):
    """A billion rows (8 GB as int64) cannot be materialised here: only a stream finishes."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    source = ray.data.range(10**9, override_num_blocks=1000, concurrency=1)  # one read task at a time
    loader = DataLoader(source, batch_size=4, device_mesh=MESH, remote_group="data")
    it = iter(loader)
    outs = [consumer.take(next(it)) for _ in range(2)]
    assert [r["items"] for r in outs[1]()] == [[{"id": 4}, {"id": 5}], [{"id": 6}, {"id": 7}]]
