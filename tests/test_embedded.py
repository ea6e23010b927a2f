"""The embedded default (issue 20, items 4 and 6): a private Ray on loopback, whatever /tmp/ray says.

One child driver (tests/embedded_child.py) runs with a private Ray temp dir
(``RAY_TMPDIR``) holding a real stale ``ray/ray_current_cluster``, the file a
stopped ``ray start`` head leaves behind, naming a dead GCS. Plain
``ray.init()`` would try to attach to it; ``twinkle_ray.initialize()`` must
start its own Ray, and every socket that Ray and our gang listen on must be
on 127.0.0.1. The child gets neither RAY_ADDRESS nor
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: initialize() alone must do it. Nothing of
another process's Ray is touched (the temp dir is private; only the child's
process tree is inspected).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from conftest import TESTS_DIR

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads /proc (Linux)")


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


@pytest.fixture(scope="module")
def child_run():
    tmp = tempfile.mkdtemp(prefix="twr-", dir="/tmp")  # short: Ray's unix sockets live under it
    try:
        os.makedirs(os.path.join(tmp, "ray"))
        stale = _dead_address()
        with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
            f.write(stale)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        env["RAY_TMPDIR"] = tmp
        proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "embedded_child.py")], env=env,
                              capture_output=True, text=True, timeout=300)
        yield proc, stale, tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _report(proc) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SOCKETS ")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("SOCKETS "):])


@pytest.mark.slow
def test_stale_current_cluster_file_does_not_break_initialize(child_run):
    proc, stale, tmp = child_run
    report = _report(proc)  # initialize() started Ray and a gang ran
    assert "When connecting to an existing cluster" not in proc.stderr
    sessions = [n for n in os.listdir(os.path.join(tmp, "ray")) if n.startswith("session_2")]
    assert sessions, "the child's Ray did not start under its private temp dir"
    assert report["node"] == "127.0.0.1"


@pytest.mark.slow
def test_embedded_ray_and_gang_listen_on_loopback_only(child_run):
    proc, _, _ = child_run
    rows = _report(proc)["sockets"]
    commands = " ".join(r[3] for r in rows)
    for name in ("gcs_server", "raylet", "ray::GangWorker", "ray::DashboardAgent", "ray::RuntimeEnvAgent"):  # the report covers Ray's servers and the workers
        assert name in commands, f"no listening socket of {name} found: {rows}"
    exposed = [r for r in rows if r[0] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert not exposed, "listening beyond loopback:\n" + "\n".join(map(str, exposed))


PROBE = """
import json, logging, os, sys
import ray  # before initialize(), without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: Ray's node address is fixed
import twinkle_ray

seen = {}
def fake_init(**kwargs):  # records what initialize() asks of Ray, starts nothing
    seen.update(kwargs, env=os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
                node_ip=ray.util.get_node_ip_address())
    raise RuntimeError("stop here")
ray.init = fake_init
records = []
logging.getLogger("twinkle_ray").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r.getMessage())})())
try:
    twinkle_ray.initialize("ray", num_cpus=2)
except RuntimeError:
    pass
print("PROBE " + json.dumps({"address": seen.get("address"), "env_during": seen.get("env"),
      "env_after": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"), "node_ip": seen.get("node_ip"),
      "dashboard_host": seen.get("dashboard_host"), "warnings": records}))
"""


def test_ray_imported_first_still_starts_on_loopback():
    """initialize() asks Ray for a new instance (address='local') with the loopback setting in the
    environment only while it starts it; when ray was imported earlier without that setting, Ray's
    constant read at import is set to match for the start alone, so the node address Ray uses is
    127.0.0.1 all the same, and nothing is warned about. (The normal order, twinkle_ray first, is
    the real start of the tests above; tests/test_weights_loopback.py checks the sockets.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert lines, proc.stdout + proc.stderr
    out = json.loads(lines[0][len("PROBE "):])
    assert out["address"] == "local" and out["dashboard_host"] == "127.0.0.1"
    assert out["env_during"] == "0" and out["env_after"] is None  # restored after the start
    assert out["node_ip"] == "127.0.0.1"
    assert not out["warnings"], out["warnings"]
