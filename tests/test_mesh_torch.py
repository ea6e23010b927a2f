"""DeviceMesh against real torch.distributed: one gloo world of 8 processes.

All checks run inside a single spawn (the CI machine has 2 cores): each rank
writes what torch built and what our numpy mesh says to a JSON file, and the
parent compares them, and compares both with mesh_ground_truth.md.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from twinkle_ray.core.mesh import DeviceMesh
from twinkle_ray.mesh_factory import create_fsdp2_mesh, create_megatron_fsdp_mesh

WORLD = 8
SPAWN_TIMEOUT_S = 120

# name -> (our mesh, the torch reference built independently on each rank)
PLAIN = {
    "pp_tp_4x2": ((4, 2), ("pp", "tp")),
    "dp_tp_2x4": ((2, 4), ("dp", "tp")),
    "dp_cp_tp_2x2x2": ((2, 2, 2), ("dp", "cp", "tp")),
}


def _our_meshes() -> dict[str, DeviceMesh]:
    meshes = {
        name: DeviceMesh(mesh=np.arange(8).reshape(shape), mesh_dim_names=names, device_type="cpu")
        for name, (shape, names) in PLAIN.items()
    }
    # default device_type 'cuda' must fall back to cpu on a machine without CUDA
    meshes["from_sizes_pp_dp_tp"] = DeviceMesh.from_sizes(dp_size=2, pp_size=2, tp_size=2)
    meshes["gpu_alias_dp8"] = DeviceMesh.from_sizes(dp_size=8, device_type="GPU")
    # not an arange: goes through torch's DeviceMesh(...) constructor
    meshes["transposed_dp_tp"] = DeviceMesh(
        mesh=np.arange(8).reshape(2, 4).T.copy(), mesh_dim_names=("dp", "tp"), device_type="cpu"
    )
    meshes["fsdp2_case19"] = create_fsdp2_mesh(
        world_size=8, tp_size=2, dp_replicate_size=2, device_type="cpu"
    )
    meshes["megatron_case27"] = create_megatron_fsdp_mesh(
        world_size=8, tp_size=2, cp_size=2, device_type="cpu"
    )
    return meshes


def _ranks(group) -> list[int]:
    return [int(r) for r in dist.get_process_group_ranks(group)]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["RANK"] = "99"  # must be ignored: torch.distributed is the source of truth
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.device_mesh import init_device_mesh

    from twinkle_ray.core.context import get_rank, get_world_size

    out: dict = {"get_rank": get_rank(), "get_world_size": get_world_size(), "meshes": {}}
    for name, ours in _our_meshes().items():
        if name in PLAIN:
            shape, names = PLAIN[name]
            reference = init_device_mesh("cpu", shape, mesh_dim_names=names)
        else:
            reference = TorchDeviceMesh(
                "cpu", torch.as_tensor(ours.mesh), mesh_dim_names=ours.mesh_dim_names
            )
            for flat, dims in ours.flattened.items():
                reference[dims]._flatten(flat)
        converted = ours.to_torch()
        entry = {
            "torch_coordinate": list(reference.get_coordinate()),
            "our_coordinate": list(ours.get_coordinate()),
            "converted_names": list(converted.mesh_dim_names),
            "converted_mesh": converted.mesh.tolist(),
            "data_rank": ours.data_rank,
            "slice10": [ours.get_slice(10).start, ours.get_slice(10).stop],
            "dims": {},
        }
        for dim in (*ours.mesh_dim_names, *ours.flattened):
            entry["dims"][dim] = {
                "torch": _ranks(reference.get_group(dim)),
                "converted": _ranks(converted.get_group(dim)),
                "ours": ours.get_group_ranks(dim),
                "torch_local": reference[dim].get_local_rank()
                if dim in ours.flattened
                else reference.get_local_rank(dim),
                "ours_local": ours.get_local_rank(dim),
            }
        out["meshes"][name] = entry
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world_results(tmp_path_factory) -> dict[int, dict]:
    out_dir = tmp_path_factory.mktemp("mesh_torch")
    ctx = mp.start_processes(
        _worker,
        args=(_free_port(), str(out_dir)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"8-rank gloo world did not finish in {SPAWN_TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)}


@pytest.mark.slow
def test_context_uses_torch_distributed_rank(world_results):
    for r, res in world_results.items():
        assert (res["get_rank"], res["get_world_size"]) == (r, WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_our_meshes()))
def test_groups_equal_torch_on_every_rank(world_results, name):
    for r, res in world_results.items():
        entry = res["meshes"][name]
        assert entry["our_coordinate"] == entry["torch_coordinate"], (name, r)
        assert entry["converted_mesh"] == _our_meshes()[name].mesh.tolist()
        for dim, got in entry["dims"].items():
            assert got["ours"] == got["torch"], (name, r, dim)
            assert got["converted"] == got["torch"], (name, r, dim)
            assert got["ours_local"] == got["torch_local"], (name, r, dim)


@pytest.mark.slow
def test_ground_truth_values_seen_by_torch(world_results):
    pp_tp = world_results[5]["meshes"]["pp_tp_4x2"]["dims"]
    assert pp_tp["pp"]["torch"] == [1, 3, 5, 7] and pp_tp["tp"]["torch"] == [4, 5]
    dp_cp_tp = world_results[6]["meshes"]["dp_cp_tp_2x2x2"]["dims"]
    assert (dp_cp_tp["dp"]["torch"], dp_cp_tp["cp"]["torch"], dp_cp_tp["tp"]["torch"]) == (
        [2, 6],
        [4, 6],
        [6, 7],
    )
    fsdp2 = world_results[5]["meshes"]["fsdp2_case19"]["dims"]
    assert fsdp2["dp"]["converted"] == [1, 3, 5, 7] and fsdp2["dp"]["torch_local"] == 2
    assert fsdp2["dp_shard_cp"]["converted"] == [5, 7]
    assert fsdp2["dp_cp"]["converted"] == [1, 3, 5, 7]
    megatron = world_results[0]["meshes"]["megatron_case27"]["dims"]
    assert megatron["dp_cp"]["converted"] == [0, 2, 4, 6]


@pytest.mark.slow
def test_data_slices_inside_the_world(world_results):
    expected = {
        0: [0, 5],
        1: [0, 5],
        4: [0, 5],
        5: [0, 5],
        2: [5, 10],
        3: [5, 10],
        6: [5, 10],
        7: [5, 10],
    }
    for r, res in world_results.items():
        entry = res["meshes"]["from_sizes_pp_dp_tp"]
        assert entry["converted_names"] == ["pp", "dp", "tp"]
        assert entry["slice10"] == expected[r]
        fsdp2 = res["meshes"]["fsdp2_case19"]
        assert fsdp2["data_rank"] == r // 2


def test_to_torch_without_distributed_raises():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed world"):
        DeviceMesh.from_sizes(dp_size=2).to_torch()
