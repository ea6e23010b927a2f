"""Group layouts: gpus_per_worker > 1 with last_pp, CPU groups, gangs sharing a group, colocation,
multi-node on a ray.cluster_utils.Cluster, and the quick-start example."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from twinkle_ray import DeviceGroup, DeviceMesh, get_rank, remote_class, remote_function

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@remote_class()
class Stage:
    def __init__(self, device_mesh: DeviceMesh | None = None):
        self.mesh = device_mesh

    @remote_function(dispatch="all", collect="none")
    def devices(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    @remote_function(dispatch="slice_dp", collect="last_pp")
    def forward(self, xs: list) -> list:
        # every pipeline stage returns something; only the last stage's output counts
        return [(x, get_rank()) for x in xs]


@pytest.mark.slow
def test_gpus_per_worker_two_and_last_pp(runtime):
    # 4 devices, 2 per worker (a TP=2 engine per worker): pp=2 stages x tp=2
    runtime.initialize(groups=[DeviceGroup("pp", ranks=4, device_type="cuda", gpus_per_worker=2)])
    mesh = DeviceMesh.from_sizes(pp_size=2, tp_size=2)
    model = Stage(device_mesh=mesh, remote_group="pp")
    devs = model.devices()()
    assert len(devs) == 2
    assert all(len(d.split(",")) == 2 for d in devs)
    assert len({x for d in devs for x in d.split(",")}) == 4
    # worker 1 is global rank 2: the last pp stage; its output alone is collected
    assert model.forward([1, 2, 3])() == [(1, 1), (2, 1), (3, 1)]


@remote_class()
class CpuThing:
    @remote_function(dispatch="all", collect="none")
    def env(self) -> list:
        return [os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("RANK")]


@pytest.mark.slow
def test_cpu_group_and_second_gang_on_same_group(runtime):
    runtime.initialize(groups=[DeviceGroup("cpu", ranks=2, device_type="CPU"),
                               DeviceGroup("gpu", ranks=2, device_type="GPU")])
    c = CpuThing(remote_group="cpu")
    # tuples would be collected element-wise; lists are per-rank results
    assert c.env()() == [[None, "0"], [None, "1"]]  # CPU groups get no device variable
    first = Stage(remote_group="gpu")
    second = Stage(remote_group="gpu")  # shares the group's devices (no extra GPUs taken)
    assert first.devices()() == second.devices()()
    assert sorted(first.devices()()) == sorted(set(first.devices()()))


@pytest.mark.slow
def test_colocated_group_shares_devices(runtime):
    runtime.initialize(groups=[DeviceGroup("train", ranks=2),
                               DeviceGroup("rollout", ranks=2, colocate_with="train")])
    t = Stage(remote_group="train")
    r = Stage(remote_group="rollout")
    assert t.devices()() == r.devices()()


MULTINODE = textwrap.dedent(
    """
    import json, os
    import ray
    from ray.cluster_utils import Cluster
    import twinkle_ray as twinkle
    from twinkle_ray import DeviceGroup, remote_class, remote_function

    @remote_class()
    class W:
        @remote_function(dispatch="slice", collect="flatten")
        def double(self, xs):
            return [2 * x for x in xs]

        @remote_function(dispatch="all", collect="none")
        def where(self):
            import torch, torch.distributed as dist
            t = torch.tensor([1.0]); dist.all_reduce(t)
            return {k: os.environ[k] for k in ("RANK", "NODE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                    "CUDA_VISIBLE_DEVICES")} | {"node": ray.get_runtime_context().get_node_id(),
                    "sum": t.item()}

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2,
                      "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=2)
    try:
        twinkle.initialize(address=cluster.address, groups=[DeviceGroup("g", 4, "cuda")])
        w = W(remote_group="g")
        print("RESULT " + json.dumps(w.where()()))
        print("CHAINED " + json.dumps(w.double(w.double(list(range(8))))()))  # across raylets
        try:  # a node-local gang larger than any node: refused at once
            twinkle.initialize(groups=[DeviceGroup("packed", 4, "cuda", strategy="STRICT_PACK")])
        except twinkle.PlacementError as e:
            print("PLACEMENT " + str(e))
        twinkle.shutdown()
        ray.shutdown()
    finally:
        cluster.shutdown()
    """
)


def run_script(code: str, timeout: float = 240) -> tuple[list, str]:
    """Run ``code`` as its own Ray driver (loopback); return its RESULT rows and its stdout."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[len("RESULT "):]), proc.stdout


@pytest.mark.slow
def test_multinode_gang_spans_two_nodes():
    rows, stdout = run_script(MULTINODE)
    assert [r["RANK"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["NODE_RANK"] for r in rows] == ["0", "0", "1", "1"]
    assert [r["LOCAL_RANK"] for r in rows] == ["0", "1", "0", "1"]
    assert {r["LOCAL_WORLD_SIZE"] for r in rows} == {"2"}
    assert len({r["node"] for r in rows}) == 2
    assert rows[0]["node"] == rows[1]["node"] != rows[2]["node"] == rows[3]["node"]
    # (node, device) order: devices ascend within each node
    assert [r["CUDA_VISIBLE_DEVICES"] for r in rows] == ["0", "1", "0", "1"]
    assert {r["sum"] for r in rows} == {4.0}  # gloo all-reduce across both nodes
    chained = next((x for x in stdout.splitlines() if x.startswith("CHAINED ")), "CHAINED null")
    assert json.loads(chained[len("CHAINED "):]) == [4 * x for x in range(8)]
    placement = next((x for x in stdout.splitlines() if x.startswith("PLACEMENT ")), "")
    assert "group 'packed' (STRICT_PACK): needs {CPU: 4, GPU: 4} on one node" in placement
    assert "largest node has {CPU: 2, GPU: 2}" in placement


@pytest.mark.slow
def test_quickstart_example_runs():
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "examples/quickstart.py", "--steps", "2"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "group 'sampler': 4 worker(s), gpu" in out
    assert "trainer rank 3 (dp 1, tp 1, GPU 7): prompts [4, 5, 6, 7] from sampler ranks [2, 3]" in out
    assert "done: 2 steps" in out


@pytest.mark.parametrize("mode", ["local"])
def test_local_mode_runs_in_process(mode):
    import twinkle_ray as twinkle

    twinkle.shutdown()
    twinkle.initialize(mode, groups=[DeviceGroup("g", 2, "cpu")])
    try:
        s = Stage(device_mesh=DeviceMesh.from_sizes(dp_size=1), remote_group="g")
        assert isinstance(s, Stage)
        assert s.forward([1, 2]) == [(1, 0), (2, 0)]
        assert twinkle.get([1]) == [1]
        assert "local mode" in twinkle.get_device_placement()
    finally:
        twinkle.shutdown()
    plain = Stage()  # no remote_group: always in-process, even without initialize
    assert plain.forward([3]) == [(3, 0)]


NPU = textwrap.dedent(
    """
    import json, os
    import ray
    import twinkle_ray as twinkle
    from twinkle_ray import DeviceGroup, remote_class, remote_function

    @remote_class(distributed=False)
    class N:
        @remote_function(dispatch="all", collect="none")
        def env(self):
            return [os.environ.get("ASCEND_RT_VISIBLE_DEVICES"), os.environ.get("CUDA_VISIBLE_DEVICES")]

    ray.init(num_cpus=4, resources={"NPU": 4}, include_dashboard=False)
    twinkle.initialize(groups=[DeviceGroup("npu", 4, "NPU")])
    print("RESULT " + json.dumps(N(remote_group="npu").env()()))
    twinkle.shutdown()
    ray.shutdown()
    """
)


@pytest.mark.slow
def test_npu_group_pins_through_rays_accelerator_variable():
    rows, _ = run_script(NPU, timeout=180)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]  # one NPU each, in rank order
    assert {r[1] for r in rows} == {None}  # no GPU variable for an NPU group
