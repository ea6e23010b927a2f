"""DeviceGroup validation and derived placement facts (pure: no Ray)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from twinkle_ray.core.group import (
    ACCELERATORS,
    PLACEMENT_STRATEGIES,
    DeviceGroup,
    check_groups,
    normalize_device_type,
)

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ construction


def test_twinkle_constructor_forms():
    a = DeviceGroup(name='default', ranks=4, device_type='cuda')
    b = DeviceGroup('default', [0, 1, 2, 3], 'CUDA')
    assert a.num_workers == b.num_workers == 4
    assert a.device_ids == b.device_ids == [0, 1, 2, 3]
    assert a.kind == b.kind == 'gpu'
    assert b.device_type == 'CUDA'  # kept as the user wrote it
    assert DeviceGroup('d', 2).device_type == 'cuda'  # default


def test_defaults():
    g = DeviceGroup('g', 2)
    assert g.visible_devices is None
    assert g.gpus_per_worker == 1
    assert g.cpus_per_worker == 1.0
    assert g.strategy == 'PACK'
    assert g.gpus_per_node is None
    assert g.colocate_with is None
    assert g.env == {}
    assert DeviceGroup('h', 2).env is not g.env  # no shared default


@pytest.mark.parametrize(
    ('spelling', 'kind'),
    [('cuda', 'gpu'), ('CUDA', 'gpu'), ('gpu', 'gpu'), ('GPU', 'gpu'), ('Cuda', 'gpu'),
     ('cpu', 'cpu'), ('CPU', 'cpu'), ('npu', 'npu'), ('NPU', 'npu')],
)
def test_device_type_any_case(spelling, kind):
    assert normalize_device_type(spelling) == kind
    ranks = 2
    assert DeviceGroup('g', ranks, spelling).kind == kind


def test_unknown_device_type_lists_known_ones():
    with pytest.raises(ValueError, match=(
        r"DeviceGroup 'g': unknown device_type 'tpu'; known \(any case\): 'cuda', 'gpu', 'npu', 'cpu'"
    )):
        DeviceGroup('g', 2, 'tpu')
    with pytest.raises(ValueError, match="unknown device_type 'mps'"):
        normalize_device_type('mps')


def test_accelerator_table():
    assert ACCELERATORS['gpu'] == ('GPU', 'CUDA_VISIBLE_DEVICES', 'nccl')
    assert ACCELERATORS['npu'] == ('NPU', 'ASCEND_RT_VISIBLE_DEVICES', 'hccl')
    assert ACCELERATORS['cpu'] == (None, None, 'gloo')
    with pytest.raises(TypeError):
        ACCELERATORS['tpu'] = ACCELERATORS['gpu']  # read-only


@pytest.mark.parametrize(
    ('device_type', 'resource', 'env', 'backend'),
    [('cuda', 'GPU', 'CUDA_VISIBLE_DEVICES', 'nccl'),
     ('npu', 'NPU', 'ASCEND_RT_VISIBLE_DEVICES', 'hccl'),
     ('cpu', None, None, 'gloo')],
)
def test_group_accelerator_facts(device_type, resource, env, backend):
    g = DeviceGroup('g', 2, device_type)
    assert (g.resource_name, g.visible_devices_env, g.backend) == (resource, env, backend)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize('name', ['', '   ', None, 3])
def test_name_must_be_non_empty(name):
    with pytest.raises(ValueError, match='DeviceGroup name must be a non-empty string'):
        DeviceGroup(name, 2)


@pytest.mark.parametrize('ranks', [0, -2])
def test_int_ranks_must_be_positive(ranks):
    with pytest.raises(ValueError, match=rf"DeviceGroup 'g': ranks must be a positive number of devices, got {ranks}"):
        DeviceGroup('g', ranks)


def test_empty_rank_list():
    with pytest.raises(ValueError, match="DeviceGroup 'g': ranks is an empty list"):
        DeviceGroup('g', [])


def test_duplicate_ranks_are_named():
    with pytest.raises(ValueError, match=r"DeviceGroup 'g': duplicate ranks \[1, 3\] in \[0, 1, 1, 3, 3\]"):
        DeviceGroup('g', [0, 1, 1, 3, 3])


def test_negative_ranks_are_named():
    with pytest.raises(ValueError, match=r"DeviceGroup 'g': ranks must be >= 0, got negative ranks \[-1\]"):
        DeviceGroup('g', [0, -1])


@pytest.mark.parametrize('ranks', ['0,1', 2.0, None, {0: 1}, [0, 1.5], [True]])
def test_ranks_of_the_wrong_type(ranks):
    with pytest.raises(ValueError, match="DeviceGroup 'g': ranks must be"):
        DeviceGroup('g', ranks)


def test_ranks_accepts_tuples_ranges_and_numpy_ints():
    assert DeviceGroup('g', (2, 3)).ranks == [2, 3]
    assert DeviceGroup('g', range(4, 6)).ranks == [4, 5]
    g = DeviceGroup('g', list(np.arange(2)))
    assert g.ranks == [0, 1] and all(type(r) is int for r in g.ranks)
    assert DeviceGroup('g', np.int64(3)).ranks == 3


def test_devices_not_divisible_by_gpus_per_worker():
    with pytest.raises(ValueError, match=r"DeviceGroup 'vllm': 6 devices cannot be divided into workers of gpus_per_worker=4"):
        DeviceGroup('vllm', 6, gpus_per_worker=4)
    with pytest.raises(ValueError, match='3 devices cannot be divided'):
        DeviceGroup('vllm', [0, 1, 2], gpus_per_worker=2)


@pytest.mark.parametrize('gpw', [0, -1, 1.5])
def test_gpus_per_worker_at_least_one(gpw):
    with pytest.raises(ValueError, match=rf"DeviceGroup 'g': gpus_per_worker must be an integer >= 1, got {gpw}"):
        DeviceGroup('g', 2, gpus_per_worker=gpw)


def test_cpu_group_with_list_ranks():
    with pytest.raises(ValueError, match=(
        r"DeviceGroup 'loader': a CPU group takes an int \(the number of worker processes\), not a list of ranks \[0, 1\]"
    )):
        DeviceGroup('loader', [0, 1], 'CPU')


def test_cpu_group_with_gpus_per_worker():
    with pytest.raises(ValueError, match="DeviceGroup 'loader': a CPU group has no devices to share out; gpus_per_worker must be 1, got 2"):
        DeviceGroup('loader', 4, 'cpu', gpus_per_worker=2)


def test_unknown_strategy():
    with pytest.raises(ValueError, match=(
        r"DeviceGroup 'g': unknown placement strategy 'SCATTER'; expected one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"
    )):
        DeviceGroup('g', 2, strategy='SCATTER')


@pytest.mark.parametrize('strategy', PLACEMENT_STRATEGIES)
def test_known_strategies_any_case(strategy):
    assert DeviceGroup('g', 2, strategy=strategy.lower()).strategy == strategy


def test_cpus_per_worker_not_negative():
    with pytest.raises(ValueError, match=r"DeviceGroup 'g': cpus_per_worker must be a number >= 0, got -1"):
        DeviceGroup('g', 2, cpus_per_worker=-1)
    with pytest.raises(ValueError, match="cpus_per_worker must be a number >= 0, got '2'"):
        DeviceGroup('g', 2, cpus_per_worker='2')
    with pytest.raises(ValueError, match=r"DeviceGroup 'c': a CPU group needs cpus_per_worker > 0"):
        DeviceGroup('c', 2, 'cpu', cpus_per_worker=0)


def test_gpus_per_node_validation():
    with pytest.raises(ValueError, match="DeviceGroup 'g': gpus_per_node must be an integer >= 1, got 0"):
        DeviceGroup('g', [0, 1], gpus_per_node=0)


def test_worker_devices_must_be_on_one_node():
    with pytest.raises(ValueError, match=(
        r"DeviceGroup 'g': worker 1 would own devices \[3, 4\] on nodes \[0, 1\] \(gpus_per_node=4\)"
    )):
        DeviceGroup('g', [1, 2, 3, 4], gpus_per_worker=2, gpus_per_node=4)


def test_colocate_with_itself():
    with pytest.raises(ValueError, match="DeviceGroup 'g': colocate_with names the group itself"):
        DeviceGroup('g', 2, colocate_with='g')


def test_env_must_be_strings():
    with pytest.raises(ValueError, match="DeviceGroup 'g': env must be a dict of str to str"):
        DeviceGroup('g', 2, env={'NCCL_DEBUG': 1})
    assert DeviceGroup('g', 2, env={'NCCL_DEBUG': 'INFO'}).env == {'NCCL_DEBUG': 'INFO'}


def test_visible_devices():
    g = DeviceGroup('g', 2, visible_devices='8,9')
    assert g.visible_device_ids == [8, 9]
    assert DeviceGroup('g', 2, visible_devices=' 8, 9 ,10').visible_device_ids == [8, 9, 10]
    with pytest.raises(ValueError, match=r"DeviceGroup 'g': visible_devices must be comma-separated device ids like \"8,9\", got 'a,b'"):
        DeviceGroup('g', 2, visible_devices='a,b')
    with pytest.raises(ValueError, match="visible_devices '8,8' repeats a device"):
        DeviceGroup('g', 2, visible_devices='8,8')
    with pytest.raises(ValueError, match=r"DeviceGroup 'g': asks for 4 devices but visible_devices='8,9' lists only 2"):
        DeviceGroup('g', 4, visible_devices='8,9')
    with pytest.raises(ValueError, match="DeviceGroup 'c': a CPU group has no devices"):
        DeviceGroup('c', 2, 'cpu', visible_devices='0')


# ------------------------------------------------------------------ derived facts


def test_gpu_group_derived():
    g = DeviceGroup('sampler', 4, 'cuda', gpus_per_worker=2, cpus_per_worker=4)
    assert g.num_devices == 4
    assert g.num_workers == 2
    assert g.device_ids == [0, 1, 2, 3]
    assert g.bundles() == [{'GPU': 2, 'CPU': 4}, {'GPU': 2, 'CPU': 4}]
    assert g.worker_devices(0) == [0, 1] and g.worker_devices(1) == [2, 3]
    assert not g.explicit_ranks
    assert g.node_of_worker(1) is None  # Ray decides


def test_bundles_are_independent_dicts():
    bundles = DeviceGroup('g', 2).bundles()
    bundles[0]['GPU'] = 99
    assert bundles[1] == {'GPU': 1, 'CPU': 1.0}
    assert DeviceGroup('g', 2).bundles() == [{'GPU': 1, 'CPU': 1.0}] * 2


def test_bundles_use_whole_devices_and_skip_zero_cpu():
    assert DeviceGroup('g', 1, cpus_per_worker=0).bundles() == [{'GPU': 1}]
    assert DeviceGroup('g', 2, cpus_per_worker=0.5).bundles() == [{'GPU': 1, 'CPU': 0.5}] * 2


def test_npu_group_derived():
    g = DeviceGroup('n', [0, 1, 2, 3], 'NPU', gpus_per_worker=2)
    assert g.bundles() == [{'NPU': 2, 'CPU': 1.0}, {'NPU': 2, 'CPU': 1.0}]
    assert g.visible_devices_env == 'ASCEND_RT_VISIBLE_DEVICES'
    assert g.backend == 'hccl'


def test_cpu_group_derived():
    g = DeviceGroup('reward', 3, 'CPU', cpus_per_worker=2)
    assert g.kind == 'cpu' and g.is_cpu
    assert g.num_devices == 0
    assert g.num_workers == 3
    assert g.device_ids == []
    assert g.bundles() == [{'CPU': 2}] * 3
    assert g.worker_devices(2) == []
    assert g.resource_name is None and g.visible_devices_env is None and g.backend == 'gloo'


def test_explicit_ranks_across_nodes():
    g = DeviceGroup('trainer', [6, 7, 8, 9], gpus_per_worker=2, gpus_per_node=8)
    assert g.explicit_ranks
    assert g.worker_devices(0) == [6, 7] and g.worker_devices(1) == [8, 9]
    assert g.worker_local_devices(0) == [6, 7] and g.worker_local_devices(1) == [0, 1]
    assert g.node_of_worker(0) == 0 and g.node_of_worker(1) == 1
    h = DeviceGroup('x', [8, 9])
    assert h.node_of_worker(0) is None  # no gpus_per_node: unknown
    assert h.worker_local_devices(1) == [9]


def test_worker_index_out_of_range():
    g = DeviceGroup('g', 4, gpus_per_worker=2)
    with pytest.raises(IndexError, match="DeviceGroup 'g' has 2 workers; no worker 2"):
        g.worker_devices(2)
    with pytest.raises(IndexError, match='no worker -1'):
        g.node_of_worker(-1)


# ------------------------------------------------------------------ check_groups


def test_check_groups_indexes_by_name():
    a, b, c = DeviceGroup('a', [0, 1]), DeviceGroup('b', [2, 3]), DeviceGroup('c', 2, 'cpu')
    assert check_groups([a, b, c]) == {'a': a, 'b': b, 'c': c}
    assert check_groups([]) == {}


def test_check_groups_duplicate_names():
    with pytest.raises(ValueError, match="two device groups are named 'a'"):
        check_groups([DeviceGroup('a', 1), DeviceGroup('a', 2)])


def test_check_groups_overlap_names_both_and_the_ids():
    with pytest.raises(ValueError, match=(
        r"DeviceGroups 'sampler' and 'trainer' both claim devices \[2, 3\]; "
        r"give them disjoint ranks or set colocate_with='sampler' on 'trainer'"
    )):
        check_groups([DeviceGroup('sampler', [0, 1, 2, 3]), DeviceGroup('trainer', [2, 3, 4, 5])])


def test_check_groups_colocation_allows_overlap_either_way():
    check_groups([DeviceGroup('sampler', [0, 1]), DeviceGroup('trainer', [0, 1], colocate_with='sampler')])
    check_groups([DeviceGroup('sampler', [0, 1], colocate_with='trainer'), DeviceGroup('trainer', [0, 1])])


def test_check_groups_colocation_is_pairwise():
    with pytest.raises(ValueError, match=r"'b' and 'c' both claim devices \[0\]"):
        check_groups([
            DeviceGroup('a', [0]),
            DeviceGroup('b', [0], colocate_with='a'),
            DeviceGroup('c', [0], colocate_with='a'),
        ])


def test_check_groups_unknown_colocate_with():
    with pytest.raises(ValueError, match=(
        r"DeviceGroup 'trainer': colocate_with='actor' names no group \(groups: 'sampler', 'trainer'\)"
    )):
        check_groups([DeviceGroup('sampler', 2), DeviceGroup('trainer', 2, colocate_with='actor')])


def test_check_groups_int_ranks_and_other_kinds_never_overlap():
    check_groups([DeviceGroup('a', 4), DeviceGroup('b', 4), DeviceGroup('c', [0, 1])])
    check_groups([DeviceGroup('g', [0, 1], 'cuda'), DeviceGroup('n', [0, 1], 'npu')])


def test_check_groups_gpus_per_node_disagreement():
    with pytest.raises(ValueError, match=r"DeviceGroups 'a' and 'b' disagree on gpus_per_node \(8 vs 4\)"):
        check_groups([DeviceGroup('a', [0], gpus_per_node=8), DeviceGroup('b', [4], gpus_per_node=4)])


def test_check_groups_overlap_across_nodes():
    a = DeviceGroup('a', [8, 9], gpus_per_node=8)
    b = DeviceGroup('b', [9, 10], gpus_per_node=8)
    with pytest.raises(ValueError, match=r"both claim devices \[9\]"):
        check_groups([a, b])


def test_check_groups_rejects_non_groups():
    with pytest.raises(TypeError, match='expected DeviceGroup, got dict'):
        check_groups([{'name': 'a', 'ranks': 2}])


def test_module_imports_neither_torch_nor_ray():
    # the package's __init__ files are skipped (empty stand-ins): only group.py and what it imports run
    code = (
        'import sys, types\n'
        f'root = {str(ROOT / "twinkle_ray")!r}\n'
        'for name, path in (("twinkle_ray", root), ("twinkle_ray.core", root + "/core")):\n'
        '    stub = types.ModuleType(name); stub.__path__ = [path]; sys.modules[name] = stub\n'
        'import twinkle_ray.core.group as mod\n'
        'assert "torch" not in sys.modules and "ray" not in sys.modules\n'
        'assert mod.DeviceGroup("g", 2).bundles() == [{"GPU": 1, "CPU": 1.0}] * 2\n'
    )
    subprocess.run([sys.executable, '-c', code], check=True, timeout=60)


def test_accelerators_module_examples_and_old_import_path():
    """The accelerator table's own module runs its example; core.group still exports it."""
    import doctest

    import twinkle_ray.core.accelerators as acc
    import twinkle_ray.core.group as group

    result = doctest.testmod(acc)
    assert result.failed == 0 and result.attempted > 0
    assert group.ACCELERATORS is acc.ACCELERATORS and group.normalize_device_type is acc.normalize_device_type
