"""A gang rebuild re-probes its placement (issue 20 item 5): node, devices and the rendezvous
address are read again on every (re)build, so a rebuild after a node loss starts where Ray
re-placed the group's bundles. On a 2-node ray.cluster_utils.Cluster in its own driver."""

from __future__ import annotations

import textwrap

import pytest

MOVE = textwrap.dedent(
    """
    import json, os, time
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")  # a loaded machine starts slowly
    import ray
    from ray.cluster_utils import Cluster
    import twinkle_ray as twinkle
    from twinkle_ray import DeviceGroup, WorkerDiedError, remote_class, remote_function

    @remote_class(max_restarts=1)
    class W:
        @remote_function(dispatch="all", collect="none")
        def where(self):
            import torch, torch.distributed as dist
            t = torch.tensor([1.0]); dist.all_reduce(t)
            return [ray.get_runtime_context().get_node_id(), os.environ["CUDA_VISIBLE_DEVICES"],
                    os.environ["MASTER_ADDR"], t.item()]

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0,
                      "include_dashboard": False})
    first = cluster.add_node(num_cpus=2, num_gpus=2)
    try:
        twinkle.initialize(address=cluster.address, placement_timeout_s=120,
                           groups=[DeviceGroup("g", 2, "cuda")])
        w = W(remote_group="g")
        before = w.where()()
        second = cluster.add_node(num_cpus=2, num_gpus=2)
        cluster.remove_node(first)
        deadline = time.monotonic() + 300
        while True:  # calls fail until the gang is rebuilt on the new node
            try:
                after = w.where()()
                break
            except WorkerDiedError:
                assert time.monotonic() < deadline, f"no rebuild: {w.topology()}"
                time.sleep(0.5)
        topo = w.topology()
        print("RESULT " + json.dumps({
            "first": first.node_id, "second": second.node_id, "before": before, "after": after,
            "generation": topo["generation"], "master_addr": topo["master_addr"],
            "ranks": [[r["node_id"], r["devices"], r["node_ip"]] for r in topo["ranks"]]}))
        twinkle.shutdown()
        ray.shutdown()
    finally:
        cluster.shutdown()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(560)
def test_rebuild_follows_a_bundle_moved_to_another_node():
    """Issue 20 item 5: the node holding a gang is lost, Ray re-places its placement group on a
    new node, and the automatic rebuild starts there (node, devices, rendezvous re-probed)."""
    from test_runtime_layouts import run_script

    out, _ = run_script(MOVE, timeout=500)
    first, second = out["first"], out["second"]
    assert [r[0] for r in out["before"]] == [first, first]
    assert [r[0] for r in out["after"]] == [second, second]
    assert sorted(r[1] for r in out["after"]) == ["0", "1"]
    assert {r[3] for r in out["after"]} == {2.0}  # the new world's all-reduce
    assert [r[0] for r in out["ranks"]] == [second, second]
    assert out["generation"] >= 2
    assert out["master_addr"] == "127.0.0.1"  # one node: loopback rendezvous
