"""The twinkle-ray CLI: help, topology (plan, on Ray, of a running cluster), demo, bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_ray import cli

ROOT = Path(__file__).resolve().parent.parent
TWINKLE_RAY = str(Path(sys.executable).with_name("twinkle-ray"))

GROUPS = [
    {"name": "sampler", "ranks": 4, "device_type": "cuda", "gpus_per_worker": 2},
    {"name": "trainer", "ranks": [4, 5, 6, 7]},
    {"name": "reward", "ranks": 2, "device_type": "cpu"},
]


@pytest.fixture
def groups_file(tmp_path) -> Path:
    p = tmp_path / "groups.json"
    p.write_text(json.dumps(GROUPS))
    return p


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    # as a user runs it (docs/deploy.md): the CLI itself keeps a loopback attach on loopback
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env.setdefault("RAY_AUTH_MODE", "token")
    env.pop("RAY_ADDRESS", None)
    return env


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([TWINKLE_RAY, *args], capture_output=True, text=True, timeout=timeout,
                          env=_cli_env(), cwd=ROOT)


def test_help_reads_well():
    out = run_cli("--help")
    assert out.returncode == 0
    for words in ("topology", "demo", "bench", "ray job submit", "serve run", "examples:"):
        assert words in out.stdout
    topo = run_cli("topology", "--help")
    assert topo.returncode == 0 and "usage: twinkle-ray topology" in topo.stdout
    demo = run_cli("demo", "--help")  # the quick start's own options, under the demo's name
    assert demo.returncode == 0 and "--steps" in demo.stdout
    assert demo.stdout.startswith("usage: twinkle-ray demo "), demo.stdout[:200]
    assert run_cli("--version").stdout.startswith("twinkle-ray ")


def test_topology_plan_of_a_groups_file(groups_file, capsys):
    assert cli.main(["topology", str(groups_file)]) == 0
    out = capsys.readouterr().out
    assert "group 'sampler': 2 worker(s), gpu, bundle {GPU: 2, CPU: 1}" in out
    assert "worker 1   GPU [2, 3]" in out
    assert "worker 3   GPU [7]" in out and "group 'reward': 2 worker(s), cpu" in out


def test_topology_yaml_file_and_bad_files(tmp_path, capsys):
    y = tmp_path / "g.yaml"
    y.write_text("groups:\n  - {name: a, ranks: 2}\n")
    assert cli.main(["topology", str(y)]) == 0
    assert "group 'a': 2 worker(s)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {name: a, ranks: 0}\n")
    assert cli.main(["topology", str(bad)]) == 2
    assert "group 0 (a)" in capsys.readouterr().err
    assert cli.main(["topology", str(tmp_path / "missing.json")]) == 2
    assert cli.main(["topology"]) == 2 and "--address" in capsys.readouterr().err


@pytest.mark.slow
def test_topology_on_ray_and_of_running_gangs(runtime, groups_file):
    """Ray mode, as a separate driver attached to the session's Ray: reserve a groups file and
    print real devices; then list a gang this test runs, by name."""
    import ray

    from twinkle_ray import DeviceGroup, remote_class

    @remote_class()
    class Probe:
        def ping(self) -> int:
            return 1

    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:")  # a loopback head, attached without any env var
    out = run_cli("topology", str(groups_file), "--address", address, "--namespace", "twinkle-cli")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "twinkle_ray topology (ray mode)" in out.stdout
    gpus = [line for line in out.stdout.splitlines() if line.strip().startswith("rank")]
    assert len(gpus) == 2 + 4 + 2 and "GPU [" in out.stdout

    runtime.initialize("ray", groups=[DeviceGroup("cli", 2, "cpu")])
    gang = Probe(remote_group="cli")
    assert gang.ping()() == [1, 1]
    out = run_cli("topology", "--address", address, "--namespace", "twinkle-tests")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gang 'cli/Probe' (namespace twinkle-tests): 2 worker(s), backend gloo" in out.stdout
    assert "healthy" in out.stdout and out.stdout.count("  rank ") == 2


@pytest.mark.slow
def test_demo_runs_the_quickstart(runtime, capsys):
    """In the session's Ray (initialize uses it as is); classes travel by value."""
    assert cli.main(["demo", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "done: 1 steps" in out and "trainer rank" in out


def test_bench_runs_the_checkouts_bench_or_says_why_not(monkeypatch, tmp_path, capsys):
    out = run_cli("bench", "--help")
    assert out.returncode == 0 and "usage: python -m bench" in out.stdout
    monkeypatch.setattr(cli, "checkout_root", lambda: None)
    assert cli.main(["bench"]) == 2
    assert "source checkout" in capsys.readouterr().err
    assert cli.main(["demo"]) == 2
    assert "examples/quickstart.py not found" in capsys.readouterr().err
