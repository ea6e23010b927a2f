"""BENCHMARKS.md's generator (bench/report.py) on small fixtures: pure, no Ray.

The fixture ``data/bench_b1_quick.json`` is a real ``python -m bench --only B1 --quick --json``
line, cut to four rows with their samples dropped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the bench package lives at the repo root, not installed
    sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402

FIXTURE = Path(__file__).parent / "data" / "bench_b1_quick.json"

PEER = {"info": {"load_avg_start": [2.0, 1, 1], "load_avg_end": [5.5, 1, 1], "workers": [4, 24]},
        "rows": [{"name": "eager no-op, 24 workers", "kind": "eager", "workers": 24,
                  "twinkle_ray_s": 0.025, "twinkle_kit_s": 0.0165, "ratio": 1.55, "vs_floor": 1.17,
                  "target": "<= 1.0x one-hop floor", "ok": False}]}
W2 = {"name": "W2 weight sync 64 MB, tp=2 pp=2 dp=2 -> 2 samplers", "unit": "s", "twinkle_s": 1.5,
      "raw_s": 2.0, "ratio": 0.75, "bytes_ratio": 1.0, "target": "bytes sent = bytes kept",
      "checks": [["bytes_ratio", "<=", 1.0]], "commit": "abcdef0123456789", "load_avg": [1.0, 2.0]}


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_every_area_has_a_table_or_says_how_to_measure_it():
    text = report.render(report.load([FIXTURE]), [str(FIXTURE)])
    for title, *_ in report.AREAS:
        assert f"## {title}\n" in text
    call = _section(text, "Call path")
    assert "| B1 no-op call, 4 workers, eager (value back) | <= 1.0x the one-hop floor |" in call
    assert "1.26x the one-hop floor" in call and "| miss |" in call
    assert "`python -m bench --only B1 --quick --repeats 5`" in call  # --json dropped: reproduces the row
    assert "`b76fff506a+dirty`" in call and "0.7 -> 4.0" in call
    assert "0.93x | ok |" in call  # metrics on vs off, against its own target
    # no W2 in the source: the weight sync area names the command instead of failing
    assert "No figure in the source runs. Measure it with `python -m bench --only W2" in \
        _section(text, "Weight sync")


def test_peer_and_single_row_sources_land_in_their_areas(tmp_path):
    peer, w2 = tmp_path / "peer.json", tmp_path / "w2.json"
    peer.write_text("raylet warning on stdout\n" + json.dumps(PEER) + "\n")
    w2.write_text(json.dumps(W2) + "\n")
    text = report.render(report.load([FIXTURE, peer, w2]))
    side = _section(text, "Peer side by side")
    assert "| eager no-op, 24 workers |" in side and "1.55x; 1.17x the one-hop floor | miss |" in side
    assert "2.0 -> 5.5" in side and "not recorded" in side  # the peer's JSON has no commit
    sync = _section(text, "Weight sync")
    assert "| W2 weight sync 64 MB" in sync and "`abcdef0123`" in sync and "| ok |" in sync
    assert "busiest process 1.00x the bytes" in sync


def test_figures_of_each_row_kind():
    base = {"_run": {"command": "python -m bench --json", "commit": None, "load": None}}
    slope = {**base, "_key": "B6", "slope": True, "extra_ms_per_worker": 0.3,
             "twinkle_ms_per_worker": 0.9, "raw_ms_per_worker": 0.6, "workers_fitted": [1, 2, 4]}
    assert report.figure(slope).startswith("+0.300 ms per worker beyond raw")
    b10 = {**base, "_key": "B10", "name": "B10 driver CPU per lazy call, 4 workers", "unit": "us",
           "twinkle_s": 150e-6, "raw_s": 3e-3, "ratio": 0.05}
    assert report.figure(b10) == "150 µs; 0.05x raw"
    b8 = {**base, "_key": "B8", "makespan_s": 2.3, "vs_ideal": 1.1, "checks": [["vs_ideal", "<=", 1.15]]}
    assert report.figure(b8) == "2.300 s; 1.10x ideal" and report.verdict(b8) == "ok"
    b2 = {**base, "_key": "B2", "unit": "s", "twinkle_s": 1.2, "ratio": 3.9, "throughput_ratio": 0.26,
          "checks": [["throughput_ratio", ">=", 1.0]]}
    assert "throughput 0.26x raw" in report.figure(b2) and report.verdict(b2) == "miss"
    assert report.verdict({**base, "_key": "B7"}) == ""  # no target, no verdict
    assert report._command({**b10, "name": "B10 x"}) == "python -m bench --only B10"


def test_cli_writes_the_file(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    subprocess.run([sys.executable, "-m", "bench", "--report", "--from", str(FIXTURE), "--out", str(out)],
                   cwd=ROOT, check=True, timeout=120)
    assert out.read_text().startswith("# Benchmarks: the current figures")


def test_benchmarks_md_is_what_the_generator_makes_of_the_committed_runs(monkeypatch):
    """BENCHMARKS.md cannot drift: it is the report of bench/results/*.json, byte for byte
    (regenerate: ``python -m bench --report --from bench/results/*.json --out BENCHMARKS.md``)."""
    monkeypatch.chdir(ROOT)
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").glob("*.json"))
    assert sources, "no bench run in bench/results/"
    assert (ROOT / "BENCHMARKS.md").read_text() == report.render(report.load(sources), sources)


def test_rl_modes_side_by_side_is_an_area_of_its_own(tmp_path):
    """``python -m bench.rl_modes`` writes one indented document: a row per schedule."""
    fig = {"loop_s": 10.0, "median_step_s": 0.5, "samples_per_s": 250.0, "reward_first": 0.1,
           "reward_last": 0.3, "max_logprob_gap": None, "wall_s": 60.0, "speedup_vs_plain": 1.0}
    doc = {"example": "rlhf_grpo", "steps": 20, "seed": 0, "machine": "2 CPUs",
           "summary": {"plain": fig, "stream": {**fig, "loop_s": 5.0, "speedup_vs_plain": 2.0}}}
    path = tmp_path / "rl-modes-rlhf_grpo.json"
    path.write_text(json.dumps(doc, indent=1))
    rows = report.load([path])
    assert [r["_key"] for r in rows] == ["RL", "RL"]
    side = _section(report.render(rows), "RL loop side by side")
    assert "| rlhf_grpo stream, 20 steps, seed 0 |" in side
    assert "5.0 s for the loop" in side and "2.00x plain's speed" in side
    assert "`python -m bench.rl_modes --toy`" in side
