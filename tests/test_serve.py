"""Ray Serve: a replica owns a gang; JSON over HTTP on loopback; a dead worker replaces the replica.

Runs in the test session's Ray. The application is built from
``deploy/serve.yaml`` (its import path and args), so the config ``serve run``
uses is the one exercised here, on a free loopback port.
"""

from __future__ import annotations

import importlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from twinkle_ray import DeviceGroup, PlacementError
from twinkle_ray.serve import check_cluster_fits, deployment_options, replica_bundles

ROOT = Path(__file__).resolve().parent.parent
APP = "twinkle-sampler-test"
DEPLOY_TIMEOUT_S = 120.0
RECOVER_TIMEOUT_S = 120.0


# -- pure helpers ------------------------------------------------------------------------------
def test_replica_bundles_put_the_replica_first():
    g = DeviceGroup("s", 4, "cuda", gpus_per_worker=2)
    assert replica_bundles(g) == [{"CPU": 1.0}, {"GPU": 2, "CPU": 1}, {"GPU": 2, "CPU": 1}]
    opts = deployment_options(g, replica_resources={"CPU": 2, "GPU": 1}, num_replicas=3)
    assert opts["placement_group_bundles"][0] == {"CPU": 2, "GPU": 1}
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    assert opts["placement_group_strategy"] == "PACK" and opts["num_replicas"] == 3
    with pytest.raises(ValueError, match="positive"):
        replica_bundles(g, {"CPU": 0})


def test_cluster_that_can_never_hold_the_replicas_fails_at_once(ray_session):
    with pytest.raises(PlacementError, match=r"need \{CPU: 300, GPU: 200\}"):
        check_cluster_fits(DeviceGroup("s", 2, "cuda"), num_replicas=100)
    check_cluster_fits(DeviceGroup("s", 2, "cuda"))


# -- a live application --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, data: bytes, timeout: float = 30.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"error": text.decode(errors="replace")}
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, {"error": str(e)}


def ask(url: str, i: int) -> tuple[int, dict]:
    body = {"prompt": f"hello {i}", "max_tokens": 8, "temperature": 0.7, "seed": i}
    return post(url, json.dumps(body).encode())


def _config_app() -> dict:
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    [app] = config["applications"]
    return app


def _gang_actors() -> list[dict]:
    """Live named actors of replica gangs: {'name': 'sampler/TinySampler/1', 'namespace': ...}."""
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"].startswith("twinkle-serve-")]


def _run_bounded(fn, timeout_s: float):
    """Run ``fn`` in a thread; fail the test (instead of hanging) if it takes longer."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised below
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        pytest.fail(f"{fn} did not finish within {timeout_s:g}s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.fixture(scope="module")
def sampler_url(ray_session):
    import sys

    from ray import serve

    if str(ROOT) not in sys.path:  # the driver imports examples.serve_sampler like `serve run` does
        sys.path.insert(0, str(ROOT))
    app_cfg = _config_app()
    module, attr = app_cfg["import_path"].split(":")
    build = getattr(importlib.import_module(module), attr)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        _run_bounded(lambda: serve.run(build(app_cfg.get("args")), name=APP,
                                       route_prefix=app_cfg["route_prefix"]), DEPLOY_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}{app_cfg['route_prefix']}"
    finally:
        _run_bounded(serve.shutdown, 60)
    deadline = time.monotonic() + 30
    while _gang_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _gang_actors(), "serve.shutdown() left gang actors alive"


@pytest.mark.slow
def test_concurrent_requests_are_batched_across_dp_ranks(sampler_url):
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: ask(sampler_url, i), range(8)))
    assert [s for s, _ in answers] == [200] * 8, answers
    assert {o["rank"] for _, o in answers} == {0, 1}  # one batch split over both dp ranks
    assert max(o["batch_size"] for _, o in answers) > 1
    assert all(isinstance(o["text"], str) and len(o["text"]) == 8 for _, o in answers)
    # same request, same answer (seeded sampling; every rank holds the same weights)
    assert ask(sampler_url, 3)[1]["text"] == answers[3][1]["text"]


@pytest.mark.parametrize("data, status, words", [
    (b"not json", 400, "not JSON"),
    (b"\x80\x04\x95pickle-bytes", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"prompt": "x", "shell": "rm"}).encode(), 400, "unknown field"),
    (json.dumps({"prompt": "x", "max_tokens": 10_000}).encode(), 400, "max_tokens"),
])
@pytest.mark.slow
def test_bad_requests_get_a_json_error(sampler_url, data, status, words):
    code, body = post(sampler_url, data)
    assert code == status and words in body["error"]


@pytest.mark.slow
def test_dead_worker_gets_the_replica_replaced(sampler_url, ray_session):
    import ray

    status, before = ask(sampler_url, 0)
    assert status == 200
    [victim] = [a for a in _gang_actors() if a["name"].endswith("/TinySampler/1")]
    old_namespace = victim["namespace"]
    ray.kill(ray.get_actor(victim["name"], namespace=old_namespace), no_restart=True)

    seen, deadline = [], time.monotonic() + RECOVER_TIMEOUT_S
    while time.monotonic() < deadline:
        status, out = ask(sampler_url, 1)
        seen.append(status)
        if status == 200 and out["replica"] != before["replica"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"replica not replaced within {RECOVER_TIMEOUT_S:g}s; statuses {seen[-10:]}")
    # the new replica serves a whole batch again, on a fresh gang; the old gang is gone
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: ask(sampler_url, i), range(4)))
    assert [s for s, _ in answers] == [200] * 4
    namespaces = {a["namespace"] for a in _gang_actors()}
    assert old_namespace not in namespaces and len(namespaces) == 1
