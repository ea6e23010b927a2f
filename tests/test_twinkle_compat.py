"""Twinkle scripts and tests run against twinkle_ray imported as ``twinkle``.

The rank tests are written the way Twinkle's users write theirs: the package is
aliased (``sys.modules['twinkle'] = twinkle_ray``), ``Platform.get_rank`` is patched
to each global rank, and the mesh's ``<dim>_rank``, ``data_rank`` and world sizes are
checked. All pure (no Ray); the Ray script test is in ``test_twinkle_script.py``.
"""

from __future__ import annotations

import itertools
import logging
import socket
import sys
from unittest.mock import patch

import numpy as np
import pytest

import twinkle_ray


@pytest.fixture(scope="module", autouse=True)
def twinkle():
    """``import twinkle`` gives twinkle_ray (and ``twinkle.infra`` its infra) for this module."""
    saved = {k: v for k, v in sys.modules.items() if k == "twinkle" or k.startswith("twinkle.")}
    sys.modules["twinkle"] = twinkle_ray
    sys.modules["twinkle.infra"] = twinkle_ray.infra
    import twinkle

    twinkle.initialize(mode="local")
    yield twinkle
    twinkle.shutdown()
    for k in [k for k in sys.modules if k == "twinkle" or k.startswith("twinkle.")]:
        del sys.modules[k]
    sys.modules.update(saved)


# ------------------------------------------------------------------------------- names
def test_twinkle_public_names_import(twinkle):
    from twinkle import (  # noqa: F401
        GPU,
        NPU,
        DeviceGroup,
        DeviceMesh,
        Platform,
        find_free_port,
        find_node_ip,
        get_device_placement,
        get_logger,
        initialize,
        is_master,
        remote_class,
        remote_function,
    )
    from twinkle.infra import get_device_placement as gdp
    from twinkle.infra import initialize as init
    from twinkle.infra import is_master as im
    from twinkle.infra import remote_class as rc
    from twinkle.infra import remote_function as rf

    assert (init, rc, rf, gdp, im) == (initialize, remote_class, remote_function,
                                       get_device_placement, is_master)
    assert set(twinkle_ray.infra.__all__) == {"initialize", "remote_class", "remote_function",
                                              "get_device_placement", "is_master"}
    for name in twinkle_ray.__all__:
        assert getattr(twinkle, name) is not None, name
    assert issubclass(GPU, Platform) and issubclass(NPU, Platform)


def test_twinkle_utils_platform_path_gives_the_same_objects(twinkle):
    # Twinkle's own tests import from twinkle.utils.platform; loaded under the alias, the
    # module must hand out the very classes the mesh reads the rank through.
    from twinkle.utils.platform import DeviceMesh, Platform

    assert DeviceMesh is twinkle_ray.DeviceMesh and Platform is twinkle_ray.Platform
    mesh = DeviceMesh.from_sizes(dp_size=4)
    with patch.object(Platform, "get_rank", return_value=3):
        assert mesh.dp_rank == 3


# ----------------------------------------------------- ranks, as Twinkle users test them
def test_dp_rank_only(twinkle):
    from twinkle import DeviceMesh, Platform

    mesh = DeviceMesh.from_sizes(dp_size=4)
    for rank in range(4):
        with patch.object(Platform, "get_rank", return_value=rank):
            assert mesh.dp_rank == rank
            assert mesh.tp_rank is None and mesh.pp_rank is None and mesh.fsdp_rank is None
            assert mesh.data_rank == rank
    assert (mesh.dp_world_size, mesh.data_world_size, mesh.world_size) == (4, 4, 4)


@pytest.mark.parametrize("dim", ["tp", "pp", "fsdp"])
def test_single_dim_meshes(twinkle, dim):
    from twinkle import DeviceMesh, Platform

    mesh = DeviceMesh.from_sizes(**{f"{dim}_size": 4})
    for rank in range(4):
        with patch.object(Platform, "get_rank", return_value=rank):
            assert getattr(mesh, f"{dim}_rank") == rank
            assert mesh.dp_rank == 0  # dp defaults to 1 and is always a dim
            for other in {"tp", "pp", "fsdp"} - {dim}:
                assert getattr(mesh, f"{other}_rank") is None
            # only fsdp splits the data besides dp
            assert mesh.data_rank == (rank if dim == "fsdp" else 0)
    assert getattr(mesh, f"{dim}_world_size") == 4 and mesh.dp_world_size == 1


def _expected(sizes: dict[str, int], rank: int, ulysses: int = 1) -> dict[str, int | None]:
    """What Twinkle says rank ``rank`` of ``from_sizes(**sizes)`` is, from first principles."""
    order = [d for d in ("fsdp", "pp", "dp", "cp", "tp") if d in sizes or d == "dp"]
    shape = [sizes.get(d, 1) for d in order]
    coord = dict(zip(order, np.unravel_index(rank, shape), strict=True))
    out = {d: (int(coord[d]) if d in order else None) for d in ("dp", "fsdp", "tp", "pp", "cp")}
    dp, fsdp = out["dp"], out["fsdp"] or 0
    out["data"] = (dp * sizes.get("fsdp", 1) + fsdp) // ulysses
    return out


COMBOS = [
    {"dp": 2, "tp": 4},
    {"dp": 2, "fsdp": 4},
    {"dp": 2, "fsdp": 3},
    {"tp": 2, "pp": 4},
    {"dp": 2, "tp": 2, "pp": 2},
    {"dp": 2, "fsdp": 2, "tp": 2},
    {"dp": 2, "fsdp": 2, "tp": 2, "pp": 2},
    {"dp": 3, "fsdp": 2, "tp": 2, "pp": 2},
    {"dp": 2, "fsdp": 2, "pp": 2, "cp": 2, "tp": 2},
]


@pytest.mark.parametrize("sizes", COMBOS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_every_rank_of_combined_meshes(twinkle, sizes):
    from twinkle import DeviceMesh, Platform

    mesh = DeviceMesh.from_sizes(**{f"{k}_size": v for k, v in sizes.items()})
    world = int(np.prod(list(sizes.values())))
    assert mesh.world_size == world
    for dim in ("dp", "fsdp", "tp", "pp", "cp"):
        assert getattr(mesh, f"{dim}_world_size") == sizes.get(dim, 1), dim
    assert mesh.data_world_size == sizes.get("dp", 1) * sizes.get("fsdp", 1)
    seen_data = set()
    for rank in range(world):
        want = _expected(sizes, rank)
        with patch.object(Platform, "get_rank", return_value=rank):
            got = {d: getattr(mesh, f"{d}_rank") for d in ("dp", "fsdp", "tp", "pp", "cp")}
            assert got == {d: want[d] for d in got}, (rank, got, want)
            assert mesh.data_rank == want["data"], rank
            assert mesh.get_slice(100) == mesh.get_slice(100, want["data"])
        assert mesh.get_data_rank_from_global_rank(rank) == want["data"]
        seen_data.add(want["data"])
    assert seen_data == set(range(mesh.data_world_size))


def test_data_rank_with_dp_fsdp_is_twinkles_rule(twinkle):
    from twinkle import DeviceMesh, Platform

    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=3)
    mesh_array = mesh.mesh.reshape(3, 2)  # from_sizes order: (fsdp, dp)
    for fsdp_idx, dp_idx in itertools.product(range(3), range(2)):
        global_rank = int(mesh_array[fsdp_idx, dp_idx])
        with patch.object(Platform, "get_rank", return_value=global_rank):
            assert mesh.data_rank == dp_idx * 3 + fsdp_idx
    # the example: global rank 1 has data rank 3
    assert mesh.get_data_rank_from_global_rank(1) == 3


@pytest.mark.parametrize("sizes,ulysses", [({"dp": 4, "fsdp": 2}, 2), ({"dp": 2, "fsdp": 4}, 4),
                                           ({"dp": 2, "fsdp": 2, "tp": 2}, 2)])
def test_dp_fsdp_ulysses_every_rank(twinkle, sizes, ulysses):
    from twinkle import DeviceMesh, Platform

    mesh = DeviceMesh.from_sizes(ulysses_size=ulysses, **{f"{k}_size": v for k, v in sizes.items()})
    assert mesh.data_world_size == sizes["dp"] * sizes["fsdp"] // ulysses
    for rank in range(mesh.world_size):
        want = _expected(sizes, rank, ulysses)["data"]
        with patch.object(Platform, "get_rank", return_value=rank):
            assert mesh.data_rank == want, rank
        assert mesh.get_data_rank_from_global_rank(rank) == want


def test_custom_mesh_and_rank_outside(twinkle):
    from twinkle import DeviceMesh, Platform

    mesh_array = np.arange(16).reshape(2, 2, 4)
    mesh = DeviceMesh(mesh=mesh_array, mesh_dim_names=("pp", "dp", "tp"))
    for pp, dp, tp in itertools.product(range(2), range(2), range(4)):
        with patch.object(Platform, "get_rank", return_value=int(mesh_array[pp, dp, tp])):
            assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank, mesh.fsdp_rank) == (pp, dp, tp, None)
    with patch.object(Platform, "get_rank", return_value=100):
        assert mesh.dp_rank is None and mesh.tp_rank is None and mesh.data_rank is None


def test_nemo_meshes_keep_torch_flatten_order():
    # dp_replicate x dp_shard: the data rank is the local rank in torch's flattened 'dp' group
    from twinkle_ray.mesh_factory import create_fsdp2_mesh

    m = create_fsdp2_mesh(world_size=8, tp_size=2, dp_replicate_size=2)
    assert m.data_dims_order == ("dp_replicate", "dp_shard")
    assert [m.get_data_rank_from_global_rank(r) for r in range(8)] == [r // 2 for r in range(8)]
    assert [m.get_local_rank("dp", r) for r in range(8)] == [r // 2 for r in range(8)]


# -------------------------------------- everything that slices data uses the same data rank
def test_routing_sampler_and_collect_agree_with_data_rank(twinkle):
    from twinkle import DeviceMesh, Platform

    from twinkle_ray.core.dispatch import collect, dispatch
    from twinkle_ray.core.sampler import DeviceMeshSampler

    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=2, tp_size=2, pp_size=2)
    batch = list(range(24))
    calls = dispatch("slice_dp", mesh.world_size, (batch,), {}, device_mesh=mesh)
    sampler = DeviceMeshSampler(24, batch_size=8, device_mesh=mesh)
    for rank in range(mesh.world_size):
        with patch.object(Platform, "get_rank", return_value=rank):
            mine = batch[mesh.get_slice(len(batch))]
            assert calls[rank][0][0] == mine, rank  # slice_dp routing
            assert sampler.rank_part(batch) == mine  # the sampler's default: this rank's part
            assert sampler.current_data_rank() == mesh.data_rank
    # last_pp gathers the slices back in data order
    assert collect("last_pp", [c[0][0] for c in calls], device_mesh=mesh) == batch


def test_sampler_without_mesh_needs_a_data_rank():
    from twinkle_ray.core.sampler import DeviceMeshSampler

    s = DeviceMeshSampler(8, batch_size=4, data_world_size=2)
    with pytest.raises(ValueError, match="which of the 2 data ranks is this process.*no device_mesh"):
        s.rank_part([1, 2, 3, 4])
    assert DeviceMeshSampler(8, batch_size=4).rank_part([1, 2]) == [1, 2]  # one data rank


def test_sampler_outside_its_mesh_says_so(twinkle):
    from twinkle import DeviceMesh, Platform

    from twinkle_ray.core.sampler import DeviceMeshSampler

    s = DeviceMeshSampler(8, batch_size=4, device_mesh=DeviceMesh.from_sizes(dp_size=2))
    with patch.object(Platform, "get_rank", return_value=5), pytest.raises(
            ValueError, match="not in the device mesh; pass data_rank="):
        s.rank_part([1, 2, 3, 4])


# ------------------------------------------------------------------------------ Platform
def test_patching_platform_get_rank_reaches_every_reader(twinkle):
    from twinkle import Platform, is_master

    assert twinkle.get_rank() == 0 and is_master()
    with patch.object(Platform, "get_rank", return_value=3):
        assert twinkle.get_rank() == 3 and twinkle_ray.core.context.get_rank() == 3
        assert not is_master() and not twinkle.infra.is_master()
        assert twinkle.GPU.get_rank() == 3  # subclasses ask the same method


def test_platform_reads_the_worker_environment(monkeypatch):
    from twinkle_ray import Platform

    for var, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                       "NODE_RANK": "1"}.items():
        monkeypatch.setenv(var, value)
    assert (Platform.get_rank(), Platform.get_world_size(), Platform.get_local_rank(),
            Platform.get_local_world_size(), Platform.get_node_rank()) == (5, 8, 1, 4, 1)
    assert not Platform.is_master() and not Platform.is_local_master() and not Platform.is_last_rank()
    monkeypatch.setenv("RANK", "7")
    assert Platform.is_last_rank()
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="LOCAL_RANK='one' is not an integer"):
        Platform.get_local_rank()


def test_platform_device_helpers(monkeypatch):
    from twinkle_ray import GPU, NPU, Platform

    assert (GPU.visible_device_env(), GPU.device_prefix(), GPU.device_backend()) == (
        "CUDA_VISIBLE_DEVICES", "cuda", "nccl")
    assert (NPU.visible_device_env(), NPU.device_prefix(), NPU.device_backend()) == (
        "ASCEND_RT_VISIBLE_DEVICES", "npu", "hccl")
    assert Platform.visible_device_env("cpu") is None and Platform.device_backend("CPU") == "gloo"
    assert Platform.get_platform("CUDA") is GPU and Platform.get_platform("npu") is NPU
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert GPU.get_local_device() == "cuda:3" and NPU.get_local_device(1) == "npu:1"
    # a gang worker sees only its own devices: its first one is index 0 whatever its local rank
    monkeypatch.setenv("TWINKLE_WORKER", "g/C/3")
    monkeypatch.setenv("RANK", "3")
    assert GPU.get_local_device() == "cuda:0"
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/npu-smi" if name == "npu-smi" else None)
    assert Platform.get_platform() is NPU and Platform.device_prefix() == "npu"
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert Platform.get_platform() is GPU
    with pytest.raises(ValueError, match="unsupported platform 'xpu'; known: GPU, NPU, CPU"):
        Platform.get_platform("xpu")


# --------------------------------------------------------------------- logger and network
@pytest.fixture
def user_logger():
    logger = logging.getLogger("twinkle_ray.user")
    yield logger
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    logger.setLevel(logging.NOTSET)


def test_get_logger_local_master_and_file(twinkle, user_logger, tmp_path):
    from twinkle import Platform, get_logger

    path = tmp_path / "run.log"
    logger = get_logger(log_file=str(path), log_level="INFO")
    assert logger is user_logger and logger.level == logging.INFO
    logger.info("hello from the script")
    assert get_logger() is logger and len(logger.handlers) == 2  # set up once
    for h in logger.handlers:
        h.flush()
    assert "hello from the script" in path.read_text()
    with patch.object(Platform, "get_local_rank", return_value=1):
        assert get_logger().level == logging.ERROR  # not the local master: errors only
        assert get_logger(only_local_master=False).level == logging.INFO
    with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
        get_logger(log_level="LOUD")


def test_find_free_port_and_node_ip(twinkle):
    from twinkle import find_free_port, find_node_ip

    port = find_free_port(host="127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # it really is free
        taken = s.getsockname()[1]
        assert find_free_port(taken, retry=5, host="127.0.0.1") != taken
        with pytest.raises(OSError, match=f"no free port in {taken}..{taken}"):
            find_free_port(taken, retry=1, host="127.0.0.1")
    socket.inet_aton(find_node_ip())  # an IPv4 address


# --------------------------------------------------------------------- initialize, local
def test_initialize_rejects_bad_timeouts():
    for kwargs in ({"start_timeout_s": 0}, {"dist_timeout_s": -1}, {"placement_timeout_s": "60"}):
        with pytest.raises(ValueError, match=f"initialize: {next(iter(kwargs))} must be a positive"):
            twinkle_ray.initialize("local", **kwargs)


def test_last_pp_first_in_local_mode(twinkle):
    from twinkle import remote_class, remote_function

    @remote_class()
    class Model:
        @remote_function(collect="last_pp_first", lazy_collect=False)
        def calculate_metric(self):
            return {"loss": 0.5}

    # local mode: the class is built in-process and the method runs as written
    assert Model(remote_group="default").calculate_metric() == {"loss": 0.5}


@pytest.mark.parametrize("keyword,why", [("nproc_per_node", "gpus_per_node"),
                                         ("global_device_mesh", "pass the DeviceMesh"),
                                         ("full_determinism", "use_deterministic_algorithms")])
def test_initialize_names_twinkle_only_keywords(keyword, why):
    with pytest.raises(TypeError, match=f"initialize: '{keyword}' is a Twinkle keyword with no "
                                        f"meaning here: .*{why}"):
        twinkle_ray.initialize("local", **{keyword: 8})


@pytest.mark.parametrize("name", ["twinkle_ray.core.platform", "twinkle_ray.core.defaults",
                                  "twinkle_ray.core.logs",
                                  "twinkle_ray.runtime.net", "twinkle_ray.core.dispatch"])
def test_docstring_examples(name, user_logger):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
