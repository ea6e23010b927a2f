"""GRPO's three schedules side by side: plain, ``--async 1`` and ``--stream``, on the same seed and steps.

    .venv/bin/python -m bench.rl_modes                       # grpo.py --device cpu --quick (vLLM + Megatron)
    .venv/bin/python -m bench.rl_modes --toy                 # examples/rlhf_grpo.py --quick (no vLLM)
    .venv/bin/python -m bench.rl_modes --steps 20 --seed 1
    .venv/bin/python -m bench.rl_modes --before /tmp/base   # + plain on an older checkout (git archive REV | tar -x)

Runs the example once per schedule, one after another (each its own process and Ray), reads
each run's ``RESULT`` line and writes ``bench/results/rl-modes-<example>.json`` (per mode: the
seconds of every step, samples/s, the reward of every step, the training loop's and the whole
run's seconds, the stream's keys) and ``bench/results/rl-modes-<example>.png``: wall time per
step, samples/s and the reward curve of the three, in one figure (matplotlib, from the
``examples`` extra). Samples/s is the trained samples over the training loop's seconds (from
the first step to the last, start-up and checkpoint excluded). The runs share the machine with
whatever else runs on it: compare them within one invocation only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODES = {"plain": [], "async 1": ["--async", "1"], "stream": ["--stream"]}
KEEP = ("steps", "mode", "rewards", "step_s", "samples_per_s", "reward_first", "reward_last", "max_logprob_gap",
        "train_s", "seconds", "total_s", "gen_s", "inflight_syncs", "spanned", "max_staleness_seen",
        "max_staleness", "staleness_per_step", "spanned_per_step")

logger = logging.getLogger("bench.rl_modes")


BEFORE = "plain, before"  # the plain schedule on another checkout (--before)


def command(toy: bool, mode: str, steps: int, seed: int, root: Path = ROOT) -> list[str]:
    """The example's command line for one schedule (``root``: the checkout whose script runs).

    >>> command(True, "stream", 20, 0)[1:]
    ['examples/rlhf_grpo.py', '--quick', '--steps', '20', '--seed', '0', '--stream']
    """
    script = "examples/rlhf_grpo.py" if toy else "examples/vllm_megatron/grpo.py"
    if root != ROOT:
        script = str(root / script)
    device = [] if toy else ["--device", "cpu"]
    flags = MODES[mode] if mode in MODES else []
    return [sys.executable, script, *device, "--quick", "--steps", str(steps), "--seed", str(seed), *flags]


def result_of(stdout: str) -> dict:
    """The ``RESULT {json}`` line of a run's output (the last one).

    >>> result_of('step 1\\nRESULT {"steps": 1}\\n')
    {'steps': 1}
    """
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError("the run printed no RESULT line:\n" + stdout[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def run_mode(toy: bool, mode: str, steps: int, seed: int, timeout_s: float, root: Path = ROOT) -> dict:
    """One run of the example in ``mode``: its RESULT (the keys in KEEP) and its wall seconds."""
    argv = command(toy, mode, steps, seed, root)
    logger.info("running %s", " ".join(argv[1:]))
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": str(root)})
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{mode}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result = result_of(done.stdout)
    kept = {k: result[k] for k in KEEP if k in result}
    kept["loop_s"] = result.get("train_s", result.get("seconds"))
    if "samples_per_s" not in kept:  # an older checkout's RESULT: from its steps and the loop's seconds
        kept["samples_per_s"] = result["steps"] * 16 * 8 / kept["loop_s"]  # --quick: 16 prompts x 8
    kept["wall_s"] = wall
    return kept


def plot(figures: dict, path: Path, title: str) -> Path | None:
    """Wall per step, samples/s and the reward curve of every mode in one PNG (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for mode, f in figures.items():
        steps = range(1, len(f["step_s"]) + 1)
        a.plot(steps, f["step_s"], label=mode)
        c.plot(steps, f["rewards"], label=mode)
    b.bar(list(figures), [f["samples_per_s"] for f in figures.values()], color=[f"C{i}" for i in range(len(figures))])
    a.set(title="wall time per step", xlabel="step", ylabel="seconds")
    b.set(title="trained samples per second", ylabel="samples/s")
    c.set(title="mean reward per step", xlabel="step", ylabel="reward")
    a.legend()
    c.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--toy", action="store_true", help="examples/rlhf_grpo.py (no vLLM) instead of vllm_megatron/grpo.py")
    p.add_argument("--steps", type=int, default=None, help="steps of every run [40; 20 with --toy]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--out", default=None, help="the JSON path [bench/results/rl-modes-<example>.json]")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="also run the plain schedule of the checkout in DIR (e.g. the commit before a change)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    steps = args.steps or (20 if args.toy else 40)
    name = "rlhf_grpo" if args.toy else "vllm_megatron"
    out = Path(args.out) if args.out else RESULTS / f"rl-modes-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    figures: dict = {}
    runs = [(mode, ROOT) for mode in args.modes] + ([(BEFORE, Path(args.before).resolve())] if args.before else [])
    for mode, root in runs:  # each run's figures written as soon as it ends: a failed run keeps the others
        figures[mode] = run_mode(args.toy, mode, steps, args.seed, args.timeout_s, root)
        summary = write(figures, out, name, steps, args.seed)
    png = plot(figures, out.with_suffix(".png"), f"{name}: GRPO plain / --async 1 / --stream, {steps} steps, "
                                                 f"seed {args.seed}")
    for mode, s in summary.items():
        logger.info("%-8s loop %6.1fs  median step %.2fs  %6.0f samples/s  reward %.3f -> %.3f  x%.2f vs plain",
                    mode, s["loop_s"], s["median_step_s"], s["samples_per_s"], s["reward_first"] or 0,
                    s["reward_last"] or 0, s["speedup_vs_plain"] or 0)
    logger.info("wrote %s%s", out, f" and {png}" if png else " (no PNG: matplotlib is not installed)")
    return 0


def write(figures: dict, out: Path, name: str, steps: int, seed: int) -> dict:
    """The runs so far and their summary, as ``out`` (JSON); returns the summary."""
    base = figures.get("plain")
    summary = {mode: {"loop_s": f["loop_s"], "median_step_s": sorted(f["step_s"])[len(f["step_s"]) // 2],
                      "samples_per_s": f["samples_per_s"], "reward_first": f.get("reward_first"),
                      "reward_last": f.get("reward_last"), "max_logprob_gap": f.get("max_logprob_gap"),
                      "wall_s": f["wall_s"],
                      "speedup_vs_plain": base["loop_s"] / f["loop_s"] if base else None}
               for mode, f in figures.items()}
    doc = {"example": name, "steps": steps, "seed": seed, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
           "summary": summary, "runs": figures}
    out.write_text(json.dumps(doc, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(main())
