"""The benchmark suite runs in quick mode and reports every figure (no timing assertions).

The bench starts its own Ray in a subprocess, so the session Ray of the other
tests is untouched. What is checked is correctness: every benchmark produced
positive timings and ratios, and B4's payload (traced by unpickling) reached
the consumer workers only -- 0 bytes through the driver or a dispatcher --
while the tracer's self-check proves it would have seen a driver fetch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)  # the bench starts (and stops) its own local Ray
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"mode"')]
    assert lines, f"no JSON report on stdout:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def _rows(report: dict, prefix: str) -> list[dict]:
    return [r for r in report["results"] if r["name"].startswith(prefix) and not r.get("whatif")]


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_quick_bench_reports_every_benchmark(report):
    assert report["mode"] == "quick"
    for prefix, count in (("B1", 2), ("B2", 1), ("B3", 1), ("B4", 1), ("B5", 1), ("B6", 4)):
        rows = _rows(report, prefix)
        assert len(rows) == count, (prefix, [r["name"] for r in rows])
        for r in rows:
            for key in ("twinkle_s", "raw_s", "ratio"):
                assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (r["name"], key)
    assert [r["workers"] for r in _rows(report, "B6")] == [1, 2, 4, 8]  # 16 in the full run
    b2 = _rows(report, "B2")[0]
    assert b2["twinkle_calls_per_s"] > 0 and b2["raw_calls_per_s"] > 0


@pytest.mark.slow
def test_b4_payload_never_passes_driver_or_dispatcher(report):
    b4 = _rows(report, "B4")[0]
    total = b4["payload_bytes_total"]
    assert b4["twinkle_bytes_via_driver"] == 0
    assert b4["twinkle_bytes_via_dispatcher"] == 0
    assert len(b4["dispatcher_pids"]) == 2  # both dispatchers were found and checked
    assert b4["twinkle_bytes_to_consumers"] == total  # the tracer saw the payload arrive
    assert b4["raw_bytes_via_driver"] == 0 and b4["raw_bytes_to_consumers"] == total
    assert b4["tracer_self_check_bytes"] == total // 4  # and would have seen a driver fetch
