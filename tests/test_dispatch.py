"""Dispatch / collect semantics (pure: no Ray)."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

from twinkle_ray.core.dispatch import (
    COLLECT_MODES,
    DISPATCH_MODES,
    EXECUTE_MODES,
    batch_len,
    check_collect,
    check_dispatch,
    check_execute,
    collect,
    concat,
    dispatch,
    split_sizes,
    take,
    worker_global_rank,
)

ROOT = Path(__file__).resolve().parents[1]


class FakeMesh:
    """A (pp, dp, tp) mesh, tp innermost: rank = (pp_i * dp + dp_i) * tp + tp_i.

    ``has_pp=False`` drops the pp dim (``get_pp_last_ranks`` then returns every rank, as
    Twinkle's mesh does without pp).
    """

    def __init__(self, pp: int = 1, dp: int = 1, tp: int = 1, has_pp: bool = True):
        self.pp, self.dp, self.tp, self.has_pp = pp, dp, tp, has_pp
        self.world_size = pp * dp * tp
        self.data_world_size = dp

    def _coord(self, g: int) -> tuple[int, int, int]:
        if not 0 <= g < self.world_size:
            raise ValueError(f'rank {g} is not in the mesh of {self.world_size} ranks')
        pp_i, rest = divmod(g, self.dp * self.tp)
        dp_i, tp_i = divmod(rest, self.tp)
        return pp_i, dp_i, tp_i

    def get_data_rank_from_global_rank(self, g: int) -> int:
        return self._coord(g)[1]

    def get_pp_last_ranks(self) -> list[int]:
        if not self.has_pp:
            return list(range(self.world_size))
        return [g for g in range(self.world_size) if self._coord(g)[0] == self.pp - 1]

    def get_slice(self, n: int, rank: int | None = None) -> slice:  # a data rank, as in Twinkle
        k, m = divmod(n, self.dp)
        return slice(rank * k + min(rank, m), (rank + 1) * k + min(rank + 1, m))


def firsts(calls):
    return [args[0] for args, _ in calls]


# ------------------------------------------------------------------ mode checks


def test_mode_tuples():
    assert DISPATCH_MODES == ('slice', 'all', 'slice_dp', 'balance')
    assert EXECUTE_MODES == ('all', 'first', 'peer')
    assert COLLECT_MODES == ('none', 'flatten', 'mean', 'sum', 'first', 'last_pp', 'last_pp_first')


@pytest.mark.parametrize('mode', [*DISPATCH_MODES, lambda n, i, a, k, m: (a, k)])
def test_check_dispatch_accepts(mode):
    check_dispatch(mode)


@pytest.mark.parametrize('mode', [*COLLECT_MODES, lambda results, mesh: results])
def test_check_collect_accepts(mode):
    check_collect(mode)


@pytest.mark.parametrize('mode', EXECUTE_MODES)
def test_check_execute_accepts(mode):
    check_execute(mode)


def test_check_dispatch_rejects_and_lists_modes():
    with pytest.raises(ValueError, match=r"unknown dispatch mode 'split'; expected one of 'slice', 'all', 'slice_dp', 'balance' or a callable"):
        check_dispatch('split')
    with pytest.raises(ValueError, match='unknown dispatch mode None'):
        check_dispatch(None)


def test_check_collect_rejects_and_lists_modes():
    with pytest.raises(ValueError, match=r"unknown collect mode 'avg'.*'none', 'flatten', 'mean', 'sum', 'first', 'last_pp', 'last_pp_first' or a callable"):
        check_collect('avg')


def test_check_execute_rejects_callable_and_unknown():
    with pytest.raises(ValueError, match=r"unknown execute mode 'last'; expected one of 'all', 'first', 'peer'$"):
        check_execute('last')
    with pytest.raises(ValueError, match='unknown execute mode'):
        check_execute(lambda: None)


def test_dispatch_and_collect_reject_unknown_modes():
    with pytest.raises(ValueError, match="unknown dispatch mode 'dp'"):
        dispatch('dp', 2, ([1, 2],), {})
    with pytest.raises(ValueError, match="unknown collect mode 'concat'"):
        collect('concat', [[1], [2]])


def test_worker_global_rank():
    assert [worker_global_rank(i) for i in range(4)] == [0, 1, 2, 3]
    assert [worker_global_rank(i, 2) for i in range(4)] == [0, 2, 4, 6]
    with pytest.raises(ValueError, match='gpus_per_worker must be >= 1, got 0'):
        worker_global_rank(1, 0)
    with pytest.raises(ValueError, match='worker index must be >= 0, got -1'):
        worker_global_rank(-1)


# ------------------------------------------------------------------ helpers


def test_split_sizes():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(8, 4) == [2, 2, 2, 2]
    assert split_sizes(3, 5) == [1, 1, 1, 0, 0]
    assert split_sizes(0, 2) == [0, 0]
    with pytest.raises(ValueError, match='cannot split into 0 parts'):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match=r'negative number of items \(-1\)'):
        split_sizes(-1, 2)


def test_batch_len():
    assert batch_len([1, 2, 3]) == 3
    assert batch_len((1, 2)) == 2
    assert batch_len(np.zeros((5, 3))) == 5
    assert batch_len(torch.zeros(7, 2)) == 7
    assert batch_len({'a': [1, 2], 'b': np.zeros((2, 4)), 'c': 0.5, 'd': {'e': torch.ones(2)}}) == 2
    for scalar in ('abc', b'ab', 3, 2.5, None, np.float32(1.0), np.array(3.0), torch.tensor(1.0), {'x': 1}, {1, 2}):
        assert batch_len(scalar) is None, scalar


def test_batch_len_dict_with_different_lengths():
    with pytest.raises(ValueError, match=r"different batch lengths \(\['a'\]: 2, \['b'\]\['c'\]: 3\)"):
        batch_len({'a': [1, 2], 'b': {'c': [1, 2, 3]}})


def test_take_each_type():
    assert take([0, 1, 2, 3], 1, 3) == [1, 2]
    assert take((0, 1, 2, 3), 1, 3) == (1, 2)
    arr = np.arange(12).reshape(6, 2)
    part = take(arr, 2, 4)
    assert part.tolist() == [[4, 5], [6, 7]]
    assert np.shares_memory(part, arr)  # a view, no copy
    t = torch.arange(6)
    assert take(t, 4, 6).tolist() == [4, 5]
    assert take('abcdef', 0, 2) == 'abcdef'  # a scalar: replicated
    assert take(7, 0, 1) == 7
    d = {'ids': [1, 2, 3, 4], 'mask': np.ones((4, 2)), 'temp': 0.7, 'sub': {'x': (9, 8, 7, 6)}}
    got = take(d, 1, 3)
    assert got['ids'] == [2, 3]
    assert got['mask'].shape == (2, 2)
    assert got['temp'] == 0.7
    assert got['sub'] == {'x': (8, 7)}
    assert d['ids'] == [1, 2, 3, 4]  # input untouched


def test_concat_each_type():
    assert concat([[1, 2], (3,), [4]]) == [1, 2, 3, 4]
    out = concat([np.array([[1, 2]]), np.array([[3, 4], [5, 6]])])
    assert isinstance(out, np.ndarray) and out.tolist() == [[1, 2], [3, 4], [5, 6]]
    out = concat([torch.tensor([1, 2]), torch.tensor([3])])
    assert isinstance(out, torch.Tensor) and out.tolist() == [1, 2, 3]
    single = np.arange(3)
    assert concat([single]) is single
    assert concat([]) == []


def test_concat_dicts_key_wise():
    got = concat([
        {'ids': [1], 'x': np.array([1.0]), 'step': 3, 'loss': 0.5, 'sub': {'t': torch.tensor([1])}},
        {'ids': [2, 3], 'x': np.array([2.0, 3.0]), 'step': 3, 'loss': 0.25, 'sub': {'t': torch.tensor([2, 3])}},
    ])
    assert got['ids'] == [1, 2, 3]
    assert got['x'].tolist() == [1.0, 2.0, 3.0]
    # a per-piece scalar is one value per piece, equal or not: the joined value's shape never
    # depends on the data (a replicated 3 collapsing to 3 while 3, 4 gave [3, 4] broke callers)
    assert got['step'] == [3, 3]
    assert got['loss'] == [0.5, 0.25]
    assert got['sub']['t'].tolist() == [1, 2, 3]


def test_concat_mixed_sequence_types_gives_item_list():
    got = concat([[1, 2], np.array([3, 4]), torch.tensor([5])])
    assert isinstance(got, list) and len(got) == 5
    assert [int(x) for x in got] == [1, 2, 3, 4, 5]


def test_concat_of_scalars_is_their_list():
    assert concat([0.5, 1.5, 0.5]) == [0.5, 1.5, 0.5]
    assert concat([None, None]) == [None, None]
    assert collect('flatten', [1, 2]) == [1, 2]


def test_concat_rejects_scalars_and_dict_mix():
    with pytest.raises(TypeError, match='piece 1 of type int: it has no batch dimension'):
        concat([[1], 5])
    with pytest.raises(TypeError, match='piece 0 of type NoneType'):
        concat([None, [1]])
    with pytest.raises(TypeError, match=r'cannot concatenate a dict \(piece 1\) with non-dict pieces'):
        concat([[1], {'a': [2]}])


@pytest.mark.parametrize('parts', [1, 3, 4])
def test_take_concat_round_trip(parts):
    batch = {
        'ids': list(range(10)),
        'x': np.arange(20).reshape(10, 2),
        't': torch.arange(10),
        'temperature': 0.7,
        'meta': {'names': tuple(f'n{i}' for i in range(10)), 'tag': 'run'},
    }
    bounds, start = [], 0
    for size in split_sizes(10, parts):
        bounds.append((start, start + size))
        start += size
    back = concat([take(batch, a, b) for a, b in bounds])
    assert back['ids'] == batch['ids']
    assert back['x'].tolist() == batch['x'].tolist()
    assert back['t'].tolist() == batch['t'].tolist()
    # scalars ride along with each piece and come back one per piece (never collapsed)
    assert back['temperature'] == [0.7] * parts
    assert back['meta'] == {'names': list(batch['meta']['names']), 'tag': ['run'] * parts}


# ------------------------------------------------------------------ dispatch: slice / all


def test_slice_10_over_4():
    cfg = {'greedy': True}
    calls = dispatch('slice', 4, (list(range(10)), cfg), {'temperature': 0.5}, method='sample', group='sampler')
    assert len(calls) == 4
    assert firsts(calls) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    for args, kwargs in calls:
        assert args[1] is cfg  # non-lists go whole (same object)
        assert kwargs == {'temperature': 0.5}


def test_slice_splits_list_kwargs_the_same_way():
    calls = dispatch('slice', 3, (), {'prompts': list('abcdefg'), 'ids': list(range(7)), 'n': 2})
    assert [k['prompts'] for _, k in calls] == [list('abc'), list('de'), list('fg')]
    assert [k['ids'] for _, k in calls] == [[0, 1, 2], [3, 4], [5, 6]]
    assert all(k['n'] == 2 for _, k in calls)


def test_slice_leaves_tuples_arrays_and_tensors_whole():
    tup, arr, ten = (1, 2, 3, 4), np.arange(4), torch.arange(4)
    calls = dispatch('slice', 2, ([1, 2], tup, arr, ten), {})
    for args, _ in calls:
        assert args[1] is tup and args[2] is arr and args[3] is ten
    assert firsts(calls) == [[1], [2]]


def test_slice_without_lists_shares_one_call():
    calls = dispatch('slice', 3, (1, 'x'), {'k': 2})
    assert calls[0] == ((1, 'x'), {'k': 2})
    assert calls[0] is calls[1] is calls[2]


def test_slice_lists_of_different_lengths():
    with pytest.raises(ValueError, match=(
        r"train_step\(\) on group 'trainer': dispatch='slice'.*lengths differ "
        r"\(argument 0: 4, argument 'labels': 3\)"
    )):
        dispatch('slice', 2, ([1, 2, 3, 4],), {'labels': [1, 2, 3]}, method='train_step', group='trainer')


def test_slice_batch_smaller_than_workers():
    with pytest.raises(ValueError, match=(
        r"sample\(\) on group 'sampler': batch of 3 items is smaller than the data-parallel size 4 "
        r"\(argument 0; dispatch='slice' over 4 workers\)"
    )):
        dispatch('slice', 4, ([1, 2, 3],), {}, method='sample', group='sampler')


def test_all_gives_every_worker_the_same_objects():
    batch = list(range(10))
    calls = dispatch('all', 3, (batch,), {'k': np.ones(3)})
    assert len(calls) == 3
    for args, _ in calls:
        assert args[0] is batch
    assert calls[0] is calls[2]


def test_dispatch_needs_a_worker():
    with pytest.raises(ValueError, match=r"f\(\) on group 'g': need at least one worker, got n_workers=0"):
        dispatch('all', 0, (), {}, method='f', group='g')


# ------------------------------------------------------------------ dispatch: slice_dp


def test_slice_dp_without_mesh_splits_by_worker():
    calls = dispatch('slice_dp', 4, (list(range(10)),), {})
    assert firsts(calls) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_slice_dp_every_sliceable_type():
    args = (list(range(6)), tuple(range(6)), np.arange(12).reshape(6, 2), torch.arange(6), 'greedy', 3, None)
    calls = dispatch('slice_dp', 2, args, {'scale': 0.5})
    (a0, k0), (a1, k1) = calls
    assert a0[0] == [0, 1, 2] and a1[0] == [3, 4, 5]
    assert a0[1] == (0, 1, 2) and a1[1] == (3, 4, 5)
    assert a0[2].tolist() == [[0, 1], [2, 3], [4, 5]] and a1[2].tolist() == [[6, 7], [8, 9], [10, 11]]
    assert a0[3].tolist() == [0, 1, 2] and a1[3].tolist() == [3, 4, 5]
    assert a0[4:] == ('greedy', 3, None) and a1[4:] == ('greedy', 3, None)
    assert k0 == k1 == {'scale': 0.5}


def test_slice_dp_pp2_dp2_tp2_mesh():
    mesh = FakeMesh(pp=2, dp=2, tp=2)
    calls = dispatch('slice_dp', 8, (list(range(10)),), {}, device_mesh=mesh, method='forward', group='trainer')
    got = firsts(calls)
    for g in (0, 1, 4, 5):
        assert got[g] == [0, 1, 2, 3, 4]
    for g in (2, 3, 6, 7):
        assert got[g] == [5, 6, 7, 8, 9]


def test_slice_dp_peers_share_identical_objects():
    mesh = FakeMesh(pp=2, dp=2, tp=2)
    calls = dispatch('slice_dp', 8, (list(range(10)), np.arange(10)), {'mask': torch.ones(10)}, device_mesh=mesh)
    # tp and pp peers of data rank 0 get the very same call (one ray.put per data rank)
    assert calls[0] is calls[1] is calls[4] is calls[5]
    assert calls[2] is calls[3] is calls[6] is calls[7]
    assert calls[0] is not calls[2]
    assert calls[0][0][1] is calls[5][0][1]


def test_slice_dp_gpus_per_worker_maps_worker_i_to_rank_2i():
    # 4 workers of 2 GPUs each over a (pp=2, dp=2, tp=2) mesh: workers are global ranks 0, 2, 4, 6
    mesh = FakeMesh(pp=2, dp=2, tp=2)
    calls = dispatch('slice_dp', 4, (list(range(10)),), {}, device_mesh=mesh, gpus_per_worker=2)
    assert firsts(calls) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert calls[0] is calls[2] and calls[1] is calls[3]


def test_slice_dp_dicts_key_by_key():
    mesh = FakeMesh(dp=2, tp=2)
    batch = {
        'input_ids': torch.arange(10).reshape(5, 2),
        'labels': list('abcde'),
        'extra': {'w': np.arange(5), 'name': 'b'},
        'temperature': 0.7,
    }
    settings = {'top_k': 5}
    calls = dispatch('slice_dp', 4, (batch,), {'settings': settings}, device_mesh=mesh)
    first, second = calls[0][0][0], calls[2][0][0]
    assert first['input_ids'].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert second['input_ids'].tolist() == [[6, 7], [8, 9]]
    assert first['labels'] == ['a', 'b', 'c'] and second['labels'] == ['d', 'e']
    assert first['extra']['w'].tolist() == [0, 1, 2] and second['extra']['w'].tolist() == [3, 4]
    assert first['extra']['name'] == second['extra']['name'] == 'b'
    assert first['temperature'] == second['temperature'] == 0.7
    # a dict without sliceable values is handed on as is
    assert calls[0][1]['settings'] is settings and calls[3][1]['settings'] is settings


def test_slice_dp_with_real_mesh():
    from twinkle_ray.core.mesh import DeviceMesh

    mesh = DeviceMesh.from_sizes(pp_size=2, dp_size=2, tp_size=2)
    calls = dispatch('slice_dp', 8, (np.arange(10),), {}, device_mesh=mesh)
    got = [a[0].tolist() for a, _ in calls]
    assert [got[g] for g in (0, 1, 4, 5)] == [[0, 1, 2, 3, 4]] * 4
    assert [got[g] for g in (2, 3, 6, 7)] == [[5, 6, 7, 8, 9]] * 4
    calls = dispatch('slice_dp', 4, (list(range(9)),), {}, device_mesh=mesh, gpus_per_worker=2)
    assert firsts(calls) == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.mark.parametrize(
    ('value', 'where'),
    [
        ([1, 2, 3], 'argument 0'),
        ((1, 2, 3), 'argument 0'),
        (np.zeros((3, 5)), 'argument 0'),
        (torch.zeros(3, 5), 'argument 0'),
        ({'input_ids': torch.zeros(3, 2), 'temperature': 1.0}, "argument 0 key 'input_ids'"),
        ({'nested': {'ids': [1, 2, 3]}}, "argument 0 key 'nested' key 'ids'"),
    ],
    ids=['list', 'tuple', 'ndarray', 'tensor', 'dict', 'nested-dict'],
)
def test_slice_dp_batch_too_small_for_every_type(value, where):
    mesh = FakeMesh(dp=4)
    expected = (
        r"train_step\(\) on group 'trainer': batch of 3 items is smaller than the data-parallel size 4 "
        rf'\({where}\)'
    )
    with pytest.raises(ValueError, match=expected):
        dispatch('slice_dp', 4, (value,), {}, device_mesh=mesh, method='train_step', group='trainer')


def test_slice_dp_too_small_kwarg_is_named():
    with pytest.raises(ValueError, match=r"batch of 1 items is smaller than the data-parallel size 2 \(argument 'prompts'\)"):
        dispatch('slice_dp', 2, (), {'prompts': ['hi']}, method='sample', group='sampler')


def test_slice_dp_size_check_runs_before_any_slicing():
    calls = []

    class Spy(list):
        def __getitem__(self, item):
            calls.append(item)
            return super().__getitem__(item)

    with pytest.raises(ValueError, match='batch of 1 items'):
        dispatch('slice_dp', 2, (Spy(range(8)), [1]), {})
    assert calls == []


def test_slice_dp_worker_outside_mesh():
    with pytest.raises(ValueError, match=(
        r"forward\(\) on group 'trainer': worker 3 maps to global rank 6 \(gpus_per_worker=2\) "
        r'but the device mesh has only 4 ranks'
    )):
        dispatch('slice_dp', 4, ([1, 2, 3, 4],), {}, device_mesh=FakeMesh(dp=4), gpus_per_worker=2,
                 method='forward', group='trainer')


def test_slice_dp_workers_that_miss_data_ranks():
    with pytest.raises(ValueError, match=(
        r"cover data ranks \[0\] of data-parallel size 2; the slices of data ranks \[1\] would be dropped"
    )):
        dispatch('slice_dp', 1, ([1, 2, 3, 4],), {}, device_mesh=FakeMesh(dp=2, tp=2), method='f', group='g')


def test_dispatch_never_mutates_inputs():
    mesh = FakeMesh(pp=2, dp=2, tp=2)
    args = (list(range(10)), {'ids': list(range(10)), 'x': np.arange(10.0)}, 'keep')
    kwargs = {'labels': tuple(range(10)), 't': torch.arange(10)}
    before_args, before_kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
    for mode in DISPATCH_MODES:
        calls = dispatch(mode, 8, args, kwargs, device_mesh=mesh)
        for _, k in calls:
            k['new'] = 1  # a runtime adding a key to one worker's kwargs
    assert args[0] == before_args[0] and args[1]['ids'] == before_args[1]['ids']
    assert args[1]['x'].tolist() == before_args[1]['x'].tolist() and set(args[1]) == {'ids', 'x'}
    assert kwargs.keys() == before_kwargs.keys()
    assert kwargs['t'].tolist() == list(range(10))


# ------------------------------------------------------------------ dispatch: callable


def test_callable_dispatch_gets_worker_index_and_mesh():
    mesh = FakeMesh(dp=2)
    seen = []

    def every_other(n_workers, i, args, kwargs, device_mesh):
        seen.append((n_workers, i, device_mesh))
        kwargs['worker'] = i  # may modify its copy
        return (args[0][i::n_workers],), kwargs

    batch = list(range(6))
    calls = dispatch(every_other, 2, (batch,), {'k': 1}, device_mesh=mesh)
    assert calls == [(([0, 2, 4],), {'k': 1, 'worker': 0}), (([1, 3, 5],), {'k': 1, 'worker': 1})]
    assert seen == [(2, 0, mesh), (2, 1, mesh)]
    assert batch == list(range(6))


def test_callable_dispatch_must_return_args_and_kwargs():
    def bad(n, i, args, kwargs, mesh):
        return args

    with pytest.raises(TypeError, match=(
        r"step\(\) on group 'g': dispatch function .*bad must return \(args, kwargs\).*for worker 0 it returned tuple"
    )):
        dispatch(bad, 2, (1, 2), {}, method='step', group='g')


# ------------------------------------------------------------------ collect


def test_collect_none():
    assert collect('none', [5]) == 5
    assert collect('none', [1, 2, 3]) == [1, 2, 3]
    assert collect('none', []) == []


def test_collect_first():
    assert collect('first', [{'a': 1}, {'a': 2}]) == {'a': 1}
    assert collect('first', ['only']) == 'only'


def test_collect_flatten():
    assert collect('flatten', [[1, 2], [3], [4, 5]]) == [1, 2, 3, 4, 5]
    out = collect('flatten', [np.ones((2, 3)), np.zeros((1, 3))])
    assert out.shape == (3, 3)
    out = collect('flatten', [torch.ones(2, 3), torch.zeros(2, 3)])
    assert out.shape == (4, 3) and out.sum().item() == 6
    out = collect('flatten', [{'ids': [1, 2], 'n': 2}, {'ids': [3], 'n': 1}])
    assert out == {'ids': [1, 2, 3], 'n': [2, 1]}


def test_collect_mean_and_sum_numbers():
    assert collect('mean', [1, 2, 3, 4]) == 2.5
    assert collect('sum', [1, 2, 3, 4]) == 10
    assert collect('mean', [np.float32(1.0), np.float32(2.0)]) == pytest.approx(1.5)


def test_collect_mean_and_sum_arrays_and_tensors():
    out = collect('mean', [np.array([1.0, 2.0]), np.array([3.0, 6.0])])
    assert out.tolist() == [2.0, 4.0]
    out = collect('sum', [np.array([1, 2]), np.array([3, 6])])
    assert out.tolist() == [4, 8]
    out = collect('mean', [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])])
    assert out.tolist() == [2.0, 4.0]
    out = collect('mean', [torch.tensor(1), torch.tensor(2)])  # integer tensors: float mean
    assert out.dtype == torch.get_default_dtype() and out.item() == 1.5
    out = collect('sum', [torch.tensor(1), torch.tensor(2)])
    assert out.dtype == torch.int64 and out.item() == 3


def test_collect_mean_and_sum_dicts_recursively():
    results = [
        {'loss': 1.0, 'acc': torch.tensor(0.5), 'grad': {'norm': np.array([1.0, 2.0])}, 'skip': None},
        {'loss': 3.0, 'acc': torch.tensor(1.0), 'grad': {'norm': np.array([3.0, 4.0])}, 'skip': None},
    ]
    out = collect('mean', results)
    assert out['loss'] == 2.0
    assert out['acc'].item() == pytest.approx(0.75)
    assert out['grad']['norm'].tolist() == [2.0, 3.0]
    assert out['skip'] is None
    out = collect('sum', results)
    assert out['loss'] == 4.0 and out['grad']['norm'].tolist() == [4.0, 6.0]


def test_collect_mean_of_lists_is_positionwise():
    assert collect('mean', [[1, 2], [3, 4]]) == [2.0, 3.0]
    with pytest.raises(TypeError, match=r"collect='sum': results are lists of different lengths \[2, 1\]"):
        collect('sum', [[1, 2], [3]])


def test_collect_mean_rejects_non_numbers():
    with pytest.raises(TypeError, match=r"collect='mean' cannot combine results\['name'\] of type str"):
        collect('mean', [{'name': 'a'}, {'name': 'b'}])


def test_collect_tuples_element_wise():
    results = [([1, 2], 0.5, 'w0'), ([3], 1.5, 'w1')]
    assert collect('flatten', [r[:2] for r in results]) == ([1, 2, 3], [0.5, 1.5])
    assert collect('mean', [(1.0, np.array([2.0])), (3.0, np.array([4.0]))])[0] == 2.0
    assert collect('none', results) == ([[1, 2], [3]], [0.5, 1.5], ['w0', 'w1'])
    assert collect('first', results) == ([1, 2], 0.5, 'w0')
    Out = namedtuple('Out', 'loss n')
    got = collect('sum', [Out(1.0, 2), Out(2.0, 3)])
    assert isinstance(got, Out) and got == Out(3.0, 5)


def test_collect_tuples_of_different_lengths_are_sequences():
    assert collect('flatten', [(1, 2), (3,)]) == [1, 2, 3]


def test_collect_callable_gets_results_and_mesh():
    mesh = FakeMesh(dp=2)
    seen = []

    def pick_last(results, device_mesh):
        seen.append(device_mesh)
        return results[-1]

    assert collect(pick_last, [1, 2, 3], device_mesh=mesh) == 3
    assert seen == [mesh]


def test_collect_worker_indices_must_match():
    with pytest.raises(ValueError, match='collect got 2 results but 1 worker indices'):
        collect('none', [1, 2], worker_indices=[0])


# ------------------------------------------------------------------ collect: last_pp


def test_last_pp_pp2_tp2_keeps_last_stage_one_per_data_rank():
    mesh = FakeMesh(pp=2, dp=2, tp=2)
    # what each of 8 workers (global ranks 0..7) returned for its data slice
    results = [[f'stage{g // 4}-rank{g}'] for g in range(8)]
    assert collect('last_pp', results, device_mesh=mesh) == ['stage1-rank4', 'stage1-rank6']


def test_last_pp_round_trips_a_slice_dp_batch():
    mesh = FakeMesh(pp=2, dp=2, tp=2)
    batch = np.arange(20).reshape(10, 2)
    calls = dispatch('slice_dp', 8, (batch,), {}, device_mesh=mesh)
    outputs = [args[0] * 10 for args, _ in calls]  # every worker "computes" on its slice
    out = collect('last_pp', outputs, device_mesh=mesh)
    assert out.tolist() == (batch * 10).tolist()


def test_last_pp_with_gpus_per_worker():
    mesh = FakeMesh(pp=2, dp=2, tp=2)
    # 4 workers of 2 devices: global ranks 0, 2, 4, 6; last stage = workers 2 and 3
    results = [{'logits': torch.full((2,), float(w))} for w in range(4)]
    out = collect('last_pp', results, device_mesh=mesh, gpus_per_worker=2)
    assert out['logits'].tolist() == [2.0, 2.0, 3.0, 3.0]


def test_last_pp_scalars_come_back_as_list_in_data_rank_order():
    mesh = FakeMesh(pp=2, dp=2, tp=2)
    assert collect('last_pp', [float(g) for g in range(8)], device_mesh=mesh) == [4.0, 6.0]


def test_last_pp_with_worker_indices_subset():
    mesh = FakeMesh(pp=2, dp=2, tp=1)
    # results only from workers 3 and 2 (e.g. the dispatcher kept the last stage), out of order
    assert collect('last_pp', [['b'], ['a']], device_mesh=mesh, worker_indices=[3, 2]) == ['a', 'b']


def test_last_pp_without_pp_dim():
    # no pp: every rank is on the last stage; tp peers of a data rank are one result
    mesh = FakeMesh(dp=2, tp=2, has_pp=False)
    assert collect('last_pp', [[0], [1], [2], [3]], device_mesh=mesh) == [0, 2]
    mesh = FakeMesh(dp=4, has_pp=False)
    assert collect('last_pp', [[0], [1], [2], [3]], device_mesh=mesh) == [0, 1, 2, 3]
    assert collect('last_pp', [[0], [1, 2]]) == [0, 1, 2]  # no mesh: every worker


def test_last_pp_nothing_from_the_last_stage():
    mesh = FakeMesh(pp=2, dp=2)
    with pytest.raises(ValueError, match=(
        r"collect='last_pp': none of the results comes from the last pipeline stage "
        r'\(results from global ranks \[0\]; last-stage ranks \[2, 3\]\)'
    )):
        collect('last_pp', ['x'], device_mesh=mesh, worker_indices=[0])


def test_last_pp_tuples_element_wise():
    mesh = FakeMesh(pp=2, dp=2)
    results = [([g], float(g)) for g in range(4)]
    assert collect('last_pp', results, device_mesh=mesh) == ([2, 3], [2.0, 3.0])


def test_last_pp_with_real_mesh_matches_collect_ranks():
    from twinkle_ray.core.mesh import DeviceMesh

    for sizes in ({'pp_size': 2, 'dp_size': 2, 'tp_size': 2}, {'dp_size': 2, 'tp_size': 2},
                  {'fsdp_size': 2, 'dp_size': 2}, {'pp_size': 4, 'dp_size': 2}):
        mesh = DeviceMesh.from_sizes(**sizes)
        results = [[g] for g in range(mesh.world_size)]
        assert collect('last_pp', results, device_mesh=mesh) == mesh.get_collect_ranks(), sizes
        batch = list(range(11))
        calls = dispatch('slice_dp', mesh.world_size, (batch,), {}, device_mesh=mesh)
        assert collect('last_pp', firsts(calls), device_mesh=mesh) == batch, sizes


# ------------------------------------------------------------------ purity


SPLIT_MODULES = ('dispatch', 'modes', 'batch', 'worker_ranks', 'split', 'collect')


def test_module_imports_neither_torch_nor_ray():
    """The rules and their public face import neither torch nor Ray (run in a fresh process)."""
    code = (
        'import importlib, sys\n'
        f'mods = [importlib.import_module("twinkle_ray.core." + m) for m in {SPLIT_MODULES!r}]\n'
        'assert "torch" not in sys.modules and "ray" not in sys.modules, sorted(sys.modules)\n'
        'mod = mods[0]\n'
        'calls = mod.dispatch("slice_dp", 2, ([1, 2, 3],), {})\n'
        'assert calls[0][0][0] == [1, 2] and mod.collect("flatten", [[1], [2]]) == [1, 2]\n'
    )
    subprocess.run([sys.executable, '-c', code], check=True, timeout=60, cwd=str(ROOT))


@pytest.mark.parametrize('name', SPLIT_MODULES)
def test_split_modules_run_their_examples(name):
    """Each module of the split and collect rules runs the examples of its docstrings."""
    import doctest
    import importlib

    module = importlib.import_module(f'twinkle_ray.core.{name}')
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, name


def test_the_public_face_re_exports_the_rules_themselves():
    """``core.dispatch`` holds no rule of its own: each name it exports is the object of the
    module that does that job, so an import from either path gets the same function."""
    import importlib

    from twinkle_ray.core import dispatch as face

    owners = {}
    for name in SPLIT_MODULES[1:]:
        module = importlib.import_module(f'twinkle_ray.core.{name}')
        owners.update({n: module for n in module.__all__})
    for name in face.__all__:
        assert getattr(face, name) is getattr(owners[name], name), name


