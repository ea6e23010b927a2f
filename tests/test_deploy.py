"""deploy/: the Serve config, the job runtime_env and the KubeRay manifests agree with the repo.

No Kubernetes here: the manifests are parsed and cross-checked (entrypoints name
files that exist, import paths resolve and build, the embedded Serve config and
runtime_env are the files in deploy/, the clusters can hold what they run).
The Serve config is also run for real in tests/test_serve.py.
"""

from __future__ import annotations

import importlib
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def load(rel: str) -> dict:
    return yaml.safe_load((DEPLOY / rel).read_text())


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # like `serve run` from the repo root


def _pod_totals(cluster: dict) -> dict[str, float]:
    """CPU/GPU the cluster's pods declare (limits x replicas; rayStartParams overrides)."""
    total = {"CPU": 0.0, "GPU": 0.0}
    groups = [(cluster["headGroupSpec"], 1)] + [
        (g, g.get("replicas", 1)) for g in cluster.get("workerGroupSpecs", [])
    ]
    for group, replicas in groups:
        [container] = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        params = group.get("rayStartParams") or {}
        cpu = float(params.get("num-cpus", limits.get("cpu", 0)))
        gpu = float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
        total["CPU"] += cpu * replicas
        total["GPU"] += gpu * replicas
    return total


def _check_cluster(cluster: dict) -> None:
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["authOptions"]["mode"] == "token"  # Ray's token auth stays on
    images = {c["image"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
              for c in g["template"]["spec"]["containers"]}
    assert images == {"twinkle-ray:0.1.0"}
    assert "twinkle-ray:0.1.0" in (DEPLOY / "Dockerfile").read_text()


def test_serve_config_validates_and_its_import_path_builds():
    from ray.serve.schema import ServeDeploySchema

    config = load("serve.yaml")
    ServeDeploySchema.model_validate(config)
    assert config["http_options"]["host"] == "127.0.0.1"  # loopback unless a pod needs more
    for app in config["applications"]:
        module, attr = app["import_path"].split(":")
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file()
        built = getattr(importlib.import_module(module), attr)(app.get("args"))
        assert type(built).__name__ == "Application"


def test_build_app_rejects_unknown_args():
    from examples.serve_sampler import build_app

    with pytest.raises(ValueError, match="unknown argument"):
        build_app({"rank": 2})


def test_runtime_env_file_is_a_valid_job_runtime_env():
    from ray.runtime_env import RuntimeEnv

    env = load("runtime_env.yaml")
    RuntimeEnv(**env)
    assert env["working_dir"] == "."
    assert ".venv/" in env["excludes"] and ".git/" in env["excludes"]


def test_rayjob_runs_an_example_with_the_runtime_env_file():
    job = load("kuberay/rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "python" and (ROOT / argv[1]).is_file(), argv
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == load("runtime_env.yaml")
    cluster = job["spec"]["rayClusterSpec"]
    _check_cluster(cluster)
    # the quickstart's groups: sampler 4 GPUs + trainer 4 GPUs, one CPU per worker
    from examples.quickstart import main  # noqa: F401  (the entrypoint imports cleanly)

    totals = _pod_totals(cluster)
    assert totals["GPU"] >= 8 and totals["CPU"] >= 8, totals


def test_rayservice_serves_the_serve_config():
    from ray.serve.schema import ServeDeploySchema

    from twinkle_ray import DeviceGroup
    from twinkle_ray.serve import replica_bundles

    svc = load("kuberay/rayservice.yaml")
    assert (svc["apiVersion"], svc["kind"]) == ("ray.io/v1", "RayService")
    embedded = yaml.safe_load(svc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(embedded)
    assert embedded["applications"] == load("serve.yaml")["applications"]
    assert embedded["http_options"]["host"] == "0.0.0.0"  # a pod's Service must reach it
    cluster = svc["spec"]["rayClusterConfig"]
    _check_cluster(cluster)
    assert "ENV PYTHONPATH=/home/ray/twinkle_ray" in (DEPLOY / "Dockerfile").read_text()
    for app in embedded["applications"]:
        args = app["args"]
        group = DeviceGroup("sampler", args["ranks"], args["device_type"],
                            gpus_per_worker=args["gpus_per_worker"])
        need = {"CPU": 0.0, "GPU": 0.0}
        for bundle in replica_bundles(group) * args["num_replicas"]:
            for k, v in bundle.items():
                need[k] += v
        totals = _pod_totals(cluster)
        assert all(totals[k] >= v for k, v in need.items()), (need, totals)


def test_docs_name_the_deploy_files():
    text = (ROOT / "docs" / "deploy.md").read_text()
    for rel in ("deploy/serve.yaml", "deploy/runtime_env.yaml", "deploy/kuberay/rayjob.yaml",
                "deploy/kuberay/rayservice.yaml", "ray job submit", "serve run"):
        assert rel in text, rel
