"""NeMo-style mesh factories against NeMo Automodel runs
(/work/shared/reference/mesh_ground_truth.md, cases 19-28 and 30)."""

from __future__ import annotations

import pytest

from twinkle_ray.core.mesh import DeviceMesh
from twinkle_ray.mesh_factory import (
    FSDP2_DIMS,
    create_device_mesh,
    create_fsdp2_mesh,
    create_megatron_fsdp_mesh,
    create_moe_mesh,
)


def test_case19_hsdp_tp2_replicate2():
    m = create_fsdp2_mesh(world_size=8, tp_size=2, dp_replicate_size=2)
    assert isinstance(m, DeviceMesh)
    assert m.shape == (1, 2, 2, 1, 2) and m.mesh_dim_names == FSDP2_DIMS
    assert (m.get_dim_size("dp"), m.get_dim_size("dp_shard_cp"), m.get_dim_size("dp_cp")) == (
        4,
        2,
        4,
    )
    assert m.get_coordinate(5) == (0, 1, 0, 0, 1)
    assert m.get_group_ranks("dp_replicate", 5) == [1, 5]
    assert m.get_group_ranks("dp_shard", 5) == [5, 7]
    assert m.get_group_ranks("tp", 5) == [4, 5]
    assert m.get_group_ranks("dp", 5) == [1, 3, 5, 7]
    assert m.get_local_rank("dp", 5) == 2
    assert m.get_group_ranks("dp_shard_cp", 5) == [5, 7]
    assert m.get_group_ranks("dp_cp", 5) == [1, 3, 5, 7]
    # data rank is the flattened dp index; tp peers share it
    assert m.data_world_size == 4
    assert [m.get_data_rank_from_global_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert m.get_slice(10, m.get_data_rank_from_global_rank(5)) == slice(6, 8)
    assert m.get_collect_ranks() == [0, 2, 4, 6]


def test_case19_flattened_dp_is_dp_rank(monkeypatch):
    m = create_fsdp2_mesh(world_size=8, tp_size=2, dp_replicate_size=2)
    monkeypatch.setenv("RANK", "5")
    assert (m.dp_rank, m.dp_world_size, m.tp_rank, m.pp_rank) == (2, 4, 1, 0)
    assert m.data_rank == 2
    assert m.get_dim_groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_case20_pp2_tp2():
    m = create_fsdp2_mesh(world_size=8, pp_size=2, tp_size=2)
    assert m.shape == (2, 1, 2, 1, 2)
    assert m.get_group_ranks("pp", 6) == [2, 6]
    assert m.get_group_ranks("dp_shard", 6) == [4, 6]
    assert m.get_group_ranks("tp", 6) == [6, 7]
    for name in ("dp", "dp_shard_cp", "dp_cp"):
        assert m.get_dim_size(name) == 2
        assert m.get_group_ranks(name, 6) == [4, 6]
    assert m.get_pp_last_ranks() == [4, 5, 6, 7]
    assert m.get_collect_ranks() == [4, 6]


def test_case21_cp2_tp2():
    m = create_fsdp2_mesh(world_size=8, cp_size=2, tp_size=2)
    assert m.shape == (1, 1, 2, 2, 2)
    assert m.get_group_ranks("dp_shard", 3) == [3, 7]
    assert m.get_group_ranks("cp", 3) == [1, 3]
    assert m.get_group_ranks("tp", 3) == [2, 3]
    assert m.get_group_ranks("dp", 3) == [3, 7] and m.get_dim_size("dp") == 2
    assert (
        m.get_group_ranks("dp_shard_cp", 3) == [1, 3, 5, 7] and m.get_dim_size("dp_shard_cp") == 4
    )
    assert m.get_group_ranks("dp_cp", 3) == [1, 3, 5, 7] and m.get_dim_size("dp_cp") == 4
    assert m.data_world_size == 2  # cp ranks share data


def test_case22_defaults():
    mesh, moe = create_device_mesh("fsdp2", world_size=8)
    assert mesh.shape == (1, 1, 8, 1, 1)
    for name in ("dp", "dp_shard_cp", "dp_cp"):
        assert mesh.get_group_ranks(name, 0) == list(range(8))
    assert moe is None


def test_case23_moe_ep4():
    mesh, moe = create_device_mesh("fsdp2", world_size=8, ep_size=4)
    assert mesh.shape == (1, 1, 8, 1, 1)
    assert moe.mesh_dim_names == ("ep_shard", "ep")
    assert moe.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert moe.get_coordinate(6) == (1, 2)
    assert moe.get_group_ranks("ep", 6) == [4, 5, 6, 7]
    assert moe.get_group_ranks("ep_shard", 6) == [2, 6]


def test_case24_moe_per_pipeline_stage():
    mesh, moe = create_device_mesh("fsdp2", world_size=8, pp_size=2, ep_size=2)
    assert mesh.shape == (2, 1, 4, 1, 1)
    assert create_moe_mesh(world_size=8, pp_size=2, ep_size=2, stage=0).mesh.tolist() == [
        [0, 1],
        [2, 3],
    ]
    stage1 = create_moe_mesh(world_size=8, pp_size=2, ep_size=2, stage=1)
    assert stage1.mesh.tolist() == [[4, 5], [6, 7]] and stage1.mesh_dim_names == ("ep_shard", "ep")
    for m in (stage1, moe):  # the per-stage view and the gang-wide (pp, ep_shard, ep) view agree
        assert m.get_group_ranks("ep", 5) == [4, 5]
        assert m.get_group_ranks("ep_shard", 5) == [5, 7]
    assert moe.mesh_dim_names == ("pp", "ep_shard", "ep") and moe.shape == (2, 2, 2)
    assert create_moe_mesh(world_size=8, ep_size=8).shape == (1, 8)


def test_case25_moe_tp2_ep4():
    moe = create_moe_mesh(world_size=8, tp_size=2, ep_size=4)
    assert moe.shape == (2, 4)
    assert moe.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_case27_megatron_fsdp():
    m = create_megatron_fsdp_mesh(world_size=8, tp_size=2, cp_size=2)
    assert m.shape == (2, 2, 2) and m.mesh_dim_names == ("dp", "cp", "tp")
    assert m.get_dim_size("dp_cp") == 4
    assert m.get_group_ranks("dp_cp", 0) == [0, 2, 4, 6]
    no_cp, moe = create_device_mesh("megatron_fsdp", world_size=8, tp_size=2)
    assert no_cp.shape == (4, 1, 2) and moe is None
    assert no_cp.flattened == {} and not no_cp.has_dim("dp_cp")
    with pytest.raises(ValueError, match="unknown dim name 'dp_cp'"):
        no_cp.get_group_ranks("dp_cp", 0)
    assert no_cp.data_world_size == 4 and no_cp.get_collect_ranks() == [0, 2, 4, 6]


@pytest.mark.parametrize(
    ("strategy", "kwargs", "message"),
    [
        (
            "fsdp2",
            {"tp_size": 3},
            r"world_size \(8\) must be divisible by \(tp_size \* cp_size \* pp_size\) \(3 \* 1 \* 1 = 3\)",
        ),
        (
            "fsdp2",
            {"tp_size": 2, "cp_size": 2, "pp_size": 4},
            r"world_size \(8\) must be divisible by \(tp_size \* cp_size \* pp_size\) \(2 \* 2 \* 4 = 16\)",
        ),
        (
            "fsdp2",
            {"tp_size": 2, "dp_replicate_size": 3},
            "dp_size must be a multiple of dp_replicate_size",
        ),
        (
            "fsdp2",
            {"dp_replicate_size": 8},
            "dp_replicate_size=8 must be less than dp_size=8 since DDP usecase is not supported by FSDP2",
        ),
        (
            "fsdp2",
            {"tp_size": 2, "dp_replicate_size": 4},
            "dp_replicate_size=4 must be less than dp_size=4 since DDP usecase is not supported by FSDP2",
        ),
        ("fsdp2", {"ep_size": 3}, "non_pp_size=8 must be a multiple of ep_size=3"),
        ("fsdp2", {"ep_size": 16}, "non_pp_size=8 must be a multiple of ep_size=16"),
        (
            "megatron_fsdp",
            {"tp_size": 3},
            r"world_size \(8\) must be divisible by \(tp_size \* cp_size\) \(3 \* 1 = 3\)",
        ),
        (
            "megatron_fsdp",
            {"dp_replicate_size": 2},
            "dp_replicate_size is only supported with FSDP2Config",
        ),
        (
            "megatron_fsdp",
            {"pp_size": 2},
            r"megatron_fsdp does not support pipeline/expert parallelism \(pp_size=2",
        ),
        (
            "megatron_fsdp",
            {"ep_size": 2},
            "megatron_fsdp does not support pipeline/expert parallelism .*ep_size=2",
        ),
        ("ddp", {"tp_size": 2}, r"ddp does not support tensor parallelism \(tp_size=2\)"),
        ("zero3", {}, "unknown strategy 'zero3'"),
    ],
)
def test_case28_value_errors(strategy, kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_device_mesh(strategy, world_size=8, **kwargs)


def test_case28_ddp_defaults_have_no_mesh():
    assert create_device_mesh("ddp", world_size=8) == (None, None)


def test_case30_dp_inference_and_explicit_dp():
    for dp in (None, 0, -1):
        assert create_fsdp2_mesh(world_size=8, dp_size=dp, tp_size=2).shape == (1, 1, 4, 1, 2)
        assert create_megatron_fsdp_mesh(world_size=8, dp_size=dp, cp_size=2).shape == (4, 2, 1)
    partial = create_fsdp2_mesh(world_size=8, dp_size=2, tp_size=2)  # used as given, like NeMo
    assert partial.world_size == 4 and partial.mesh.ravel().tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"bigger than world_size \(8\)"):
        create_fsdp2_mesh(world_size=8, dp_size=8, tp_size=2)


def test_factory_bad_sizes():
    with pytest.raises(ValueError, match="tp_size must be a positive integer, got 0"):
        create_fsdp2_mesh(world_size=8, tp_size=0)
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        create_megatron_fsdp_mesh(world_size=0)
    with pytest.raises(ValueError, match="stage 2 is out of range for pp_size=2"):
        create_moe_mesh(world_size=8, pp_size=2, ep_size=2, stage=2)


def test_factory_meshes_pickle():
    import pickle

    mesh, moe = create_device_mesh("fsdp2", world_size=8, tp_size=2, dp_replicate_size=2, ep_size=2)
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert pickle.loads(pickle.dumps(moe)) == moe
    assert pickle.loads(pickle.dumps(mesh)).get_group_ranks("dp_cp", 5) == [1, 3, 5, 7]
