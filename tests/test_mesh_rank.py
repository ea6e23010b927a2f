"""Issue 27 item 2, without Ray: in a gang worker that owns several devices, the mesh sees the
worker's mesh rank (``gang rank * gpus_per_worker``), the rank the dispatcher routes it as, while
``get_rank()`` stays the gang rank. (With Ray, on real gangs: test_routing_invariant.py.)"""

from __future__ import annotations

import pytest

from twinkle_ray import DeviceMesh, Platform, get_rank
from twinkle_ray.core.dispatch import dispatch


def as_worker(monkeypatch, rank: int, n_workers: int, gpus_per_worker: int) -> None:
    """The environment the runtime gives worker ``rank`` of a gang (see WorkerInfo.environ)."""
    monkeypatch.setenv("TWINKLE_WORKER", f"g/Cls/{rank}")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(n_workers))
    monkeypatch.setenv("TWINKLE_GPUS_PER_WORKER", str(gpus_per_worker))


@pytest.mark.parametrize(
    ("sizes", "gpus_per_worker"),
    [
        (dict(dp_size=2, tp_size=2), 2),  # a vLLM TP=2 sampler: 2 engines of 2 GPUs
        (dict(dp_size=2, tp_size=4), 4),
        (dict(dp_size=4, tp_size=2), 2),
        (dict(pp_size=2, dp_size=2, tp_size=2), 2),
    ],
)
def test_worker_mesh_agrees_with_slice_dp(monkeypatch, sizes, gpus_per_worker):
    mesh = DeviceMesh.from_sizes(**sizes)
    n = mesh.world_size // gpus_per_worker
    sent = dispatch("slice_dp", n, (list(range(12)),), {}, device_mesh=mesh,
                    gpus_per_worker=gpus_per_worker)
    for i in range(n):
        as_worker(monkeypatch, i, n, gpus_per_worker)
        assert get_rank() == Platform.get_rank() == i  # the gang rank (get_rank() inside a worker)
        assert Platform.get_mesh_rank(mesh.world_size) == i * gpus_per_worker
        assert mesh.data_rank == mesh.get_data_rank_from_global_rank(i * gpus_per_worker)
        s = mesh.get_slice(12)
        assert list(range(12))[s] == sent[i][0][0], (sizes, i)


def test_vllm_tp2_mesh_worker_one(monkeypatch):
    # the case that guards the mapping: dp=2, tp=2, 2 GPUs per worker; worker 1 was sent items [4..7] of 8
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    as_worker(monkeypatch, 1, 2, 2)
    assert (mesh.data_rank, mesh.dp_rank, mesh.tp_rank) == (1, 1, 0)
    assert mesh.get_slice(8) == slice(4, 8)


def test_pp_stage_of_a_two_device_worker(monkeypatch):
    mesh = DeviceMesh.from_sizes(pp_size=2, tp_size=2)  # worker 1 is mesh rank 2: the last stage
    as_worker(monkeypatch, 1, 2, 2)
    assert mesh.pp_rank == 1 and mesh.is_pp_last_rank() and not mesh.is_pp_first_rank()


def test_mesh_over_workers_keeps_gang_rank(monkeypatch):
    # a mesh of one rank per worker (not spanning the devices): its rank is the gang rank
    mesh = DeviceMesh.from_sizes(dp_size=2)
    as_worker(monkeypatch, 1, 2, 2)
    assert Platform.get_mesh_rank(mesh.world_size) == 1 and mesh.data_rank == 1


def test_one_device_workers_and_driver_unchanged(monkeypatch):
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    as_worker(monkeypatch, 3, 4, 1)
    assert mesh.data_rank == 1 and mesh.tp_rank == 1
    for k in ("TWINKLE_WORKER", "RANK", "WORLD_SIZE", "TWINKLE_GPUS_PER_WORKER"):
        monkeypatch.delenv(k)
    assert Platform.get_mesh_rank(4) == 0 and mesh.data_rank == 0  # a driver: rank 0
