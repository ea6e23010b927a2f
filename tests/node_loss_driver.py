"""Node-loss scenarios on one ray.cluster_utils.Cluster, run in turn by one run of this script.

Run by tests/test_failures.py (its node-loss tests) as its own Ray driver (a subprocess: the cluster is a Ray of its
own, apart from the test session's). The head holds no gang resources; two worker nodes hold 2
CPUs each, so a 4-worker gang has 2 ranks on each. Before each scenario a node is added where
the last one left only one worker node. Prints one ``RESULT {json}`` line: the cluster's address
and each scenario's record under its name.

    python tests/node_loss_driver.py no-capacity worker-node-lost dispatcher-node-lost
    # no-capacity: PlacementError, nothing reserved; worker-node-lost: rebuilt on a node added
    # back; dispatcher-node-lost (last: its placement group stays until this driver's job ends,
    # see docs/failures.md): the dispatcher's node, named

Ray declares a killed node dead after ``health_check_period_ms`` x ``health_check_failure_threshold``
(3 s x 5 by default); this cluster checks every 1 s, 3 failures (a killed raylet refuses each
check at once; a live one has ``health_check_timeout_ms``, Ray's 10 s, to answer).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import ray
from ray.cluster_utils import Cluster
from workers import Collective, Valued

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, WorkerDiedError, remote_class, remote_function

GROUP = "job/trainer"  # a '/' in the group name, as DeviceGroup allows
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


class _Stateful(Valued, Collective):
    @remote_function(dispatch="all", collect="none")
    def where(self) -> str:
        return ray.get_runtime_context().get_node_id()


@remote_class(max_restarts=2)
class Healing(_Stateful):
    pass


def leftovers(namespace: str) -> dict:
    """Our live named actors and placement groups in this cluster (no dashboard needed)."""
    pgs = [pg["name"] for pg in ray.util.placement_group_table().values()
           if pg["name"].startswith("twinkle/") and pg["state"] != "REMOVED"]
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["namespace"] == namespace]
    return {"pgs": pgs, "actors": actors}


def remove_during_call(cluster: Cluster, victim, g, out: dict) -> float:
    """Kill node ``victim`` (raylet and workers) while a 120 s call on gang ``g`` is pending;
    record the error the call raised in ``out``. Returns the moment of the removal."""
    pending = g.sleep(120)
    time.sleep(1.0)
    t0 = time.monotonic()
    cluster.remove_node(victim, allow_graceful=False)
    try:
        pending.get()
        out["error"] = None
    except WorkerDiedError as e:
        out["to_error_s"] = time.monotonic() - t0
        out["error"] = str(e)
        out["error_type"] = type(e).__name__
        out["kind"], out["node_id"], out["rank"] = e.kind, e.node_id, e.rank
    return t0


@ray.remote(num_cpus=0)
class Creator:
    """A process on a worker node that creates the gang, so its dispatcher (which shares its
    creator's node) sits on a node the cluster can remove; the driver finds the gang by name."""

    def __init__(self, address: str):
        twinkle.initialize(address=address, namespace="node-loss",
                           groups=[DeviceGroup(GROUP, 4, "cpu")], placement_timeout_s=120.0)
        self.gang = Healing(remote_group=GROUP)

    def label(self) -> str:
        return self.gang.topology()["label"]


def dispatcher_node_lost(cluster: Cluster, nodes: list, out: dict) -> None:
    """The node holding a gang's dispatcher (and its creator) is lost during a call made by
    another process: the pending call names the dispatcher and its node; no actor is left."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from twinkle_ray.runtime.proxy import GangProxy

    victim = nodes[0]
    creator = Creator.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=victim.node_id, soft=False)).remote(cluster.address)
    g = GangProxy.lookup(ray.get(creator.label.remote(), timeout=300), namespace="node-loss")
    out["victim"] = victim.node_id
    out["dispatcher_node"] = g.topology()["dispatcher_node"][0]
    remove_during_call(cluster, victim, g, out)
    nodes.remove(victim)
    deadline = time.monotonic() + 30  # the creator's gang goes with it
    while leftovers("node-loss")["actors"] and time.monotonic() < deadline:
        time.sleep(0.5)
    out["left"] = leftovers("node-loss")


def run_scenario(cluster: Cluster, nodes: list, scenario: str) -> dict:
    """One scenario on ``cluster`` (worker nodes ``nodes``, updated as nodes leave and join)."""
    out: dict = {"scenario": scenario}
    if scenario == "dispatcher-node-lost":  # the gang is the creator's, not this driver's
        dispatcher_node_lost(cluster, nodes, out)
        return out
    ckpt = tempfile.mkdtemp(prefix="twinkle-node-loss-")
    twinkle.initialize(address=cluster.address, namespace="node-loss",
                       groups=[DeviceGroup(GROUP, 4, "cpu")],
                       # no-capacity: how long the rebuild looks for a node before it gives up (the group's
                       # first reservation, on the nodes there, takes well under a second)
                       placement_timeout_s=6.0 if scenario == "no-capacity" else 120.0)
    try:
        g = Healing(remote_group=GROUP)
        where = g.where()()
        desc = g.topology()
        disp = desc["dispatcher_node"][0]
        victim = next(n for n in reversed(nodes) if n.node_id != disp)  # (the head holds it)
        out["victim_ranks"] = [r for r, n in enumerate(where) if n == victim.node_id]
        out["victim_bundles"] = sorted(desc["ranks"][r]["bundle"] for r in out["victim_ranks"])
        out["victim"] = victim.node_id
        g.set_value(1)()
        g.save_state(path=ckpt)  # files: survive the node's object store
        g.set_value(2)()  # lost by the rebuild
        t0 = remove_during_call(cluster, victim, g, out)
        nodes.remove(victim)
        if scenario == "worker-node-lost":
            time.sleep(1.0)
            t1 = time.monotonic()
            nodes.append(cluster.add_node(num_cpus=2))  # capacity comes back
            out["values"] = g.get_value()()  # waits for the rebuild and the restore
            out["to_first_call_s"] = time.monotonic() - t0
            out["add_to_first_call_s"] = time.monotonic() - t1
            out["allreduce"] = g.allreduce()()
            out["restarts"] = g.topology()["restarts"]
            out["nodes_after"] = sorted(set(g.where()()))
        else:
            t1 = time.monotonic()
            try:
                g.get_value()()
                out["next"] = None
            except WorkerDiedError as e:
                out["next"] = str(e)
                out["next_type"] = type(e).__name__
                out["to_next_error_s"] = time.monotonic() - t1
            out["left"] = leftovers("node-loss")
            deadline = time.monotonic() + 15  # Ray's resource view settles within a few reports
            while (ray.available_resources().get("CPU", 0.0) < 2.0
                   and time.monotonic() < deadline):
                time.sleep(0.5)
            out["available"] = ray.available_resources().get("CPU", 0.0)
    finally:
        twinkle.shutdown()
    time.sleep(1.0)  # kills land
    out["left_after_shutdown"] = leftovers("node-loss")
    return out


def main(scenarios: list[str]) -> dict:
    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False,
                                      "_system_config": HEALTH_CHECKS})
    # The dispatcher (num_cpus=0) shares its creator's node: the driver's (the head) here, or
    # in the dispatcher scenario a worker node, where an actor creates the gang.
    nodes = [cluster.add_node(num_cpus=2), cluster.add_node(num_cpus=2)]
    out: dict = {"address": cluster.address}
    try:
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="node-loss")
        out["start_s"] = time.monotonic() - t0
        for scenario in scenarios:
            while len(nodes) < 2:  # the last scenario's lost node, replaced
                nodes.append(cluster.add_node(num_cpus=2))
            cluster.wait_for_nodes()
            t0 = time.monotonic()
            try:
                out[scenario] = run_scenario(cluster, nodes, scenario)
            except Exception as e:  # recorded, so the test names it; the next scenario still runs
                out[scenario] = {"scenario": scenario, "failed": f"{type(e).__name__}: {e}"}
            out[scenario]["took_s"] = time.monotonic() - t0
    finally:
        twinkle.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return out


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    print("RESULT " + json.dumps(main(sys.argv[1:])), flush=True)
