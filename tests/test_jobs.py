"""Ray Jobs: examples run unchanged under ``ray job submit`` against a running cluster.

Starts a real head node on loopback (8 virtual GPUs) with ``ray start --head
--block`` in its own process group, submits ``examples/rlhf_fsdp_hf.py --quick`` with
``ray job submit --working-dir .`` and a job with ``deploy/runtime_env.yaml``, checks
each SUCCEEDED and its logs, then stops only that cluster: the process group of the ``ray start`` it
launched (never ``ray stop``, which would stop every Ray on the machine,
the test session's included).

``examples/quickstart.py`` is submitted by ``tests/test_doc_blocks.py``'s Jobs steps (the
docs' blocks as written, the same ``ray job submit --working-dir .``), which checks its
job's output as well; submitting it here too cost half a minute for nothing new.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 180.0


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every service on 127.0.0.1
    env["RAY_AUTH_MODE"] = "token"  # Ray's token auth stays on; the token is ~/.ray/auth_token
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def _auth_headers() -> dict[str, str]:
    """Ray's token for HTTP calls to the dashboard (RAY_AUTH_TOKEN[_PATH] or ~/.ray/auth_token)."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not token and path.is_file():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _get_json(url: str) -> dict:
    req = urllib.request.Request(url, headers=_auth_headers())
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


class HeadNode:
    """A loopback head node owned by this test: started with --block, stopped by process group."""

    def __init__(self, num_cpus: int = 12, num_gpus: int = 8):
        self.temp_dir = tempfile.mkdtemp(prefix="trj", dir="/tmp")  # short: unix socket paths
        (gcs, dash, agent, agent_grpc, metrics, rtenv, client) = _free_ports(7)
        self.gcs_address = f"127.0.0.1:{gcs}"
        self.dashboard = f"http://127.0.0.1:{dash}"
        cmd = [
            RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
            f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}", "--object-store-memory=200000000",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
            f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rtenv}",
            f"--ray-client-server-port={client}", f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        self.log = open(Path(self.temp_dir) / "ray-start.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=_env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}: {self.log_text()}")
            try:  # the dashboard answers before the raylet is up: wait for both
                if (_get_json(f"{self.dashboard}/api/version").get("ray_version")
                        and any("raylet" in cmd for _, cmd in self.processes())):
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"head node not ready after {START_TIMEOUT_S:g}s: {self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return (Path(self.temp_dir) / "ray-start.log").read_text()[-3000:]

    def processes(self) -> list[tuple[int, str]]:
        """(pid, cmdline) of every live process of this cluster: its process group, or
        anything naming its temp dir (read from /proc; this is Linux)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            pid = int(entry.name)
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                stat = (entry / "stat").read_text()
                state = stat.rsplit(")", 1)[1].split()[0]
                if state == "Z":  # a zombie waiting for its parent's wait(): already dead
                    continue
                if os.getpgid(pid) == self.proc.pid or self.temp_dir in cmd:
                    found.append((pid, cmd))
            except (OSError, IndexError):
                continue
        return found

    def stop(self, timeout_s: float = 3.0) -> list[str]:
        """SIGTERM the process group (ray start --block cleans up its children), then SIGKILL.

        Ray's graceful stop can take 30 s+ on a loaded 2-core machine (the autoscaler monitor
        and ``ray start`` itself linger); everything here is ours, so a short grace suffices.
        Returns what is still alive (nothing, normally)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 10)
            while time.monotonic() < deadline and self.processes():
                time.sleep(0.5)
            if not self.processes():
                break
            for pid, _ in self.processes():  # a straggler that left the group, using our temp dir
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        self.proc.wait(10)
        self.log.close()
        left = [f"{pid} {cmd[:120]}" for pid, cmd in self.processes()]
        if not left:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


@pytest.fixture(scope="module")
def head():
    node = HeadNode()
    try:
        node.wait_ready()
        yield node
    finally:
        left = node.stop()
        assert not left, f"processes of the test cluster survived: {left}"


def _ray_job(head: HeadNode, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    cmd, sub = [RAY, "job", args[0], "--address", head.dashboard], list(args[1:])
    return subprocess.run(cmd + sub, cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
# its own bounds first (the submit's, and the head's start in the module fixture it now sets up,
# the quick start's submit having moved to tests/test_doc_blocks.py), not pytest's default 300 s
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + START_TIMEOUT_S + 60)
def test_rlhf_fsdp_hf_quick_runs_unchanged_under_ray_job_submit(head, ray_session, tmp_path):
    """examples/rlhf_fsdp_hf.py --quick (FSDP2 trainer gang, HF sampler gang) as a Ray Job."""
    import ray

    session_gcs = ray.get_runtime_context().gcs_address  # the test session's Ray, must survive
    sid = f"twinkle-rlhf-fsdp-hf-{os.getpid()}"
    submit = _ray_job(head, "submit", "--submission-id", sid, "--working-dir", ".",
                      "--", sys.executable, "examples/rlhf_fsdp_hf.py", "--quick", "--out-dir", str(tmp_path),
                      timeout=2 * JOB_TIMEOUT_S)
    info = _get_json(f"{head.dashboard}/api/jobs/{sid}")
    logs = _get_json(f"{head.dashboard}/api/jobs/{sid}/logs")["logs"]
    assert info["status"] == "SUCCEEDED", f"{info}\n{submit.stdout[-3000:]}\n{submit.stderr[-3000:]}"
    assert submit.returncode == 0 and "succeeded" in submit.stdout
    line = next(x for x in logs.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["reward_last"] > result["reward_first"] + 0.1, result
    assert (tmp_path / "checkpoint" / "config.json").is_file()
    # the job attached to the cluster, it did not start its own Ray
    assert "Connecting to existing Ray cluster" in logs or "Started a local Ray" not in logs
    assert ray.is_initialized() and ray.get_runtime_context().gcs_address == session_gcs


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_head_node_processes_are_ours(head):
    """Sanity for the cleanup: the cluster's gcs and raylet are in the group we will kill."""
    cmds = [cmd for _, cmd in head.processes()]
    assert any("gcs_server" in c for c in cmds) and any("raylet" in c for c in cmds), cmds
    assert _get_json(f"{head.dashboard}/api/version")["ray_version"]


@pytest.mark.slow
def test_job_runtime_env_file_ships_the_checkout(head):
    """deploy/runtime_env.yaml (what deploy/kuberay/rayjob.yaml embeds) uploads this checkout."""
    sid = f"twinkle-runtime-env-{os.getpid()}"
    code = ("import os, twinkle_ray, examples.serve_sampler; "
            "print('twinkle_ray from', twinkle_ray.__file__, 'dedup', os.environ['RAY_DEDUP_LOGS'])")
    submit = _ray_job(head, "submit", "--submission-id", sid,
                      "--runtime-env", "deploy/runtime_env.yaml", "--", sys.executable, "-c", code)
    info = _get_json(f"{head.dashboard}/api/jobs/{sid}")
    logs = _get_json(f"{head.dashboard}/api/jobs/{sid}/logs")["logs"]
    assert info["status"] == "SUCCEEDED", f"{info}\n{submit.stderr[-2000:]}"
    line = next(x for x in logs.splitlines() if x.startswith("twinkle_ray from"))
    assert "_ray_pkg_" in line and str(ROOT) not in line and line.endswith("dedup 0"), line
