"""The Compiled Graph path: thread-local torch state, backpressure, outputs as Ray objects,
one order with actor tasks, the switch, and the fallback to tasks when a graph cannot compile.

One 2-worker CPU gang per test on the session's Ray; this module's gangs take the graph
(conftest sets TWINKLE_COMPILED=1 for it; the default is the task path).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray

from twinkle_ray import DeviceGroup, LazyResult, get_rank, remote_class, remote_function


@remote_class()
class Torchy:
    def __init__(self):
        import torch

        torch.set_grad_enabled(False)
        torch.set_num_threads(1)
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        self.log: list = []

    @remote_function(dispatch="all", collect="none")
    def torch_state(self) -> dict:
        import torch

        return {"grad": torch.is_grad_enabled(), "threads": torch.get_num_threads(),
                "autocast": torch.is_autocast_enabled("cpu"),
                "dtype": str(torch.get_autocast_dtype("cpu"))}

    @remote_function(dispatch="all", collect="none")
    def add(self, x: int, seconds: float = 0.0) -> int:
        import time

        time.sleep(seconds)
        self.log.append(x)
        return x

    @remote_function(dispatch="all", collect="first")
    def history(self) -> list:
        return list(self.log)

    @remote_function(dispatch="all", collect="flatten")
    def big(self, n: int) -> list:
        return [np.full(n, get_rank(), dtype=np.uint8)]

    @remote_function(dispatch="slice_dp", collect="flatten")
    def sizes(self, arrays: list) -> list:
        return [int(a.sum()) for a in arrays]

    def state_dict(self) -> dict:
        self.log.append("saved")
        return {"log": list(self.log)}

    def load_state_dict(self, state: dict) -> None:
        self.log = list(state["log"])


@pytest.fixture
def gang(runtime):
    runtime.initialize(groups=[DeviceGroup("cg", 2, "cpu")])
    yield Torchy(remote_group="cg")


def test_calls_go_through_the_graph_with_init_thread_state(gang):
    assert gang.topology()["path"] == "graph"
    states = gang.torch_state()()
    assert states == [{"grad": False, "threads": 1, "autocast": True, "dtype": "torch.bfloat16"}] * 2


def test_more_calls_than_the_in_flight_limit_queue(gang):
    from twinkle_ray.runtime.graph import INFLIGHT_LIMIT

    outs = [gang.add(i, 0.01) for i in range(3 * INFLIGHT_LIMIT)]
    assert [o() for o in outs] == [[i, i] for i in range(3 * INFLIGHT_LIMIT)]
    assert gang.history()() == list(range(3 * INFLIGHT_LIMIT))


def test_a_timeout_bounds_a_call_still_waiting_for_a_slot(gang):
    from twinkle_ray import CallTimeoutError
    from twinkle_ray.runtime.graph import INFLIGHT_LIMIT

    # Every in-flight slot, one call holding the gang's order while it waits for a slot (that
    # one is registered: its ranks would be named as late), and 3 more, so that the queued call
    # is still unregistered when the timeout and its 2 s grace have passed; ~12 s of work.
    n = INFLIGHT_LIMIT + 4
    busy = [gang.add(i, 1.0) for i in range(n)]
    queued = gang.add(99)  # behind them all: not started anywhere
    with pytest.raises(CallTimeoutError, match=r"Torchy.add\(\) on group 'cg': not started on any "
                                               r"rank within 0.5s") as info:
        queued.get(timeout=0.5)
    assert info.value.ranks == []
    assert [o() for o in busy] == [[i, i] for i in range(n)]
    assert queued.get() == [99, 99]  # it still runs, in its turn


def test_save_state_is_ordered_with_graph_calls(gang):
    gang.add(1, 0.3)  # still running in the graph when save_state is sent
    gang.save_state()
    gang.add(2)
    assert gang.history()() == [1, "saved", 2]


def test_large_outputs_are_ray_objects_small_ones_come_back_by_value(gang):
    out = gang.big(1 << 20)
    refs = out.refs
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    assert [int(a[0]) for a in out()] == [0, 1] and all(a.nbytes == 1 << 20 for a in out())
    assert gang.sizes(out)() == [0, 1 << 20]  # routed worker to worker
    small = gang.add(5)
    assert isinstance(small, LazyResult) and all(isinstance(r, ray.ObjectRef) for r in small.refs)
    assert ray.get(small.refs) == [5, 5]


@remote_class(compiled=True)
class AlwaysGraph(Torchy):
    pass


@remote_class(compiled=False)
class NeverGraph(Torchy):
    pass


def test_the_task_path_is_the_default_and_remote_class_can_choose(runtime, monkeypatch):
    monkeypatch.delenv("TWINKLE_COMPILED")
    runtime.initialize(groups=[DeviceGroup("tp", 2, "cpu")])
    g = Torchy(remote_group="tp")
    topo = g.topology()
    assert topo["path"] == "tasks"
    # topology() names the dispatcher's own process: alive, and neither a worker nor this one
    pid = topo["dispatcher_pid"]
    assert pid not in [r["pid"] for r in topo["ranks"]] + [os.getpid()]
    os.kill(pid, 0)  # raises if no such process
    assert g.add(3)() == [3, 3]
    # Thread state holds there too (tasks run on the thread __init__ ran on).
    assert g.torch_state()()[0]["grad"] is False
    g.close()
    monkeypatch.setenv("TWINKLE_COMPILED", "0")  # the class's own choice wins over the switch
    g = AlwaysGraph(remote_group="tp")
    assert g.topology()["path"] == "graph"
    assert g.add(4)() == [4, 4]
    g.close()
    monkeypatch.setenv("TWINKLE_COMPILED", "1")
    g = NeverGraph(remote_group="tp")
    assert g.topology()["path"] == "tasks"


def test_compiled_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="compiled must be None, True or False, got '0'"):
        remote_class(compiled="0")


def test_a_graph_that_does_not_compile_falls_back_to_tasks():
    from twinkle_ray.runtime.dispatcher import Dispatcher

    d = Dispatcher.__new__(Dispatcher)  # only the compile step: no actor, no workers to reach
    d.spec = type("Spec", (), {"compiled": True, "label": "g/Cls"})()
    d.workers = [object(), object()]  # not actors: Ray cannot build a graph over them
    d._compile_graph()
    assert d.graph is None and d.path.startswith("tasks (the graph did not compile: ")


SPANNING = """
import json, os
import ray
from ray.cluster_utils import Cluster
import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function

@remote_class()
class Span:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="all", collect="none")
    def where(self):
        import torch, torch.distributed as dist
        t = torch.tensor([1.0]); dist.all_reduce(t)
        return [ray.get_runtime_context().get_node_id(), t.item()]

    @remote_function(dispatch="slice_dp", collect="flatten")
    def double(self, xs):
        return [2 * x for x in xs]

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
cluster.add_node(num_cpus=2)
try:
    twinkle.initialize(address=cluster.address, groups=[DeviceGroup("s", 4, "cpu")])
    g = Span(device_mesh=DeviceMesh.from_sizes(dp_size=4), remote_group="s")
    rows = g.where()()
    print("RESULT " + json.dumps({"path": g.topology()["path"], "nodes": len({r[0] for r in rows}),
                                  "sums": [r[1] for r in rows],
                                  "chained": g.double(g.double(list(range(8))))()}))
    twinkle.shutdown()
    ray.shutdown()
finally:
    cluster.shutdown()
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("compiled", ["1", "0"])
def test_a_gang_spanning_two_raylets(compiled):
    """A gang over 2 nodes of a Cluster: through its graph where Ray sets up the cross-node
    channels, through tasks otherwise (the path is reported); the calls give the same answers."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "TWINKLE_COMPILED": compiled}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", SPANNING], capture_output=True, text=True,
                          timeout=540, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert got["nodes"] == 2 and got["sums"] == [4.0] * 4
    assert got["chained"] == [4 * x for x in range(8)]
    if compiled == "0":
        assert got["path"] == "tasks"
    else:  # Ray 2.60 sets up channels across raylets; a gang whose graph fails falls back
        assert got["path"] == "graph" or got["path"].startswith("tasks (the graph did not compile")
