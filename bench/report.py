"""BENCHMARKS.md from bench runs: one table per area, every row with its target, figure, command,
commit and the machine's load. Pure: reads JSON, writes Markdown (no Ray).

Usage::

    python -m bench --json > run.json                     # a bench run (its JSON line)
    python -m bench --report --from run.json --out BENCHMARKS.md
    python -m bench --report --from run.json peer.json flow2node.json w.json --out BENCHMARKS.md
    python -m bench --report --only B1 --quick            # run, then print the report

Each ``--from`` file holds what one of these commands prints with ``--json`` (the last line that
starts with ``{`` is read, so a captured stdout with Ray's warnings in it works too):

- ``python -m bench`` (``{"mode", "command", "commit", "load_avg", "results": [...]}``);
- ``python -m bench.peer_twinkle_kit`` (``{"info", "rows"}``: the peer side by side);
- ``python -m bench.flow2node`` (one row, ``{"name": ...}``).

A row's area comes from its name's first word (``B1``..``B11``, ``F1``, ``W2``; the peer's
rows are their own area). An area with no row in the sources says so and names the command that
measures it. Rows of several runs of the same benchmark are all shown, each with its own run's
commit and load.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

# (area title, the benchmark keys in it, the command that measures the area, what it answers)
AREAS: list[tuple[str, tuple[str, ...], str, str]] = [
    ("Call path", ("B1", "B2", "B6", "B7", "B10"), "python -m bench --only B1,B2,B6,B7,B10",
     "what one call costs its caller and the gang, against raw Ray and a bare forwarding actor"),
    ("Flow", ("B3", "B4", "F1"), "python -m bench --only B3,B4; python -m bench.flow2node",
     "a batch into a gang, and one gang's outputs routed to another (one node, two raylets)"),
    ("Start-up", ("B5",), "python -m bench --only B5",
     "a gang of 4 with torch.distributed up, against a hand-written Ray gang"),
    ("Balance", ("B8",), "python -m bench --only B8",
     "a long-tailed batch: dispatch='balance' against slice_dp and the ideal makespan"),
    ("In flight", ("B11",), "python -m bench --only B11",
     "requests in flight on engines that batch continuously, read as they complete, against "
     "the zero-overhead pull and the batch-synchronous loop"),
    ("Overlap", ("B9",), "python -m bench --only B9",
     "generation of step k+1 overlapping training of step k (sync_weights(wait=False))"),
    ("Weight sync", ("W2",), "python -m bench --only W2",
     "trainer to sampler weights: bytes per process and wall time"),
    ("RL loop side by side", ("RL",), "python -m bench.rl_modes (--toy: examples/rlhf_grpo.py)",
     "GRPO plain, --async 1 and --stream on the same seed and steps: wall per step, samples/s and "
     "the reward (the plot: bench/results/rl-modes-<example>.png)"),
    ("Peer side by side", ("PEER",),
     "python -m bench.peer_twinkle_kit --only startup,call,flow --workers 4,24 (in a venv with twinkle-kit)",
     "the same workloads through twinkle-kit, the framework users switch from"),
]
KEYS = {key for _, keys, _, _ in AREAS for key in keys}


def load(paths: Iterable[str | Path]) -> list[dict]:
    """Every row of every source, each with its run's ``command``, ``commit`` and ``load``."""
    rows: list[dict] = []
    for path in paths:
        text = Path(path).read_text()
        try:  # a whole-file document (python -m bench.rl_modes writes one, indented)
            rows += rows_of(json.loads(text), source=str(path))
            continue
        except json.JSONDecodeError:
            pass
        lines = [ln for ln in text.splitlines() if ln.lstrip().startswith("{")]
        if not lines:
            raise ValueError(f"{path}: no JSON line (a line starting with '{{')")
        rows += rows_of(json.loads(lines[-1]), source=str(path))
    return rows


def rows_of(doc: dict, source: str = "") -> list[dict]:
    """The rows of one decoded JSON document (any of the shapes the module docstring lists)."""
    if "results" in doc:  # python -m bench
        machine = doc.get("machine", {})
        run = {"command": doc.get("command", "python -m bench"), "commit": doc.get("commit"),
               "load": doc.get("load_avg"), "mode": doc.get("mode"), "source": source,
               "machine": f"{machine['cpus']} CPUs, Ray {machine['ray']}" if machine else None,
               "wall_s": doc.get("wall_s")}
        return [{**row, "_run": run, "_key": _key(row)} for row in doc["results"]]
    if "summary" in doc and "example" in doc:  # python -m bench.rl_modes: one row per schedule
        toy = doc["example"] == "rlhf_grpo"
        run = {"command": doc.get("command", "python -m bench.rl_modes" + (" --toy" if toy else "")),
               "commit": doc.get("commit"), "load": doc.get("load_avg"), "source": source,
               "machine": doc.get("machine")}
        return [{**figures, "name": f"{doc['example']} {mode}, {doc['steps']} steps, seed {doc['seed']}",
                 "rl_mode": True, "_run": run, "_key": "RL"} for mode, figures in doc["summary"].items()]
    if "rows" in doc:  # python -m bench.peer_twinkle_kit
        info = doc.get("info", {})
        load_ = [info["load_avg_start"][0], info["load_avg_end"][0]] if "load_avg_start" in info else None
        run = {"command": info.get("command", "python -m bench.peer_twinkle_kit"),
               "commit": info.get("commit"), "load": load_, "source": source,
               "mode": "quick" if info.get("quick") else None}
        return [{**row, "_run": run, "_key": "PEER"} for row in doc["rows"]]
    if "name" in doc:  # one row: python -m bench.flow2node
        key = _key(doc)
        command = {"F1": "python -m bench.flow2node"}.get(
            key, doc.get("command", f"python -m bench --only {key}"))
        run = {"command": doc.get("command", command), "commit": doc.get("commit"),
               "load": doc.get("load_avg"), "source": source}
        return [{**doc, "_run": run, "_key": key}]
    raise ValueError(f"{source or 'document'}: not a bench JSON (no 'results', 'rows' or 'name')")


def _key(row: dict) -> str:
    return str(row.get("name", "")).split(" ", 1)[0].upper()


def _t(seconds: float, unit: str | None) -> str:
    if unit == "us":
        return f"{seconds * 1e6:,.0f} µs"
    if unit == "s":
        return f"{seconds:.3f} s"
    return f"{seconds * 1000:.2f} ms"


def figure(row: dict) -> str:
    """The row's figure in words: its time, and its ratios to what it is measured against."""
    unit = row.get("unit", "ms")
    if row.get("floor"):
        return f"{_t(row['floor_s'], unit)}; {row['ratio']:.2f}x raw"
    if row.get("slope"):
        return (f"+{row['extra_ms_per_worker']:.3f} ms per worker beyond raw "
                f"(twinkle_ray {row['twinkle_ms_per_worker']:.3f}, raw {row['raw_ms_per_worker']:.3f}; "
                f"workers {', '.join(str(w) for w in row.get('workers_fitted', []))})")
    if row.get("metrics_cost"):
        return f"{_t(row['on_s'], 'ms')} on, {_t(row['off_s'], 'ms')} off: {row['ratio']:.2f}x"
    if "requests_per_s" in row:
        return (f"{row['requests_per_s']:,.0f} requests/s ({row['per_request_group_ms']:.2f} ms per "
                f"request on a group's path; one ask {row['ask_ms']:.2f} ms alone)")
    if row.get("rl_mode"):
        return (f"{row['loop_s']:.1f} s for the loop, {row['median_step_s']:.2f} s per step (median), "
                f"{row['samples_per_s']:,.0f} samples/s; reward {row['reward_first']:.3f} -> "
                f"{row['reward_last']:.3f}; {row['speedup_vs_plain']:.2f}x plain's speed")
    if row.get("b11"):
        return f"{_t(row['twinkle_s'], 's')} vs {_t(row['raw_s'], 's')}: {row['ratio']:.3f}x"
    if row.get("b8_overhead"):
        return f"{row['overhead_per_chunk_s'] * 1000:.2f} ms per chunk; {row['vs_call']:.2f}x one call"
    if "makespan_s" in row:
        return f"{row['makespan_s']:.3f} s; {row['vs_ideal']:.2f}x ideal"
    if "twinkle_kit_s" in row:  # the peer
        cell = _t(row["twinkle_ray_s"], row.get("unit", "ms")), _t(row["twinkle_kit_s"], row.get("unit", "ms"))
        parts = [f"{cell[0]} vs {cell[1]} twinkle-kit: {row['ratio']:.2f}x"]
        if "vs_floor" in row:
            parts.append(f"{row['vs_floor']:.2f}x the one-hop floor")
        if "vs_smallest" in row:
            parts.append(f"{row['vs_smallest']:.2f}x its {row['smallest_workers']}-worker figure")
        return "; ".join(parts)
    parts = []
    if "twinkle_s" in row:
        parts.append(_t(row["twinkle_s"], unit))
    if "floor_ratio" in row:
        parts.append(f"{row['floor_ratio']:.2f}x the one-hop floor" if row["_key"] == "B1"
                     else f"throughput {row['floor_ratio']:.2f}x the one-hop floor's chain"
                     if row["_key"] == "B2" else f"{row['floor_ratio']:.2f}x the transfer floor")
    if "throughput_ratio" in row:
        parts.append(f"throughput {row['throughput_ratio']:.2f}x raw")
    elif "ratio" in row:
        against = "ideal" if row["_key"] == "B9" else "raw"
        if row["_key"] == "W2":
            against = "its baseline"
        parts.append(f"{row['ratio']:.2f}x {against}")
    if "bytes_ratio" in row:
        parts.append(f"busiest process {row['bytes_ratio']:.2f}x the bytes")
    if "twinkle_bytes_via_driver" in row:
        parts.append(f"{row['twinkle_bytes_via_driver'] + row['twinkle_bytes_via_dispatcher']} "
                     "payload bytes via driver and dispatchers")
    return "; ".join(parts) or "—"


def verdict(row: dict) -> str:
    """'ok', 'miss' or '' (no target) against the row's own checks."""
    if "ok" in row:
        return "ok" if row["ok"] else "miss"
    checks = row.get("checks")
    if not checks:
        return ""
    ops = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b,
           "==": lambda a, b: a == b}
    try:
        return "ok" if all(ops[op](row[k], bound) for k, op, bound in checks) else "miss"
    except KeyError:
        return ""


def _command(row: dict) -> str:
    """The run's command narrowed to the row's benchmark (``--only KEY``), output flags dropped."""
    run = row["_run"]
    words = run["command"].split()
    if row["_key"] not in KEYS - {"PEER", "F1"} or words[:3] != ["python", "-m", "bench"]:
        return run["command"]
    kept, skip = [], False
    for word in words[3:]:
        if skip:
            skip = False
        elif word in ("--only", "--out", "--from"):
            skip = True
        elif word not in ("--json", "--report") and not word.startswith(("--only=", "--out=")):
            kept.append(word)
    return " ".join(["python -m bench --only", row["_key"], *kept])


def _load(run: dict) -> str:
    load_ = run.get("load")
    if not load_:
        return "not recorded"
    return f"{load_[0]:.1f} -> {load_[1]:.1f}" if len(load_) > 1 else f"{load_[0]:.1f}"


def _commit(run: dict) -> str:
    commit = run.get("commit")
    if not commit:
        return "not recorded"
    head, _, dirty = commit.partition("+")
    return f"`{head[:10]}{'+' + dirty if dirty else ''}`"


def render(rows: list[dict], sources: Iterable[str] = ()) -> str:
    """BENCHMARKS.md: a header, then one table per area (in :data:`AREAS` order)."""
    sources = list(sources)
    out = [
        "# Benchmarks: the current figures",
        "",
        "<!-- Generated by `python -m bench --report`; edit bench/report.py, not this file. -->",
        "",
        "Generated from bench runs by `python -m bench --report --from <run.json> ... --out BENCHMARKS.md`"
        + (f" (sources: {', '.join(f'`{s}`' for s in sources)})" if sources else "") + ".",
        "Each row names the command that reproduces it, the commit it ran on and the machine's load",
        "average (1 minute) at the start and end of its run. `ok`/`miss` is against the row's own target",
        "(the targets are in the bench's code, `bench/cases.py`). Ratios are medians of alternating runs",
        "in one Ray; lower is better unless the row says throughput. What the figures mean, and how",
        "the bench measures: `docs/performance.md`; what past measurements decided: `docs/decisions/`.",
        "History lives in git (`git log -p BENCHMARKS.md`).",
    ]
    runs: dict[tuple, dict] = {}
    for r in rows:
        run = r["_run"]
        runs.setdefault((run.get("source"), run["command"]), run)
    if runs:
        out += ["", "| run | command | commit | machine | load | wall |", "|---|---|---|---|---|---|"]
        for run in runs.values():
            wall = f"{run['wall_s']:.0f} s" if run.get("wall_s") else ""
            out.append(f"| `{run.get('source') or '-'}` | `{run['command']}` | {_commit(run)} | "
                       f"{run.get('machine') or 'not recorded'} | {_load(run)} | {wall} |")
    for title, keys, command, what in AREAS:
        mine = [r for r in rows if r["_key"] in keys]
        anchor = title.lower().replace(" ", "-")
        # snippet markers: docs pages include one area's table with --8<-- "BENCHMARKS.md:<anchor>"
        out += ["", f"## {title}", "", f"<!-- --8<-- [start:{anchor}] -->",
                f"{what[0].upper()}{what[1:]}.", ""]
        if not mine:
            out.append(f"No figure in the source runs. Measure it with `{command}`.")
        else:
            out += ["| row | target | figure | | command | commit | load |", "|---|---|---|---|---|---|---|"]
            for r in mine:
                name = str(r.get("name", "")).replace("|", "\\|")
                out.append(f"| {name} | {str(r.get('target', '')).replace('|', '/')} | "
                           f"{figure(r).replace('|', '/')} | {verdict(r)} | `{_command(r)}` | "
                           f"{_commit(r['_run'])} | {_load(r['_run'])} |")
        out += ["", f"<!-- --8<-- [end:{anchor}] -->"]
    other = [r for r in rows if r["_key"] not in KEYS]
    if other:
        out += ["", "## Other rows", "", "| row | figure | command | commit | load |", "|---|---|---|---|---|"]
        for r in other:
            out.append(f"| {r.get('name', '')} | {figure(r)} | `{_command(r)}` | {_commit(r['_run'])} | "
                       f"{_load(r['_run'])} |")
    return "\n".join(out) + "\n"


def main(paths: list[str], out: str | None = None) -> str:
    """Render the report of ``paths``; write it to ``out`` when given. Returns the text."""
    text = render(load(paths), paths)
    if out:
        Path(out).write_text(text)
    return text


__all__ = ["AREAS", "load", "rows_of", "figure", "verdict", "render", "main"]
