"""examples/vllm_megatron: real vLLM engines and a real Megatron-Core trainer learning together on CPU.

- a missing vLLM / Megatron-Core raises MissingDependency naming `bash scripts/setup.sh rlhf`;
- an unsupported head_dim is refused before any engine (or gang) starts;
- the --quick run learns (reward_last clearly above reward_first) and after every weight sync both
  vLLM engines' log-probs on the probe batch equal the Megatron trainer's within 1e-4;
- --stream (AsyncLLM engines, one request per prompt in flight, weights synced in flight): learns,
  every trained sample within --max-staleness, samples generated under one version match the
  trainer's log-probs under it within 1e-4, the RESULT's stream keys agree;
- --pp 2 (TP=1 x PP=2) with --async 1 --balance 2 --long-tail: one run (each vLLM + Megatron start-up
  costs ~40 s of CI), shared by two tests: the pipeline-parallel trainer keeps the engines within
  the same bound at every step, and training one version behind with balanced generation learns.

The end-to-end runs need the stack (`bash scripts/setup.sh rlhf`); without it they skip with one line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
from pathlib import Path

import pytest

import twinkle_ray
from conftest import leftovers

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.vllm_megatron.common import MissingDependency  # noqa: E402

HAVE_STACK = all(importlib.util.find_spec(m) is not None for m in ("vllm", "megatron.core"))
needs_stack = pytest.mark.skipif(
    not HAVE_STACK, reason="vLLM / Megatron-Core not installed: run `bash scripts/setup.sh rlhf`")


def _modules():
    """The example's modules, pickled by value so the gang workers need no PYTHONPATH."""
    import ray.cloudpickle

    from examples.vllm_megatron import (
        common,
        grpo,
        hf_megatron,
        megatron_cpu,
        megatron_trainer,
        tiny_llama,
        vllm_sampler,
    )

    for mod in (common, tiny_llama, vllm_sampler, hf_megatron, megatron_cpu, megatron_trainer, grpo):
        ray.cloudpickle.register_pickle_by_value(mod)
    return grpo


@pytest.fixture
def bad_head_dim(tmp_path):
    """A tiny Llama with head_dim 16 (hidden 64 / 4 heads): vLLM's CPU attention refuses it."""
    from examples.vllm_megatron.tiny_llama import save_tiny_llama

    return save_tiny_llama(str(tmp_path / "hd16"), hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


# ------------------------------------------------------------------------------ no stack needed
def test_missing_vllm_or_megatron_names_the_install_command(monkeypatch, tmp_path):
    from examples.vllm_megatron import grpo
    from examples.vllm_megatron.tiny_llama import save_tiny_llama
    from examples.vllm_megatron.vllm_sampler import VLLMSampler

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as if it were not installed
    with pytest.raises(MissingDependency, match=r"needs `vllm`.*install: bash scripts/setup\.sh rlhf"):
        grpo.check_stack()
    with pytest.raises(MissingDependency, match=r"needs `vllm`.*install: bash scripts/setup\.sh rlhf"):
        grpo.main(["--device", "cpu", "--out-dir", str(tmp_path / "run")])
    # The sampler itself (built in-process: local mode), after its checks, before any engine.
    model = save_tiny_llama(str(tmp_path / "tiny"))
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the constructor sets the engine's env vars
    twinkle_ray.shutdown()
    twinkle_ray.initialize("local")
    try:
        mesh = twinkle_ray.DeviceMesh.from_sizes(dp_size=1, device_type="cpu")
        with pytest.raises(MissingDependency, match=r"VLLMSampler needs `vllm`.*bash scripts/setup\.sh rlhf"):
            VLLMSampler(model, device_mesh=mesh, cache_dir=str(tmp_path / "cache"))
    finally:
        twinkle_ray.shutdown()
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(MissingDependency, match=r"needs `vllm`.*needs `megatron\.core`.*bash scripts/setup\.sh rlhf"):
        grpo.check_stack()


def test_unsupported_head_dim_is_refused_before_any_engine(bad_head_dim, tmp_path, monkeypatch):
    from examples.vllm_megatron.vllm_sampler import VLLMSampler, check_model

    msg = r"head_dim=16 .* not supported by vLLM's CPU attention, which takes head_dim in \[32, 64"
    with pytest.raises(ValueError, match=msg):
        check_model(bad_head_dim, "cpu")
    check_model(bad_head_dim, "cuda")  # CUDA attention takes it: no refusal there
    monkeypatch.setattr(os, "environ", dict(os.environ))
    twinkle_ray.shutdown()
    twinkle_ray.initialize("local")
    try:
        mesh = twinkle_ray.DeviceMesh.from_sizes(dp_size=1, device_type="cpu")
        with pytest.raises(ValueError, match=msg + r".*no engine was started"):
            VLLMSampler(bad_head_dim, device_mesh=mesh)
        with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but the DeviceMesh has tp=1"):
            VLLMSampler(str(tmp_path), device_mesh=mesh, tensor_parallel_size=2)
    finally:
        twinkle_ray.shutdown()


def test_stream_flags_and_version_facts(capsys):
    """--stream's flags are checked before anything starts; a batch's staleness, spans and the syncs
    it was in flight across are read from its items' versions."""
    from collections import namedtuple

    from examples.vllm_megatron import grpo

    for argv in (["--stream", "--async", "1"], ["--stream", "--balance", "2"], ["--max-staleness", "-1"]):
        with pytest.raises(SystemExit):
            grpo.parse(argv)
        err = capsys.readouterr().err
        assert "--stream is its own schedule" in err or "--max-staleness takes an int >= 0" in err, err
    args = grpo.parse(["--stream", "--batch-size", "16"])
    assert args.max_staleness == 1  # the default bound
    assert grpo.stream_in_flight(args, twinkle_ray.DeviceMesh.from_sizes(dp_size=2, device_type="cpu")) == 8
    C = namedtuple("C", "index value rank versions")
    rows = [{}] * 8
    f = grpo.stream_versions([C(0, rows, 0, (2, 4)), C(1, rows, 1, (4, 4)), C(2, rows, 0, (3, 4))], 4)
    assert f["staleness"] == [2, 0, 1] and f["spanned"] == 16 and f["synced"] == [3, 4]
    assert (f["first"], f["last"], f["unversioned"]) == (2, 4, 0)
    result = grpo.stream_result({"facts": [f], "gaps": [None]}, 2, 1e-6)
    assert result["inflight_syncs"] == 2 and result["max_staleness_seen"] == 2 and result["spanned"] == 16
    assert result["gap_checked_steps"] == 0 and result["final_probe_gap"] == 1e-6


@needs_stack
def test_grpo_refuses_a_bad_head_dim_before_starting_gangs(bad_head_dim, tmp_path, ray_session):
    grpo = _modules()
    twinkle_ray.shutdown()
    with pytest.raises(ValueError, match=r"head_dim=16 .*no engine was started"):
        grpo.main(["--device", "cpu", "--model", bad_head_dim, "--out-dir", str(tmp_path)])
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


# ------------------------------------------------------------------------------ end to end
# Steps of both end-to-end runs (--quick's 40 less 10: ~20 s of CI). Rewards (first 5 -> last 5 steps) at
# 30 steps, 2026-11-25: the quick run 0.078 -> 0.309 in each of 3 runs (the test wants > +0.1); the
# --pp 2 --async 1 --balance 2 run 0.069 -> 0.186, 0.072 -> 0.216, 0.064 -> 0.146, and 0.066 -> 0.133 at
# step 30 of a 40-step run (the test wants a rise); a policy that does not learn stays at ~0.07 +- 0.01.
STEPS = 30


def _run(argv: list[str]) -> tuple[dict, str]:
    """grpo.main(argv) on the session's Ray: its RESULT and its stdout; nothing of it left behind."""
    grpo = _modules()
    twinkle_ray.shutdown()
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            assert grpo.main(argv) == 0
    finally:
        twinkle_ray.shutdown()
    out = buf.getvalue()
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("RESULT "), out[-3000:]
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)
    return json.loads(last[len("RESULT "):]), out


def _summary(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("rewards", "logprob_gaps")}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # vLLM start-up alone takes minutes on a loaded 2-core machine
@needs_stack
def test_quick_run_learns_with_the_sampler_matching_the_trainer_every_step(ray_session, capsys, tmp_path):
    result, out = _run(["--device", "cpu", "--quick", "--steps", str(STEPS), "--out-dir", str(tmp_path)])
    with capsys.disabled():
        print("\n" + "\n".join(line for line in out.splitlines() if not line.startswith("RESULT"))[-2500:])
        print(_summary(result))
    for key in ("steps", "reward_first", "reward_last", "max_logprob_gap", "sync_mb", "sync_s",
                "gang_startup_s", "total_s", "checkpoint"):
        assert key in result, key
    assert result["steps"] == STEPS and len(result["logprob_gaps"]) == STEPS
    assert result["trainer_layout"] == "tp=2"
    assert all(gap <= 1e-4 for gap in result["logprob_gaps"]), result["logprob_gaps"]
    assert result["reward_last"] > result["reward_first"] + 0.1, (result["reward_first"], result["reward_last"])
    assert result["sync_receivers"] == 2 and result["sync_mb"] > 1.0
    assert os.path.exists(os.path.join(result["checkpoint"], "model.safetensors"))
    assert result["greedy_reward"] >= 0.0  # the checkpoint loaded with from_pretrained and generated


@pytest.fixture(scope="module")
def pp_async_balanced_run(ray_session, tmp_path_factory) -> dict:
    """One run of --pp 2 --async 1 --balance 2 --long-tail, read by the two tests below (each vLLM +
    Megatron start-up costs ~40 s of CI; the run without these flags is the quick run's above)."""
    out_dir = tmp_path_factory.mktemp("pp_async_balanced")
    result, _ = _run(["--device", "cpu", "--quick", "--steps", str(STEPS), "--pp", "2", "--async", "1",
                      "--balance", "2", "--long-tail", "--out-dir", str(out_dir)])
    return result


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the first of the two takes the shared run's start-up
@needs_stack
def test_pipeline_parallel_trainer_keeps_the_sampler_in_step(pp_async_balanced_run, capsys):
    """TP=1 x PP=2: each stage sends its own layers into vLLM's weight-transfer engine, and after
    every sync (not blocking the driver: --async 1) both engines match the trainer within 1e-4."""
    result = pp_async_balanced_run
    with capsys.disabled():
        print("\n--pp 2 --async 1 --balance 2 --long-tail:", _summary(result))
    assert result["trainer_layout"] == "pp=2" and len(result["logprob_gaps"]) == STEPS
    assert result["sync_lanes"] == 2  # each stage sent its own layers into vLLM's weight-transfer engine
    assert result["max_logprob_gap"] <= 1e-4, result["logprob_gaps"]
    assert os.path.exists(os.path.join(result["checkpoint"], "model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(1500)
@needs_stack
def test_async_balanced_quick_run_learns_one_version_behind(pp_async_balanced_run):
    """--async 1 --balance 2 --long-tail: the engines generate step k+1 while Megatron trains step
    k, chunks of 2 prompts going to whichever engine is free; every step after the first trains on
    samples one version old, after every sync the engines match the trainer, and the long-tailed
    step is timed sliced and balanced. One vLLM run covers issue 25's --async, issue 26's --balance
    and --pp 2 (test_pipeline_parallel_trainer_keeps_the_sampler_in_step reads the same run); the
    run without these flags is test_quick_run_learns_with_the_sampler_matching_the_trainer_every_step."""
    result = pp_async_balanced_run
    versions = result["policy_versions"]
    assert result["async"] == 1 and len(versions) == len(result["step_s"]) == STEPS
    assert [k - v for k, v in enumerate(versions)] == [0] + [1] * (STEPS - 1), versions
    assert result["max_logprob_gap"] <= 1e-4, result["logprob_gaps"]
    assert result["reward_last"] > result["reward_first"], (result["reward_first"], result["reward_last"])
    assert result["balance"] == "2" and len(result["gen_s"]) == STEPS
    assert all(g > 0 for g in result["gen_s"]), result["gen_s"]
    long_tail = result["long_tail"]
    assert len(long_tail["max_tokens"]) == 16
    assert long_tail["slice_dp_s"] > 0 and long_tail["balance_s"] > 0


def _syncs_land_in_flight() -> bool:
    """Whether this runtime applies a sync inside a running balanced call (the in-flight interface;
    its ``max_staleness=`` on balanced methods comes with it). Before it, a sync waits for the call."""
    import inspect

    return "max_staleness" in inspect.signature(twinkle_ray.remote_function).parameters


@pytest.mark.slow
@pytest.mark.timeout(1500)
@needs_stack
def test_stream_quick_run_learns_with_partial_rollouts(ray_session, capsys, tmp_path):
    """--stream: the engines are AsyncLLMs with one request per prompt in flight, read with
    as_completed; the weight sync after each step does not wait and lands in flight (keep-mode
    pause, update, resume) once the runtime applies syncs inside running calls. Every sample
    trained began at most --max-staleness (1) versions behind the trainer; samples generated under
    one version match the trainer's log-probs under that version within 1e-4, and so does the
    probe batch after the last sync; the RESULT's stream keys agree; the policy learns."""
    result, out = _run(["--device", "cpu", "--quick", "--steps", str(STEPS), "--stream", "--out-dir", str(tmp_path)])
    with capsys.disabled():
        print("\n--stream:", {k: result[k] for k in ("reward_first", "reward_last", "max_logprob_gap",
                                                      "inflight_syncs", "spanned", "max_staleness_seen",
                                                      "samples_per_s", "train_s", "total_s")})
    for key in ("reward_first", "reward_last", "max_logprob_gap", "inflight_syncs", "spanned",
                "max_staleness_seen", "max_staleness", "steps", "samples_per_s"):
        assert key in result, key
    assert result["mode"] == "stream" and result["steps"] == STEPS and result["max_staleness"] == 1
    per_step = result["staleness_per_step"]
    assert len(per_step) == STEPS and result["max_staleness_seen"] == max(per_step) <= 1, per_step
    assert result["max_logprob_gap"] <= 1e-4 and result["final_probe_gap"] <= 1e-4, result["logprob_gaps"]
    assert result["gap_checked_steps"] >= 1 and result["unversioned"] == 0
    assert result["spanned"] == sum(result["spanned_per_step"])
    assert (result["spanned"] > 0) == (result["inflight_syncs"] > 0)
    if _syncs_land_in_flight():
        assert result["inflight_syncs"] >= 1 and result["spanned"] >= 1, result
    assert result["reward_last"] > result["reward_first"] + 0.05, (result["reward_first"], result["reward_last"])
