"""Run every benchmark, twinkle_ray vs raw Ray, in one Ray session; print a table (or JSON).

Usage::

    python -m bench             # full sizes (BENCHMARKS.md)
    python -m bench --quick     # scaled down (one gang per size shared): about 1.5 minutes on 2 cores
    python -m bench --json      # JSON on stdout, one line (the table goes to stderr)
    python -m bench --only B1,B4
    python -m bench --only B9   # generation overlapping training (sync_weights(wait=False))
    python -m bench --only B8   # a long-tailed batch: slice_dp vs dispatch='balance' (not in the default run)
    python -m bench --only B11  # requests in flight, as_completed (not in the default run)
    python -m bench --report --from run.json [more.json ...] --out BENCHMARKS.md   # no run: bench.report
    python -m bench --report --only B1 --quick    # run, then print the report (Markdown) instead of the table

It starts its own local Ray (loopback only) and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALL = ("B1", "B2", "B3", "B4", "B5", "B6", "B7", "B9", "B10", "W2")
# Run only when named: B8 sleeps through a 2 s long-tailed batch several times per mode (95 s
# with --quick on the loaded 2-core machine, 2026-11-25), too long for the default run.
# B11 sleeps through a 3 s heavy-tailed stream and its batch-synchronous loop per repeat.
ON_REQUEST = ("B8", "B11")
RAY_CPUS = 80  # virtual CPUs: room for a 32-worker gang and its raw twin side by side


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    p.add_argument("--json", action="store_true", help="print JSON on stdout, the table on stderr")
    p.add_argument("--only", default=",".join(ALL), help="comma list of B1..B11, W2 (B1-B3 run together; B8, B11 only when named)")
    p.add_argument("--repeats", type=int, default=None, help="override the repeat count of B1/B6")
    p.add_argument("--report", action="store_true",
                   help="print BENCHMARKS.md (bench.report): from --from files, else from this run")
    p.add_argument("--from", dest="sources", nargs="+", default=None, metavar="JSON",
                   help="with --report: the --json output of bench runs (no run is made)")
    p.add_argument("--out", default=None, help="with --report: write the report to this file")
    return p.parse_args(argv)


def _start_ray() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Workers import the bench's classes by name: put the repo root on their path.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    import ray

    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=True, dashboard_host="127.0.0.1",
             namespace="twinkle-bench", log_to_driver=False, logging_level="WARNING")


def run(argv: list[str] | None = None) -> dict:
    """Run the selected benchmarks; return the report dict (what ``--json`` prints)."""
    args = _parse(argv)
    only = {s.strip().upper() for s in args.only.split(",") if s.strip()}
    unknown = only - set(ALL) - set(ON_REQUEST)
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; choose from "
                         f"{', '.join(ALL + ON_REQUEST)}")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import ray

    from bench import cases

    cfg = cases.Config.quick() if args.quick else cases.Config()
    if args.repeats:
        cfg.repeats = args.repeats
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    results: list[dict] = []
    if only - {"W2"}:  # W2 starts its runtimes itself
        _start_ray()
        try:
            results += _in_one_ray(cfg, frozenset(only))
        finally:
            ray.shutdown()
    if "W2" in only:  # in a process of its own
        results += _w2(args.quick)
    return {
        "mode": "quick" if args.quick else "full",
        "command": "python -m bench" + " ".join(["", *(argv if argv is not None else sys.argv[1:])]),
        "commit": _commit(),
        "load_avg": [load_start, os.getloadavg()[0]],  # 1-minute load average at the start and the end
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "ray": ray.__version__,
            "platform": platform.platform(),
        },
        "config": {k: v for k, v in vars(cfg).items()},
        "wall_s": time.perf_counter() - t0,
        "results": results,
    }


def _commit() -> str | None:
    """The checked-out commit (``+dirty`` when the tree has changes), or None outside git."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _in_one_ray(cfg, only: frozenset) -> list[dict]:
    """The rows of every selected benchmark but W1, in this order (key B1: B1-B3 together).
    With ``cfg.shared_gangs`` (quick) :func:`bench.cases.bench_shared` runs B1-B4, B6, B7 and B10
    first, on one pool of gangs (B5 wants no other actor alive); the rows keep this order."""
    from bench import cases

    def b9():
        from bench import overlap

        return overlap.bench_overlap(steps=cfg.b9_steps, seconds=cfg.b9_seconds)

    def b8():  # the long tail: slice_dp vs dispatch='balance' (bench/longtail.py)
        from bench import longtail

        return longtail.bench_longtail(cfg)

    def b11():  # requests in flight: the stream vs the zero-overhead pull (bench/inflight.py)
        from bench import inflight

        return inflight.bench_inflight(cfg)

    benches = {
        "B1": lambda: cases.bench_gang4(cfg, only),
        "B4": lambda: [cases.bench_routing(cfg)],
        "B5": lambda: [cases.bench_startup(cfg)],
        "B6": lambda: cases.bench_scaling(cfg),
        "B7": lambda: cases.bench_first(cfg),
        "B9": b9,
        "B10": lambda: cases.bench_driver_cpu(cfg),
        "B8": b8,
        "B11": b11,
    }
    selected = [k for k in benches if k in only or (k == "B1" and only & {"B2", "B3"})]
    rows = cases.bench_shared(cfg, only) if cfg.shared_gangs else {}
    for key in selected:
        if key not in rows:
            rows[key] = benches[key]()
    return [r for key in selected for r in rows[key]]


def _w2(quick: bool) -> list[dict]:
    """W2 (:mod:`bench.weight_sync`) in a subprocess: one table row per size."""
    import subprocess

    cmd = [sys.executable, "-m", "bench.weight_sync", "--w2", "--json", *(["--quick"] if quick else [])]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"W2 failed (exit {out.returncode}): {out.stderr[-2000:]}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return [{"name": f"W2 weight sync {r['model_mb']:.0f} MB {r['size']} (resharded vs broadcast)", "unit": "s",
             "twinkle_s": r["resharded_s"], "raw_s": r["broadcast_s"], "ratio": r["ratio"], **r,
             "target": "wall <= 1.05x broadcast, busiest trainer <= 1.1x fair share",
             "checks": [["ratio", "<=", 1.05], ["busiest_vs_fair", "<=", 1.1]]} for r in data["W2"]]


def _fmt_time(seconds: float, unit: str) -> str:
    if unit == "us":
        return f"{seconds * 1e6:9.1f} us"
    return f"{seconds * 1000:9.2f} ms" if unit == "ms" else f"{seconds:9.3f} s "


def _passes(row: dict, checks) -> bool:
    ops = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b}
    return all(ops[op](row[key], bound) for key, op, bound in checks)


def _check(row: dict) -> str:
    """'ok' / 'MISS' against the row's target (and 'stretch ok' when a stretch target is met)."""
    target = row.get("target")
    if not target:
        return ""
    mark = "ok  " if _passes(row, row.get("checks", ())) else "MISS"
    if row.get("stretch"):
        mark += ", stretch ok  " if _passes(row, row["stretch"]) else ", stretch MISS"
    return f"{mark} ({target})"


def table(report: dict) -> str:
    """The report as a plain-text table."""
    lines = [f"twinkle_ray vs raw Ray -- {report['mode']} run, {report['machine']['cpus']} CPU(s), "
             f"Ray {report['machine']['ray']}, {report['wall_s']:.0f} s",
             "medians of alternating runs; ratio = twinkle_ray / raw, vs floor = twinkle_ray / one-hop "
             "floor (lower is better)", ""]
    head = (f"{'benchmark':<58} {'twinkle_ray':>12} {'raw Ray':>12} {'ratio':>7} {'vs floor':>8}  "
            "target")
    lines += [head, "-" * len(head)]
    scaling = [r for r in report["results"] if r.get("workers")]
    slopes = [r for r in report["results"] if r.get("slope")]
    whatifs = [r for r in report["results"] if r.get("whatif")]
    metrics = [r for r in report["results"] if r.get("metrics_cost")]
    b8 = [r for r in report["results"] if r.get("b8")]
    b11 = [r for r in report["results"] if r.get("b11")]
    for row in report["results"]:
        if row in scaling or row in whatifs or row in slopes or row in metrics or row in b8 or row in b11:
            continue
        unit = row.get("unit", "ms")
        if row.get("floor"):  # the one-hop floor: its time stands in the twinkle_ray column
            lines.append(f"{row['name']:<58} {_fmt_time(row['floor_s'], unit):>12} "
                         f"{_fmt_time(row['raw_s'], unit):>12} {row['ratio']:6.2f}x {'1.00x':>8}")
            continue
        vs_floor = f"{row['floor_ratio']:7.2f}x" if "floor_ratio" in row else f"{'':8}"
        lines.append(f"{row['name']:<58} {_fmt_time(row['twinkle_s'], unit):>12} "
                     f"{_fmt_time(row['raw_s'], unit):>12} {row['ratio']:6.2f}x {vs_floor}  {_check(row)}")
        if "staleness" in row:
            lines.append(f"   per step: samples {row['staleness']} version(s) older than the trainer; sync "
                         f"alone {row['sync_s']:.3f} s"
                         + (f"; {row['speedup_vs_sequential']:.2f}x the sequential step rate"
                            if "speedup_vs_sequential" in row else ""))
        if "busiest_vs_fair" in row:
            lines.append(f"   busiest trainer rank sent {row['busiest_trainer_mb']:.1f} MB ({row['busiest_vs_fair']:.2f}x "
                         f"fair share); busiest sampler {row['busiest_sampler_mb']:.1f} MB; total "
                         f"{row['total_mb']:.1f} MB = kept {row['kept_mb']:.1f} MB; broadcast's busiest trainer "
                         f"{row['broadcast_busiest_trainer_mb']:.1f} MB (twinkle_ray = resharded, raw = broadcast)")
        if "throughput_ratio" in row:
            lines.append(f"{'   throughput, calls/s':<58} {row['twinkle_calls_per_s']:12.0f} "
                         f"{row['raw_calls_per_s']:12.0f} {row['throughput_ratio']:6.2f}x")
        if "twinkle_bytes_via_driver" in row:
            mb = 1024 * 1024
            lines.append(f"   payload bytes: via driver {row['twinkle_bytes_via_driver']}, via dispatcher "
                         f"{row['twinkle_bytes_via_dispatcher']}, to consumer workers "
                         f"{row['twinkle_bytes_to_consumers'] / mb:.0f} MB "
                         f"(raw: driver {row['raw_bytes_via_driver']}, consumers "
                         f"{row['raw_bytes_to_consumers'] / mb:.0f} MB)")
            lines.append(f"   tracer self-check: one output fetched by the driver on purpose was seen as "
                         f"{row['tracer_self_check_bytes'] / mb:.0f} MB via the driver")
    if metrics:
        lines += ["", "Gang metrics on vs off (same run, one compare_many; ratio = on / off):",
                  f"{'':<58} {'on':>12} {'off':>12} {'ratio':>7} {'paired':>8}"]
        for row in metrics:
            on = "" if row.get("metrics_on", True) else " (TWINKLE_METRICS=0: off)"
            lines.append(f"{row['name'] + on:<58} {_fmt_time(row['on_s'], 'ms'):>12} "
                         f"{_fmt_time(row['off_s'], 'ms'):>12} {row['ratio']:6.2f}x "
                         f"{row['paired_ratio']:7.2f}x  {_check(row)}")
    if whatifs:
        lines += ["", "What-if rows (not twinkle_ray features; bounds of the design space, same run):"]
        for row in whatifs:
            unit = row.get("unit", "ms")
            extra = (f"  throughput {row['throughput_ratio']:.2f}x" if "throughput_ratio" in row else "")
            lines.append(f"{row['name']:<58} {_fmt_time(row['twinkle_s'], unit):>12} "
                         f"{_fmt_time(row['raw_s'], unit):>12} {row['ratio']:6.2f}x{extra}")
    if scaling:
        lines += ["", "B6 call overhead vs gang size (no-op call + collect, lazy then get)",
                  f"{'workers':>8} {'twinkle_ray':>12} {'raw Ray':>12} {'ratio':>7} {'extra':>10}"]
        for row in scaling:
            extra = (row["twinkle_s"] - row["raw_s"]) * 1000
            lines.append(f"{row['workers']:>8} {_fmt_time(row['twinkle_s'], 'ms'):>12} "
                         f"{_fmt_time(row['raw_s'], 'ms'):>12} {row['ratio']:6.2f}x {extra:7.2f} ms")
    if b8:
        from bench import longtail

        lines += longtail.table_lines(b8, _check)
    if b11:
        from bench import inflight

        lines += inflight.table_lines(b11, _check)
    for row in slopes:
        fitted = ", ".join(str(w) for w in row["workers_fitted"])
        lines.append(f"{'slope':>8} {row['twinkle_ms_per_worker']:9.3f} ms {row['raw_ms_per_worker']:9.3f} ms "
                     f"{'':7} {row['extra_ms_per_worker']:7.3f} ms per additional worker "
                     f"(least squares over {fitted})  {_check(row)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    args = _parse(argv)
    if args.report:
        from bench import report as md

        if args.sources:
            text = md.main(args.sources, args.out)
        else:
            result = run([a for a in (argv if argv is not None else sys.argv[1:])
                          if a not in ("--report", "--json")])
            text = md.render(md.rows_of(result))
            if args.out:
                Path(args.out).write_text(text)
        if not args.out:
            print(text)
        return 0
    report = run(argv)
    text = table(report)
    if "--json" in (argv if argv is not None else sys.argv[1:]):
        print(text, file=sys.stderr)
        print(json.dumps(report))  # one line: easy to find among anything else on stdout
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
