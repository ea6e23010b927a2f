"""A node lost mid-call, on a 3-node ray.cluster_utils.Cluster of its own.

tests/node_loss_driver.py runs the three scenarios in turn on one cluster, as a separate Ray
driver (a subprocess: the cluster is its own Ray, apart from the session's ``ray_session``, and a
process can hold one Ray only); each test checks its scenario's record. The head holds no gang
resources; a 4-worker gang has 2 ranks on each of two worker nodes; one of them is killed
(raylet and workers) while a call is pending, and a fresh node replaces it before the next
scenario. After the driver exits, no process of that cluster may be left (matched by the
cluster's GCS address in the process table).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The driver's cluster reports a killed node dead after health_check_period_ms x failure_threshold
# (1 s x 3; Ray's default is 3 s x 5); the error follows within a second of that. Generous for a
# loaded 2-core machine.
TO_ERROR_LIMIT_S = 60.0
# In this order: the dispatcher scenario's placement group stays until the driver's job ends.
SCENARIOS = ["no-capacity", "worker-node-lost", "dispatcher-node-lost"]


@pytest.fixture(scope="module")
def runs() -> dict:
    """Each scenario's record, from one run of the driver."""
    out = run_scenarios(SCENARIOS)
    print(f"\nnode-loss driver: cluster up in {out['start_s']:.1f}s; "
          + ", ".join(f"{name} {out[name]['took_s']:.1f}s" for name in SCENARIOS))
    return out


def scenario(runs: dict, name: str) -> dict:
    out = runs[name]
    assert "failed" not in out, out["failed"]
    return out


def run_scenarios(names: list[str], timeout: float = 900) -> dict:
    # A temp dir of its own: the cluster's address file must not lead other Ray drivers on this
    # machine (ray.init() without an address reads it) to this short-lived cluster.
    tmp = tempfile.mkdtemp(prefix="twnl-", dir="/tmp")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PYTHONPATH": os.pathsep.join([HERE, REPO]),
           "RAY_TMPDIR": tmp}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "node_loss_driver.py"), *names],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line[len("RESULT "):])
    assert cluster_processes(out["address"]) == [], "processes of the test cluster survived"
    return out


def cluster_processes(address: str) -> list[str]:
    """Command lines of live processes that belong to the cluster at ``address``."""
    port = address.rsplit(":", 1)[-1]
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f":{port}" in cmd and ("ray" in cmd or "gcs" in cmd):
            left.append(f"{pid}: {cmd[:200]}")
    return left


def _check_death(out: dict) -> None:
    assert out["error_type"] == "WorkerDiedError", out
    assert out["kind"] == "node lost" and out["node_id"] == out["victim"], out
    assert out["rank"] in out["victim_ranks"], out
    assert f"id {out['victim'][:8]}, node lost" in out["error"], out["error"]
    assert f"rank(s) {out['victim_ranks']} of the gang ran there" in out["error"], out["error"]
    assert "group 'job/trainer'" in out["error"]  # a '/' in the group name
    assert out["to_error_s"] < TO_ERROR_LIMIT_S, out


@pytest.mark.slow
def test_node_lost_mid_call_then_rebuilt_on_a_node_added_back(runs):
    out = scenario(runs, "worker-node-lost")
    print(f"\nnode loss: error after {out['to_error_s']:.1f}s; node added, first call after "
          f"{out['add_to_first_call_s']:.1f}s ({out['to_first_call_s']:.1f}s after the loss)")
    _check_death(out)
    assert out["values"] == [10, 11, 12, 13]  # the state saved before the loss, rank by rank
    assert out["allreduce"] == 4.0  # a fresh torch.distributed world over the new placement
    assert out["restarts"] == 1
    assert out["victim"] not in out["nodes_after"]
    assert out["left_after_shutdown"] == {"pgs": [], "actors": []}


@pytest.mark.slow
def test_node_lost_without_capacity_names_missing_resources_and_releases_all(runs):
    out = scenario(runs, "no-capacity")
    print(f"\nnode loss, no capacity: error after {out['to_error_s']:.1f}s; rebuild gave up "
          f"{out['to_next_error_s']:.1f}s later")
    _check_death(out)
    assert out["next_type"] == "GangRebuildError", out
    nxt = out["next"]
    assert "its automatic rebuild failed" in nxt and f"bundle(s) {out['victim_bundles']} of group 'job/trainer'" in nxt
    assert "placement_timeout_s=6s" in nxt and "missing {CPU: 2}" in nxt, nxt
    assert "nothing stays reserved" in nxt and "node lost" in nxt
    assert out["left"]["pgs"] == []  # the placement group is gone ...
    assert out["available"] == 2.0  # ... and the surviving node's CPUs are free again
    assert out["left_after_shutdown"] == {"pgs": [], "actors": []}


@pytest.mark.slow
def test_node_lost_with_the_dispatcher_names_the_dispatcher_and_its_node(runs):
    """The dispatcher shares its creator's node: an actor on a worker node creates the gang, the
    driver calls it (found by name), and that node is lost during the call."""
    out = scenario(runs, "dispatcher-node-lost")
    assert out["dispatcher_node"] == out["victim"], out
    assert out.get("error_type") == "WorkerDiedError", out
    print(f"\nnode loss with the dispatcher: error after {out['to_error_s']:.1f}s")
    assert out["kind"] == "dispatcher" and out["rank"] is None, out
    assert out["node_id"] == out["victim"], out
    assert out["error"].startswith("the dispatcher of Healing in group 'job/trainer' died (node "), out
    assert out["to_error_s"] < TO_ERROR_LIMIT_S, out
    # The gang's actors went with their creator. Its placement group does not: Ray scopes a
    # placement group to the job, not to the actor that made it, so it stays reserved until
    # the driver's job ends (known limitation, noted in docs/failures.md).
    assert out["left"]["actors"] == [], out
