"""The RLHF examples' reward report: a text curve and, with matplotlib, a PNG.

Shared by ``rlhf_grpo.py``, ``rlhf_fsdp_hf.py`` and ``vllm_megatron/grpo.py`` (run as scripts,
this directory is on ``sys.path``; the last imports it as ``examples.reward_report``). Driver-side only: no worker imports it.

Example::

    from reward_report import reward_curve, save_plot
    print(reward_curve([0.1, 0.3, 0.6], window=2, baseline=0.1))
    save_plot([0.1, 0.3, 0.6], "curve.png", baseline=0.1, title="GRPO")
"""

from __future__ import annotations

import numpy as np


def reward_curve(rewards: list[float], window: int = 10, width: int = 40, *,
                 baseline: float) -> str:
    """The curve as text: mean reward per window of steps, with a bar."""
    lines = [f"reward curve (mean reward per window of steps; random policy ~ {baseline:.2f})"]
    for i in range(0, len(rewards), window):
        chunk = rewards[i:i + window]
        m = sum(chunk) / len(chunk)
        lines.append(f"  steps {i + 1:3d}-{i + len(chunk):3d}  {m:.3f}  {'#' * round(m * width)}")
    return "\n".join(lines)


def save_plot(rewards: list[float], path: str, *, baseline: float, title: str) -> str | None:
    """Save a PNG of the reward curve if matplotlib is installed; returns the path or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(rewards) + 1)
    ax.plot(steps, rewards, alpha=0.35, label="per step")
    k = min(10, len(rewards))
    smooth = np.convolve(rewards, np.ones(k) / k, mode="valid")
    ax.plot(steps[k - 1:], smooth, label=f"mean of {k}")
    ax.axhline(baseline, color="grey", linestyle=":", label="random policy")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def gen_seconds(spans: list[dict], tags: list) -> list[float]:
    """Per tag, the seconds of its generate call over the gang: from the first rank's start to
    the last rank's end (``spans``: every rank's ``generate_spans()``; a vLLM engine is one rank).

    >>> gen_seconds([{1: [10.0, 12.0]}, {1: [10.5, 13.0], 2: [14.0, 15.0]}], [1, 2])
    [3.0, 1.0]
    """
    out = []
    for tag in tags:
        mine = [s[tag] for s in spans if tag in s]
        out.append(max(e for _, e in mine) - min(b for b, _ in mine) if mine else float("nan"))
    return out
