"""Metrics and task names where Ray users look: the node's Prometheus endpoint and Ray's task list.

A 2-worker gang takes a few calls and one that raises; the test scrapes
``http://127.0.0.1:<MetricsExportPort>/metrics`` (the port is in ``ray.nodes()``)
until the gang's counters show them. Ray exports metrics every
``RAY_metrics_report_interval_ms`` (conftest sets 2 s for the test session; Ray's
default is 10 s), so the wait is bounded, never timed.
"""

from __future__ import annotations

import re
import time
import urllib.request

import numpy as np
import pytest
import ray

from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.runtime.metrics import args_nbytes, metrics_enabled, payload_nbytes

WAIT_S = 60.0
# The worker task methods a call runs as (runtime.worker): lazy, lazy without lengths, eager,
# each with a head (something routed) or named (nothing routed: see runtime.message).
TASK_METHODS = {"GangWorker.run"}  # the worker's one entry point for calls
LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>.*)\} (?P<value>\S+)$')


@remote_class(distributed=False)
class Metered:
    def __init__(self, device_mesh=None):
        self.mesh = device_mesh

    @remote_function(dispatch="all", collect="none")
    def step(self, x: np.ndarray) -> int:
        return int(x.shape[0])

    @remote_function(dispatch="all", collect="none")
    def boom(self) -> None:
        raise ValueError("boom on purpose")


def _metrics_url() -> str:
    here = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == here)
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


def _scrape(url: str, name: str, **labels: str) -> float:
    """Sum of the values of metric ``name`` over the series carrying ``labels`` (all processes)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = LINE.match(line)
        if m and m["name"] == name and all(f'{k}="{v}"' in m["labels"] for k, v in labels.items()):
            total += float(m["value"])
    return total


def _wait_for(url: str, expected: dict[str, float], **labels: str) -> dict[str, float]:
    """Scrape until every metric in ``expected`` reaches its value (or WAIT_S passes)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        got = {name: _scrape(url, name, **labels) for name in expected}
        if all(got[k] >= v for k, v in expected.items()) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


@pytest.mark.slow
def test_gang_metrics_reach_the_prometheus_endpoint_and_tasks_are_named(runtime, monkeypatch):
    from ray.util.state import list_actors, list_tasks

    assert metrics_enabled()  # the default
    runtime.initialize(groups=[DeviceGroup("metrics", 2, "cpu"), DeviceGroup("metrics_off", 1, "cpu")])
    gang = Metered(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="metrics")
    monkeypatch.setenv("TWINKLE_METRICS", "0")  # read where a gang is created
    off = Metered(device_mesh=DeviceMesh.from_sizes(dp_size=1), remote_group="metrics_off")
    monkeypatch.delenv("TWINKLE_METRICS")
    label, off_label = gang.topology()["label"], off.topology()["label"]
    assert (label, off_label) == ("metrics/Metered", "metrics_off/Metered")
    x = np.zeros(1000, dtype=np.float32)  # 4000 bytes to each worker per call ('all')
    calls = 3
    for _ in range(calls):
        assert gang.step(x)() == [1000, 1000]
        assert off.step(x)() == 1000  # one worker: the result itself
    with pytest.raises(ValueError, match="boom on purpose"):
        gang.boom()()

    url = _metrics_url()
    step = {"ray_twinkle_calls_total": calls, "ray_twinkle_call_seconds_count": 2 * calls,
            "ray_twinkle_routed_bytes_total": 2 * calls * x.nbytes}
    assert _wait_for(url, step, gang=label, method="step") == step
    boom = {"ray_twinkle_calls_total": 1, "ray_twinkle_call_errors_total": 2}
    assert _wait_for(url, boom, gang=label, method="boom") == boom
    assert _scrape(url, "ray_twinkle_call_errors_total", gang=label, method="step") == 0
    time.sleep(2.5)  # one more export interval: the gang with metrics off had its chance to show up
    assert _scrape(url, "ray_twinkle_calls_total", gang=off_label) == 0

    # Worker tasks are named 'group/Class.method' (Ray's task list, the dashboard, `ray timeline`);
    # with metrics off 'Class.method' (one name per class, not per gang).
    address = ray.get_runtime_context().gcs_address
    off_worker = list_actors(address=address, filters=[("name", "=", f"{off_label}/0")])[0]["actor_id"]
    deadline = time.monotonic() + WAIT_S
    while True:  # task events reach the GCS about once a second
        named = list_tasks(address=address, filters=[("name", "=", f"{label}.step")], limit=100)
        off_tasks = [t for t in list_tasks(address=address, filters=[("actor_id", "=", off_worker)],
                                           limit=100)
                     if t["func_or_class_name"] in TASK_METHODS]
        if (len(named) >= 2 * calls and len(off_tasks) >= calls) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(named) == 2 * calls
    assert {t["func_or_class_name"] for t in named} == TASK_METHODS
    assert len(off_tasks) == calls and {t["name"] for t in off_tasks} == {"Metered.step"}
    assert {t["func_or_class_name"] for t in off_tasks} == TASK_METHODS
    gang.close()
    off.close()


def test_argument_bytes_are_counted_without_pickling():
    torch = pytest.importorskip("torch")
    assert payload_nbytes(b"abcd") == 4 and payload_nbytes(bytearray(3)) == 3
    assert payload_nbytes(torch.zeros(8, dtype=torch.float64)) == 64
    assert payload_nbytes(torch.zeros(3).to_sparse()) == 0  # no nbytes: counts 0, never raises
    assert payload_nbytes([1, 2.0, "s", None]) == 0
    assert payload_nbytes({"a": np.zeros(2, dtype=np.int8), "b": [np.zeros(3, dtype=np.int8)]}) == 5
    rows = [{"x": np.zeros(4, dtype=np.uint8)}] * 1000  # long: estimated from its first items
    assert payload_nbytes(rows) == 4000
    assert args_nbytes((np.zeros(2, dtype=np.uint8), 3), {"k": b"xyz"}) == 5

    class Remote:  # an object that answers every attribute must not be asked
        def __getattr__(self, name):
            raise AssertionError(f"asked for {name}")

    assert payload_nbytes(Remote()) == 0
