"""The benchmark suite runs in quick mode and reports every figure (no timing assertions).

The bench starts its own Ray in a subprocess, so the session Ray of the other
tests is untouched. What is checked is correctness: every benchmark produced
positive timings and ratios (B1 also against the one-hop floor, B6 also its
per-worker slopes), and B4's payload (traced by unpickling) reached
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
if str(ROOT) not in sys.path:  # the bench package lives at the repo root, not installed
    sys.path.insert(0, str(ROOT))


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
    """The rows of ``prefix`` (what-if and metrics-cost rows aside)."""
    return [r for r in report["results"]
            if r["name"].split(" ", 1)[0] == prefix and not r.get("whatif")
            and not r.get("metrics_cost")]


def _positive(row: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, (row["name"], key)


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_quick_bench_reports_every_benchmark(report):
    assert report["mode"] == "quick"
    b1 = _rows(report, "B1")
    floor = [r for r in b1 if r.get("floor")]
    b1 = [r for r in b1 if not r.get("floor")]
    b6 = [r for r in _rows(report, "B6") if not r.get("slope")]
    for rows, count in ((b1, 2), (_rows(report, "B2"), 2), (_rows(report, "B3"), 1),
                        (_rows(report, "B4"), 1), (_rows(report, "B5"), 1), (b6, 4),
                        (_rows(report, "B7"), 1), (_rows(report, "B10"), 2)):
        assert len(rows) == count, [r["name"] for r in rows]
        for r in rows:
            _positive(r, "twinkle_s", "raw_s", "ratio")
            if not r.get("workers") and not r["name"].startswith("B7"):
                assert r["target"] and r["checks"], r["name"]
    # the one-hop floor is a regular row, and each B1 row has its ratio to it
    assert len(floor) == 1
    _positive(floor[0], "floor_s", "raw_s", "ratio")
    for r in b1:
        _positive(r, "floor_s", "floor_ratio")
        assert r["floor_s"] == floor[0]["floor_s"]  # one rotation: the same floor samples
    assert [r["workers"] for r in b6] == [1, 2, 4, 8]  # 16 and 32 in the full run
    b10 = _rows(report, "B10")  # the driver's CPU per lazy call: flat in the gang's size
    assert [r["gang_size"] for r in b10] == [4, 8]
    assert b10[1]["vs_smallest"] == pytest.approx(b10[1]["twinkle_s"] / b10[0]["twinkle_s"])
    [slope] = [r for r in _rows(report, "B6") if r.get("slope")]
    assert slope["workers_fitted"] == [1, 2, 4, 8]
    for key in ("twinkle_ms_per_worker", "raw_ms_per_worker", "extra_ms_per_worker"):
        assert math.isfinite(slope[key]), key
    assert slope["extra_ms_per_worker"] == pytest.approx(
        slope["twinkle_ms_per_worker"] - slope["raw_ms_per_worker"])
    b2, b2_floor = _rows(report, "B2")  # vs raw, and vs the one-hop floor's own chain
    assert b2["twinkle_calls_per_s"] > 0 and b2["raw_calls_per_s"] > 0
    _positive(b2_floor, "floor_s", "floor_ratio", "floor_calls_per_s")
    assert b2_floor["floor_ratio"] == pytest.approx(b2_floor["floor_s"] / b2_floor["twinkle_s"])
    b9 = _rows(report, "B9")  # generation overlapping training, and the sequential step
    assert [r["name"].split(" ", 2)[1] for r in b9] == ["overlapped", "sequential"], b9
    for r in b9:
        _positive(r, "twinkle_s", "raw_s", "ratio", "sync_s")
        assert r["steps"] == report["config"]["b9_steps"]
    w2 = _rows(report, "W2")  # resharded weight sync vs per-stage gather + broadcast, three layouts
    assert [r["size"] for r in w2] == ["tp1xpp1xdp1->1", "tp2xpp2xdp1->2", "tp2xpp2xdp2->4"], w2
    for r in w2:  # byte counts, not times: each trainer rank sends its own share, all of it kept
        _positive(r, "twinkle_s", "raw_s", "ratio", "model_mb")
        assert r["bit_exact"] and r["busiest_vs_fair"] <= 1.1 and r["total_mb"] == r["kept_mb"], r
    metrics = [r for r in report["results"] if r.get("metrics_cost")]  # B1 metrics on vs off
    assert [r["name"].rsplit(", ", 1)[1] for r in metrics] == ["eager", "lazy"]
    for r in metrics:
        _positive(r, "on_s", "off_s", "ratio", "paired_ratio")


def test_scaling_slope_is_least_squares_per_worker():
    from bench.cases import scaling_slope

    rows = [{"workers": n, "twinkle_s": (3.0 + 0.5 * n) / 1000, "raw_s": (1.0 + 0.25 * n) / 1000}
            for n in (1, 2, 4, 8)]
    got = scaling_slope(rows)
    assert got["twinkle_ms_per_worker"] == pytest.approx(0.5)
    assert got["raw_ms_per_worker"] == pytest.approx(0.25)
    assert got["extra_ms_per_worker"] == pytest.approx(0.25)


def test_table_marks_targets():
    from bench.run import table

    b1 = {"name": "B1 x", "unit": "ms", "twinkle_s": 0.005, "raw_s": 0.004, "ratio": 1.25,
          "floor_s": 0.006, "floor_ratio": 0.83, "target": "t1", "checks": [["floor_ratio", "<=", 1.0]],
          "stretch": [["ratio", "<=", 1.5]]}
    floor = {"name": "B1 floor", "unit": "ms", "floor": True, "floor_s": 0.006, "raw_s": 0.004,
             "ratio": 1.5}
    b2 = {"name": "B2 x", "unit": "s", "twinkle_s": 1.0, "raw_s": 0.5, "ratio": 2.0,
          "twinkle_calls_per_s": 100.0, "raw_calls_per_s": 200.0, "throughput_ratio": 0.5,
          "target": "t2", "checks": [["throughput_ratio", ">=", 0.8]]}
    b6 = [{"name": f"B6 {n}", "workers": n, "twinkle_s": 0.001 * n, "raw_s": 0.001 * n, "ratio": 1.0}
          for n in (1, 2)]
    slope = {"name": "B6 slope", "slope": True, "workers_fitted": [1, 2], "twinkle_ms_per_worker": 1.0,
             "raw_ms_per_worker": 1.0, "extra_ms_per_worker": 0.0, "target": "t6",
             "checks": [["extra_ms_per_worker", "<=", 0.25]]}
    text = table({"mode": "quick", "machine": {"cpus": 2, "ray": "x"}, "wall_s": 1.0,
                  "results": [b1, floor, b2, *b6, slope]})
    lines = text.splitlines()
    assert any("B1 x" in ln and "0.83x" in ln and "ok" in ln and "stretch ok" in ln for ln in lines)
    assert any("B1 floor" in ln and "6.00 ms" in ln for ln in lines)
    assert any("B2 x" in ln and "MISS (t2)" in ln for ln in lines)
    assert any("slope" in ln and "0.000 ms per additional worker" in ln and "ok" in ln for ln in lines)


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


@pytest.mark.slow
def test_b6_paths_times_both_paths_and_raw_at_every_size(runtime):
    """bench.b6_paths (run by hand, like the peer bench): a tiny run on the session's Ray gives
    positive medians for both paths and raw Ray at each size, and a slope for each."""
    from bench import b6_paths

    out = b6_paths.run([1, 2], repeats=2)
    assert sorted(out["medians_ms"]) == [1, 2]
    for row in out["medians_ms"].values():
        assert set(row) == {"lazy then get", "eager", "raw"}
        assert all(v > 0 for v in row.values()), row
    assert set(out["slopes_ms_per_worker"]) == {"lazy then get", "eager", "raw"}
    assert all(math.isfinite(v) for v in out["slopes_ms_per_worker"].values())


@pytest.mark.slow
def test_b11_in_flight_rows(runtime):
    """bench.inflight (B11, run on request): a tiny run on the session's Ray gives its five
    rows (the last: a weight sync mid-stream), each with positive figures and its own target."""
    from bench import cases, inflight

    cfg = cases.Config.quick()
    cfg.chain_repeats = 1
    rows = inflight.bench_inflight(cfg, items=48, pull_s=0.3, noop_items=64, own_runtime=False)
    assert [r["name"].rsplit(": ", 1)[-1] for r in rows[:3]] == [
        "stream vs zero-overhead pull", "time to first result", "stream vs batch-synchronous loop"]
    assert rows[3]["requests_per_s"] > 0 and rows[3]["ask_ms"] > 0
    assert rows[4]["name"].startswith("B11 weight sync mid-stream") and rows[4]["in_flight"] in (0, 1)
    assert 0 <= rows[4]["started_on_new"] <= 48
    for r in rows:
        assert r["b11"] and r["target"] and r["checks"], r["name"]
        assert r["twinkle_s"] > 0 and r["raw_s"] > 0 and math.isfinite(r["ratio"]), r
    assert rows[0]["raw_s"] == pytest.approx(0.3)  # scaled to the zero-overhead pull
