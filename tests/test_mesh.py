"""DeviceMesh (pure numpy) and context: expected values from torch 2.13 runs
(/work/shared/reference/mesh_ground_truth.md, cases 2-5, 9-10, 12, 17) and
from Twinkle's documented data-routing semantics."""

from __future__ import annotations

import doctest
import pickle
import sys
import types

import cloudpickle
import numpy as np
import pytest

import twinkle_ray.core.context as context
import twinkle_ray.core.mesh as mesh_module
import twinkle_ray.core.mesh_checks as checks_module
import twinkle_ray.core.mesh_factory as factory_module
import twinkle_ray.core.routing as routing_module
from twinkle_ray.core.context import get_rank, get_world_size
from twinkle_ray.core.mesh import DeviceMesh


def named(shape, names, **kwargs) -> DeviceMesh:
    return DeviceMesh(
        mesh=np.arange(int(np.prod(shape))).reshape(shape), mesh_dim_names=names, **kwargs
    )


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


# --------------------------------------------------------------- torch ground truth
def test_case2_pp_tp_rank5_follows_torch_not_the_blog():
    m = named((4, 2), ("pp", "tp"))
    assert m.get_coordinate(5) == (2, 1)
    assert m.get_group_ranks("pp", 5) == [1, 3, 5, 7]
    assert m.get_group_ranks("tp", 5) == [4, 5]
    # the widely read blog's answer (case 18) is wrong
    assert m.get_group_ranks("pp", 5) != [4, 5, 6, 7]
    assert m.get_group_ranks("tp", 5) != [5, 7]
    assert m.get_local_rank("pp", 5) == 2
    assert m.get_local_rank("tp", 5) == 1
    assert m.get_dim_size("pp") == 4 and m.get_dim_size("tp") == 2 and m.world_size == 8


def test_case2_current_rank_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    m = named((4, 2), ("pp", "tp"))
    assert (m.pp_rank, m.tp_rank) == (2, 1)
    assert m.get_group_ranks("pp") == [1, 3, 5, 7]
    assert m.get_group_ranks("tp") == [4, 5]


def test_case3_rank0_and_rank6():
    m = named((4, 2), ("pp", "tp"))
    assert m.get_group_ranks("pp", 0) == [0, 2, 4, 6]
    assert m.get_group_ranks("tp", 0) == [0, 1]
    assert m.get_coordinate(6) == (3, 0)
    assert m.get_group_ranks("pp", 6) == [0, 2, 4, 6]
    assert m.get_group_ranks("tp", 6) == [6, 7]


def test_case4_dp_tp_rank5():
    m = named((2, 4), ("dp", "tp"))
    assert m.get_coordinate(5) == (1, 1)
    assert m.get_group_ranks("dp", 5) == [1, 5]
    assert m.get_group_ranks("tp", 5) == [4, 5, 6, 7]
    assert m.get_local_rank("dp", 5) == 1 and m.get_local_rank("tp", 5) == 1


def test_case5_3d_rank6():
    m = named((2, 2, 2), ("dp", "cp", "tp"))
    assert m.get_coordinate(6) == (1, 1, 0)
    assert m.get_group_ranks("dp", 6) == [2, 6]
    assert m.get_group_ranks("cp", 6) == [4, 6]
    assert m.get_group_ranks("tp", 6) == [6, 7]


def test_case9_and_10_flattened_groups():
    m = named(
        (2, 2, 2), ("dp", "cp", "tp"), flattened={"dp_cp": ("dp", "cp"), "cp_tp": ("cp", "tp")}
    )
    for r, local in zip((0, 2, 4, 6), range(4), strict=True):
        assert m.get_group_ranks("dp_cp", r) == [0, 2, 4, 6]
        assert m.get_local_rank("dp_cp", r) == local
    for r in (1, 3, 5, 7):
        assert m.get_group_ranks("dp_cp", r) == [1, 3, 5, 7]
    assert m.get_group_ranks("cp_tp", 5) == [4, 5, 6, 7]
    assert m.get_dim_size("dp_cp") == 4 and m.has_dim("dp_cp")
    everything = named((2, 2, 2), ("dp", "cp", "tp"), flattened={"dp_cp_tp": ("dp", "cp", "tp")})
    assert everything.get_group_ranks("dp_cp_tp", 3) == list(range(8))
    assert [everything.get_local_rank("dp_cp_tp", r) for r in range(8)] == list(range(8))


def test_case12_4d_rank7():
    m = named((2, 1, 2, 2), ("pp", "dp", "cp", "tp"), flattened={"dp_cp": ("dp", "cp")})
    assert m.get_coordinate(7) == (1, 0, 1, 1)
    assert m.get_group_ranks("pp", 7) == [3, 7]
    assert m.get_group_ranks("dp", 7) == [7]
    assert m.get_group_ranks("cp", 7) == [5, 7]
    assert m.get_group_ranks("tp", 7) == [6, 7]
    assert m.get_group_ranks("dp_cp", 7) == [5, 7]


def test_case17_group_order_and_membership():
    m = named((2, 2, 2), ("dp", "cp", "tp"))
    assert m.get_dim_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # torch 2.13 order
    assert m.get_dim_groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.get_dim_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    big = named((2, 3, 4), ("pp", "dp", "tp"))
    assert big.get_dim_groups("pp")[:3] == [[0, 12], [1, 13], [2, 14]]
    for d, name in enumerate(big.mesh_dim_names):
        legacy = big.mesh.swapaxes(-1, d).reshape(-1, big.mesh.shape[d]).tolist()
        assert sorted(big.get_dim_groups(name)) == sorted(legacy)
        for r in range(big.world_size):
            assert big.get_group_ranks(name, r) in legacy


# ------------------------------------------------------------------ from_sizes
def test_from_sizes_dim_order_and_data_slices():
    m = DeviceMesh.from_sizes(dp_size=2, pp_size=2, tp_size=2)
    assert m.mesh_dim_names == ("pp", "dp", "tp")
    assert m.shape == (2, 2, 2) and m.world_size == 8
    slices = {r: m.get_slice(10, m.get_data_rank_from_global_rank(r)) for r in range(8)}
    for r in (0, 1, 4, 5):
        assert slices[r] == slice(0, 5)
    for r in (2, 3, 6, 7):
        assert slices[r] == slice(5, 10)
    assert m.data_world_size == 2


def test_from_sizes_slices_for_current_rank(monkeypatch):
    m = DeviceMesh.from_sizes(dp_size=2, pp_size=2, tp_size=2)
    items = list(range(10))
    for r, expected in [(0, items[:5]), (5, items[:5]), (2, items[5:]), (7, items[5:])]:
        monkeypatch.setenv("RANK", str(r))
        assert items[m.get_slice(len(items))] == expected


def test_from_sizes_dp4_slices_3_3_2_2(monkeypatch):
    m = DeviceMesh.from_sizes(dp_size=4)
    assert m.mesh_dim_names == ("dp",)
    sizes = []
    for r in range(4):
        monkeypatch.setenv("RANK", str(r))
        s = m.get_slice(10)
        sizes.append(s.stop - s.start)
    assert sizes == [3, 3, 2, 2]
    assert [m.get_slice(10, r) for r in range(4)] == [
        slice(0, 3),
        slice(3, 6),
        slice(6, 8),
        slice(8, 10),
    ]
    assert m.get_slice(3, 3) == slice(3, 3)  # fewer items than data ranks: empty tail


def test_from_sizes_all_dims_and_rank_properties(monkeypatch):
    m = DeviceMesh.from_sizes(fsdp_size=2, pp_size=2, dp_size=2, cp_size=2, tp_size=2)
    assert m.mesh_dim_names == ("fsdp", "pp", "dp", "cp", "tp")
    monkeypatch.setenv("RANK", "27")  # 27 = 0b11011 -> fsdp 1, pp 1, dp 0, cp 1, tp 1
    assert (m.fsdp_rank, m.pp_rank, m.dp_rank, m.cp_rank, m.tp_rank) == (1, 1, 0, 1, 1)
    # Twinkle's rule: dp_rank * fsdp_world_size + fsdp_rank = 0 * 2 + 1
    assert m.data_world_size == 4 and m.data_rank == 1
    assert m.get_group_ranks("fsdp") == [11, 27]


def test_absent_dims_and_rank_outside(monkeypatch):
    m = DeviceMesh.from_sizes(dp_size=4)
    monkeypatch.setenv("RANK", "2")
    assert (m.dp_rank, m.tp_rank, m.pp_rank, m.cp_rank, m.fsdp_rank) == (2, None, None, None, None)
    assert (
        m.dp_world_size,
        m.tp_world_size,
        m.pp_world_size,
        m.cp_world_size,
        m.fsdp_world_size,
    ) == (4, 1, 1, 1, 1)
    assert m.data_rank == 2
    monkeypatch.setenv("RANK", "9")
    assert m.dp_rank is None and m.data_rank is None and m.get_coordinate() is None


def test_fsdp_and_dp_data_ranks():
    m = DeviceMesh.from_sizes(fsdp_size=2, dp_size=2, tp_size=2)
    assert m.mesh_dim_names == ("fsdp", "dp", "tp")
    assert m.data_world_size == 4
    # Twinkle's rule: dp_rank * fsdp_world_size + fsdp_rank (not the mesh's fsdp-outer order)
    assert [m.get_data_rank_from_global_rank(r) for r in range(8)] == [0, 0, 2, 2, 1, 1, 3, 3]
    assert m.get_collect_ranks() == [0, 4, 2, 6]  # in data-rank order


def test_world_size_and_dp_inference():
    assert DeviceMesh.from_sizes(world_size=8, dp_size=None, pp_size=2, tp_size=2).shape == (
        2,
        2,
        2,
    )
    assert DeviceMesh.from_sizes(world_size=8, dp_size=2, pp_size=2, tp_size=2).world_size == 8
    assert DeviceMesh.from_sizes(dp_size=None).shape == (1,)
    assert DeviceMesh.from_sizes().mesh.tolist() == [0]


def test_ulysses_divides_data_world_size():
    m = DeviceMesh.from_sizes(dp_size=4, ulysses_size=2)
    assert m.data_world_size == 2
    assert [m.get_data_rank_from_global_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert m.get_slice(10, 1) == slice(5, 10)
    assert m.get_collect_ranks() == [0, 2]
    fsdp = DeviceMesh.from_sizes(fsdp_size=2, dp_size=4, ulysses_size=4)
    assert fsdp.data_world_size == 2
    # (dp_rank * 2 + fsdp_rank) // 4: fsdp is the inner index, so dp 0-1 and dp 2-3 pair up
    assert [fsdp.get_data_rank_from_global_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert "ulysses_size" not in m.mesh_dim_names


def test_attributes_are_not_dims():
    m = DeviceMesh.from_sizes(dp_size=4, tp_size=2, ep_size=4, vpp_size=2, sequence_parallel=True)
    assert m.mesh_dim_names == ("dp", "tp")
    assert (m.ep_size, m.vpp_size, m.sequence_parallel) == (4, 2, True)
    assert m.ep_world_size == 4 and m.etp_world_size == 2
    assert DeviceMesh.from_sizes(dp_size=2, tp_size=2, etp_size=1).etp_world_size == 1


# ------------------------------------------------------------ pp / collect
def test_pp_last_ranks_and_collect_ranks():
    m = DeviceMesh.from_sizes(dp_size=2, pp_size=2, tp_size=2)
    assert m.get_pp_first_ranks() == [0, 1, 2, 3]
    assert m.get_pp_last_ranks() == [4, 5, 6, 7]
    assert m.get_pp_stage_ranks(1) == [4, 5, 6, 7]
    assert m.get_collect_ranks() == [4, 6]  # data rank 0 -> 4, data rank 1 -> 6
    assert m.is_pp_last_rank(5) and not m.is_pp_last_rank(1)
    assert m.is_pp_first_rank(1) and not m.is_pp_first_rank(6)
    assert m.get_tp_last_ranks() == [1, 3, 5, 7]
    assert m.is_tp_last_rank(3) and not m.is_tp_last_rank(2)

    assert DeviceMesh.from_sizes(dp_size=4).get_pp_last_ranks() == [0, 1, 2, 3]
    assert DeviceMesh.from_sizes(dp_size=4).get_collect_ranks() == [0, 1, 2, 3]
    assert DeviceMesh.from_sizes(dp_size=2, tp_size=2).get_collect_ranks() == [0, 2]
    assert DeviceMesh.from_sizes(pp_size=4, tp_size=2).get_collect_ranks() == [6]
    four = DeviceMesh.from_sizes(pp_size=4, dp_size=2)
    assert four.get_pp_last_ranks() == [6, 7] and four.get_collect_ranks() == [6, 7]


def test_pp_ranks_on_a_custom_mesh():
    m = DeviceMesh(mesh=np.array([[7, 3], [5, 1]]), mesh_dim_names=("pp", "dp"))
    assert m.get_pp_last_ranks() == [1, 5]
    assert m.get_collect_ranks() == [5, 1]  # data rank 0 (rank 5), then data rank 1 (rank 1)
    assert m.get_group_ranks("pp", 3) == [3, 1]  # local-rank order, like torch


# --------------------------------------------------------------- protocol
def test_pickle_round_trip_and_equality():
    m = DeviceMesh.from_sizes(
        dp_size=2, pp_size=2, tp_size=2, ulysses_size=2, ep_size=2, device_type="cpu"
    )
    flat = named((2, 2, 2), ("dp", "cp", "tp"), flattened={"dp_cp": ("dp", "cp")})
    for mesh in (m, flat):
        for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
            back = loads(dumps(mesh))
            assert back == mesh and back is not mesh
            assert back.get_group_ranks("dp", 5) == mesh.get_group_ranks("dp", 5)
    assert m != DeviceMesh.from_sizes(dp_size=2, pp_size=2, tp_size=2, ulysses_size=2, ep_size=2)
    assert m != flat and m != "not a mesh"
    assert DeviceMesh.from_sizes(dp_size=4) == named((4,), ("dp",))


def test_repr_reads_well():
    text = repr(DeviceMesh.from_sizes(dp_size=2, tp_size=2, ulysses_size=2))
    assert text == (
        "DeviceMesh(mesh_dim_names=('dp', 'tp'), shape=(2, 2), mesh=[[0, 1], [2, 3]], "
        "device_type='cuda', ulysses_size=2)"
    )
    assert "mesh=" not in repr(DeviceMesh.from_sizes(dp_size=128))


def test_mesh_is_copied_and_accepts_lists():
    source = np.arange(4).reshape(2, 2)
    m = DeviceMesh(mesh=source, mesh_dim_names=["dp", "tp"])
    source[0, 0] = 99
    assert m.mesh[0, 0] == 0 and m.mesh_dim_names == ("dp", "tp")
    assert DeviceMesh(mesh=[[0, 1], [2, 3]], mesh_dim_names=("dp", "tp")) == m


@pytest.mark.parametrize("module", [mesh_module, checks_module, factory_module, context, routing_module])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


# ---------------------------------------------------------------- context
def test_context_from_env(monkeypatch):
    assert (get_rank(), get_world_size()) == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert (get_rank(), get_world_size()) == (3, 8)
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(ValueError, match="RANK='three'"):
        get_rank()


def test_context_prefers_initialised_torch_distributed(monkeypatch):
    fake = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        get_rank=lambda: 6,
        get_world_size=lambda: 8,
    )
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setenv("RANK", "1")
    assert (get_rank(), get_world_size()) == (6, 8)
    assert DeviceMesh.from_sizes(dp_size=2, tp_size=4).dp_rank == 1
    fake.is_initialized = lambda: False
    assert (get_rank(), get_world_size()) == (1, 1)


# ------------------------------------------------------------------ errors
def test_error_product_not_world_size():
    with pytest.raises(
        ValueError, match=r"world_size \(8\) does not equal .*pp_size=2 \* dp_size=2 = 4"
    ):
        DeviceMesh.from_sizes(world_size=8, dp_size=2, pp_size=2)
    with pytest.raises(ValueError, match=r"cannot infer dp_size: world_size \(8\) .*tp_size=3 = 3"):
        DeviceMesh.from_sizes(world_size=8, dp_size=None, tp_size=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 0}, "tp_size must be a positive integer, got 0"),
        ({"dp_size": -2}, "dp_size must be a positive integer, got -2"),
        ({"pp_size": 1.5}, "pp_size must be a positive integer, got 1.5"),
        ({"world_size": 0}, "world_size must be a positive integer, got 0"),
        ({"ulysses_size": 0}, "ulysses_size must be a positive integer, got 0"),
        ({"ep_size": -1}, "ep_size must be a positive integer, got -1"),
    ],
)
def test_error_non_positive_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeviceMesh.from_sizes(**kwargs)


def test_error_ulysses_not_dividing():
    with pytest.raises(ValueError, match=r"ulysses_size \(3\) must divide .*dp_size=4 = 4"):
        DeviceMesh.from_sizes(dp_size=4, ulysses_size=3)


def test_error_bad_meshes():
    with pytest.raises(ValueError, match=r"mesh sizes must be positive, got shape \(0, 2\)"):
        DeviceMesh(mesh=np.zeros((0, 2), dtype=int), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="has 1 names but the mesh has 2 dimensions"):
        DeviceMesh(mesh=np.arange(4).reshape(2, 2), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="must be distinct"):
        DeviceMesh(mesh=[[0, 1], [1, 2]], mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="must be distinct"):
        DeviceMesh(mesh=[[0, 1], [2, 3]], mesh_dim_names=("dp", "dp"))
    with pytest.raises(ValueError, match="non-negative, got -1"):
        DeviceMesh(mesh=[-1, 0], mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="integer ranks"):
        DeviceMesh(mesh=[0.5, 1.0], mesh_dim_names=("dp",))


def test_error_unknown_dim_names():
    with pytest.raises(ValueError, match=r"unknown dim names \['foo'\]"):
        DeviceMesh(mesh=np.arange(4), mesh_dim_names=("foo",))
    m = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    with pytest.raises(ValueError, match=r"unknown dim name 'foo'; this mesh has \['dp', 'tp'\]"):
        m.get_group_ranks("foo", 0)
    with pytest.raises(ValueError, match="unknown dim name 'pp'"):
        m.get_dim_groups("pp")
    with pytest.raises(ValueError, match="unknown dim name 'cp'"):
        m.get_dim_size("cp")
    with pytest.raises(ValueError, match=r"unknown dim names \['cp'\]"):
        DeviceMesh(
            mesh=np.arange(4).reshape(2, 2),
            mesh_dim_names=("dp", "tp"),
            flattened={"x": ("dp", "cp")},
        )
    with pytest.raises(ValueError, match="mesh order"):
        DeviceMesh(
            mesh=np.arange(4).reshape(2, 2),
            mesh_dim_names=("dp", "tp"),
            flattened={"x": ("tp", "dp")},
        )
    with pytest.raises(ValueError, match="'tp' is already a root dim"):
        DeviceMesh(
            mesh=np.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"), flattened={"tp": ("dp",)}
        )


def test_error_rank_outside_mesh(monkeypatch):
    m = DeviceMesh.from_sizes(dp_size=4)
    with pytest.raises(ValueError, match=r"rank 8 is not in this mesh of 4 ranks"):
        m.get_data_rank_from_global_rank(8)
    with pytest.raises(ValueError, match=r"rank 4 is not in this mesh of 4 ranks"):
        m.get_group_ranks("dp", 4)
    with pytest.raises(ValueError, match=r"rank 9 is not in this mesh"):
        m.get_local_rank("dp", 9)
    monkeypatch.setenv("RANK", "9")
    with pytest.raises(ValueError, match=r"rank 9 is not in this mesh of 4 ranks"):
        m.get_slice(10)
    assert DeviceMesh.from_sizes(tp_size=4).get_slice(10) == slice(0, 10)  # data world 1


def test_error_bad_slice_arguments():
    m = DeviceMesh.from_sizes(dp_size=4)
    with pytest.raises(ValueError, match="data rank 4 is out of range for data_world_size 4"):
        m.get_slice(10, 4)
    with pytest.raises(ValueError, match="data rank -1 is out of range"):
        m.get_slice(10, -1)
    with pytest.raises(ValueError, match="non-negative integer, got -1"):
        m.get_slice(-1, 0)
    with pytest.raises(ValueError, match="pp stage 2 is out of range for pp size 2"):
        DeviceMesh.from_sizes(pp_size=2).get_pp_stage_ranks(2)
