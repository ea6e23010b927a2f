"""DeviceMeshSampler / StreamBatcher: pure batching rules, no Ray."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from twinkle_ray import DeviceMesh
from twinkle_ray.sampler import DeviceMeshSampler, StreamBatcher, batch_bounds


def _epoch_items(s: DeviceMeshSampler, dws: int) -> list[list[int]]:
    """Per data rank: every index it gets in the sampler's current epoch."""
    per_rank: list[list[int]] = [[] for _ in range(dws)]
    for batch in s:
        for d in range(dws):
            per_rank[d].extend(s.rank_part(batch, d))
    return per_rank


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(
    "n,batch,dws",
    [(100, 8, 2), (101, 8, 2), (103, 12, 4), (7, 4, 4), (64, 16, 4), (33, 6, 3), (5, 3, 3), (1, 1, 1)],
)
def test_every_item_exactly_once_per_epoch(n, batch, dws, shuffle):
    s = DeviceMeshSampler(n, batch, data_world_size=dws, shuffle=shuffle, seed=3)
    for _epoch in range(2):
        per_rank = _epoch_items(s, dws)
        counts = Counter(itertools.chain.from_iterable(per_rank))
        assert sorted(counts) == list(range(n))
        assert set(counts.values()) == {1}
        assert all(per_rank), "every data rank gets items"


def test_rank_parts_match_mesh_get_slice_and_full_batches_are_even():
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2, device_type="cpu")
    s = DeviceMeshSampler(50, 8, device_mesh=mesh)
    assert s.data_world_size == 2 and s.per_rank_batch_size == 4
    batches = list(s)
    for b in batches[:-1]:
        assert [len(s.rank_part(b, d)) for d in range(2)] == [4, 4]
    for b in batches:
        for d in range(2):
            assert s.rank_part(b, d) == b[mesh.get_slice(len(b), d)]


def test_uneven_tail_is_split_divmod_style():
    s = DeviceMeshSampler(23, 8, data_world_size=4)
    batches = list(s)
    assert [len(b) for b in batches] == [8, 8, 7]
    assert [len(s.rank_part(batches[-1], d)) for d in range(4)] == [2, 2, 2, 1]


def test_tail_smaller_than_data_world_size_merges_into_previous_batch():
    s = DeviceMeshSampler(18, 8, data_world_size=4)  # tail of 2 < 4 ranks
    batches = list(s)
    assert [len(b) for b in batches] == [8, 10]
    assert sorted(itertools.chain.from_iterable(batches)) == list(range(18))
    assert [len(s.rank_part(batches[-1], d)) for d in range(4)] == [3, 3, 2, 2]


def test_drop_last():
    s = DeviceMeshSampler(23, 8, data_world_size=4, drop_last=True, shuffle=True, seed=1)
    batches = list(s)
    assert [len(b) for b in batches] == [8, 8] and len(s) == 2
    assert len(set(itertools.chain.from_iterable(batches))) == 16
    assert len(DeviceMeshSampler(3, 8, data_world_size=4, drop_last=True)) == 0


def test_bad_sizes_are_value_errors():
    with pytest.raises(ValueError, match="divisible by the data world size 4"):
        DeviceMeshSampler(10, 6, data_world_size=4)
    with pytest.raises(ValueError, match="fewer than the data world size 4"):
        DeviceMeshSampler(3, 8, data_world_size=4)
    with pytest.raises(ValueError, match="disagrees"):
        DeviceMeshSampler(10, 4, data_world_size=4, device_mesh=DeviceMesh.from_sizes(dp_size=2))
    with pytest.raises(ValueError, match="out of range"):
        DeviceMeshSampler(10, 4, data_world_size=2).rank_part([1, 2], 2)


def test_shuffle_is_seeded_and_changes_per_epoch():
    a = DeviceMeshSampler(40, 8, data_world_size=2, shuffle=True, seed=7)
    b = DeviceMeshSampler(40, 8, data_world_size=2, shuffle=True, seed=7)
    c = DeviceMeshSampler(40, 8, data_world_size=2, shuffle=True, seed=8)
    ea0, eb0, ec0 = list(a), list(b), list(c)
    assert ea0 == eb0 and ea0 != ec0
    ea1 = list(a)
    assert ea1 != ea0 and sorted(sum(ea1, [])) == list(range(40))
    assert list(DeviceMeshSampler(40, 8, data_world_size=2)) == [list(range(i, i + 8)) for i in range(0, 40, 8)]


def test_resume_mid_epoch_from_state_dict():
    ref = DeviceMeshSampler(30, 4, data_world_size=2, shuffle=True, seed=5)
    full = [list(ref) for _ in range(2)]  # two epochs

    s = DeviceMeshSampler(30, 4, data_world_size=2, shuffle=True, seed=5)
    it = iter(s)
    seen = [next(it) for _ in range(3)]
    state = s.state_dict()
    assert (state["epoch"], state["step"]) == (0, 3)

    t = DeviceMeshSampler(30, 4, data_world_size=2, shuffle=True, seed=5)
    t.load_state_dict(state)
    rest = list(t)
    assert seen + rest == full[0]
    assert list(t) == full[1]  # and the next epoch follows


def test_state_at_end_of_epoch_resumes_in_next_epoch():
    s = DeviceMeshSampler(8, 4, data_world_size=2, shuffle=True, seed=1)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()  # both batches handed out, StopIteration not yet seen
    assert (state["epoch"], state["step"]) == (1, 0)
    t = DeviceMeshSampler(8, 4, data_world_size=2, shuffle=True, seed=1)
    t.set_epoch(1)
    expected = list(t)
    t.load_state_dict(state)
    assert list(t) == expected


def test_skip_and_set_epoch_and_mismatched_state():
    ref = DeviceMeshSampler(20, 4, data_world_size=2, shuffle=True)
    epochs = [list(ref) for _ in range(3)]
    s = DeviceMeshSampler(20, 4, data_world_size=2, shuffle=True)
    s.skip(7)  # 5 batches per epoch: epoch 1, step 2
    assert (s.epoch, s.step) == (1, 2)
    assert list(s) == epochs[1][2:]
    s.set_epoch(2)
    assert list(s) == epochs[2]
    other = DeviceMeshSampler(20, 4, data_world_size=2, shuffle=True, seed=1)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(s.state_dict())


def test_rank_batches_are_the_per_rank_view():
    s = DeviceMeshSampler(21, 6, data_world_size=3, shuffle=True, seed=2)
    views = [list(s.rank_batches(d)) for d in range(3)]
    for step, batch in enumerate(list(s)):
        assert sum((views[d][step] for d in range(3)), []) == batch


@pytest.mark.parametrize("n", [0, 3, 8, 9, 11, 16, 17])
def test_stream_batcher_matches_index_sampler(n):
    batcher = StreamBatcher(4, data_world_size=2)
    try:
        expected = [list(range(a, b)) for a, b in batch_bounds(n, 4, 2, drop_last=False)]
    except ValueError:
        with pytest.raises(ValueError):
            list(batcher.batches(range(n)))
        return
    assert list(batcher.batches(range(n))) == expected
    dropped = [list(range(a, b)) for a, b in batch_bounds(n, 4, 2, drop_last=True)]
    assert list(StreamBatcher(4, data_world_size=2, drop_last=True).batches(range(n))) == dropped
    # resuming after k batches skips k * batch_size items
    if len(expected) > 1:
        assert list(batcher.batches(range(n), skip=4)) == expected[1:]


def test_an_empty_dataset_warning_says_its_own_drop_last(caplog):
    """It said drop_last=True whatever drop_last was."""
    import logging

    caplog.set_level(logging.WARNING, logger="twinkle_ray.core.sampler")
    DeviceMeshSampler(0, 4, data_world_size=2)
    [record] = caplog.records
    assert "0 item(s) with batch_size=4 and drop_last=False give no batch" in record.getMessage()


def test_numpy_integers_are_sizes_as_in_device_mesh():
    import numpy as np

    s = DeviceMeshSampler(np.int64(10), np.int32(4), data_world_size=np.int64(2))
    assert [len(b) for b in s] == [4, 4, 2] and type(s.batch_size) is int
    assert list(StreamBatcher(np.int64(4), data_world_size=np.int64(2)).batches(range(9))) == \
        [[0, 1, 2, 3], [4, 5, 6, 7, 8]]
    for bad in (True, 4.0, np.float64(4)):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            DeviceMeshSampler(10, bad, data_world_size=2)
