"""The driver killed (issue 20, item 2): examples/rlhf_grpo.py SIGKILLed mid-run, then --resume.

The slow test runs the example as its own driver (embedded Ray, private
RAY_TMPDIR so no other Ray on the machine is touched), SIGKILLs it a few
steps after its first checkpoint, and checks:

- every process of the dead run (its embedded Ray: GCS, raylet, agents,
  workers) is gone: the run's actors and placement groups lived in that GCS,
  which no longer exists, so none of them survives;
- ``--resume`` continues after the newest complete checkpoint (a torn newer
  one, planted here, is skipped);
- with the same seed the whole reward curve (the steps before the
  checkpoint, restored from it, and those after, recomputed) equals an
  uninterrupted run's exactly: every source of randomness (sampler RNGs,
  loader order, driver RNGs) is in the checkpoint, and the trainer's math is
  deterministic on CPU (gloo all-reduce of two ranks, Adam).

It prints the figures for docs/failures.md: steps redone and the time from
restarting the driver to being back at the step the killed run had reached.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from embedded_child import descendants

import twinkle_ray
from conftest import leftovers
from conftest import load_example as _load_example
from twinkle_ray.checkpoint import MANIFEST, CheckpointDir

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rlhf_grpo.py"
STEP_LINE = re.compile(r"^step +(\d+)/(\d+) ", re.M)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class _TreeWatch:
    """When the processes of a killed driver's tree went, seconds after the kill: ``core_s`` (all
    but the driver and Ray's agents: the GCS, raylet, workers) and ``all_s`` (every one). A thread
    of the test reads /proc every 0.2 s while the test goes on, until all are gone or :meth:`stop`."""

    def __init__(self, tree: dict[int, str], driver_pid: int):
        self.tree, self.killed_at = tree, time.monotonic()
        self.core = {p for p, c in tree.items() if p != driver_pid and "Agent" not in c}
        self.core_s: float | None = None
        self.all_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tree-watch", daemon=True)
        self._thread.start()

    def _record(self) -> None:
        now = time.monotonic() - self.killed_at
        if self.core_s is None and not any(_alive(p) for p in self.core):
            self.core_s = now
        if self.all_s is None and not any(_alive(p) for p in self.tree):
            self.all_s = now

    def _watch(self) -> None:
        while True:
            self._record()
            if self.all_s is not None or self._stop.wait(0.2):
                return

    def wait(self, pids: set[int], deadline_s: float) -> None:
        """Until ``pids`` are gone, at most ``deadline_s`` after the kill; fails naming survivors."""
        while time.monotonic() < self.killed_at + deadline_s and any(_alive(p) for p in pids):
            time.sleep(0.2)
        survivors = {p: self.tree[p].strip() for p in pids if _alive(p)}
        assert not survivors, f"processes of the killed run still alive {deadline_s:.0f}s after the kill: {survivors}"
        self._record()  # in case the thread has not looked since they went

    def stop(self) -> None:
        """End the watch; SIGKILL what is left of the tree (ours: clean up before failing)."""
        self._stop.set()
        self._thread.join()
        for p in self.tree:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _driver_env(ray_tmp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["RAY_TMPDIR"] = ray_tmp
    return env


def _result(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines and out.rstrip().splitlines()[-1] == lines[-1], out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_resume_needs_a_checkpoint_dir():
    example = _load_example(EXAMPLE, "rlhf_grpo_resume_args")
    with pytest.raises(SystemExit) as e:
        example.main(["--resume"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        example.main(["--checkpoint-dir", "/tmp/x", "--checkpoint-every", "0"])
    with pytest.raises(SystemExit):
        example.main(["--chaos", "--checkpoint-dir", "/tmp/x"])


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")
def test_driver_sigkill_then_resume_matches_an_uninterrupted_run(ray_session, tmp_path, capsys):
    steps, every, kill_after = 12, 3, 5
    ckpt_dir = tmp_path / "ckpt"
    ray_tmp = tempfile.mkdtemp(prefix="twr-", dir="/tmp")  # short: Ray's unix sockets live under it
    cmd = [sys.executable, str(EXAMPLE), "--quick", "--steps", str(steps), "--seed", "0",
           "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", str(every), "--plot", str(tmp_path / "r.png")]
    watch = None
    try:
        # 1. the driver, SIGKILLed once it has passed step `kill_after` (its first checkpoint is step 3)
        driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=_driver_env(ray_tmp), cwd=EXAMPLE.parent.parent)
        seen, reached = [], 0
        for line in driver.stdout:
            seen.append(line)
            m = STEP_LINE.match(line)
            if m and int(m.group(1)) >= kill_after:
                reached = int(m.group(1))
                break
        assert reached, "".join(seen[-60:])
        tree = descendants(driver.pid)
        assert any("gcs_server" in c for c in tree.values()), tree  # the run's own Ray is under it
        driver.send_signal(signal.SIGKILL)
        watch = _TreeWatch(tree, driver.pid)
        driver.wait(timeout=30)
        rest = driver.stdout.read()
        driver.stdout.close()
        reached = max([reached, *(int(m.group(1)) for m in STEP_LINE.finditer(rest))])  # printed before it died

        # 2. nothing of the run survives: its whole process tree goes (Ray's processes fate-share with
        # their driver). The GCS, raylet and workers go at once: checked before resuming. The
        # dashboard and runtime-env agents notice the raylet's death at once too, but first publish
        # its error to the dead GCS with a fixed 60 s deadline (ray._private.utils.
        # publish_error_to_driver; RAY_gcs_rpc_server_reconnect_timeout_s does not cut it short in
        # Ray 2.60), so they are watched while the resumed and the reference runs go on, and
        # checked at the end (within 240 s of the kill).
        watch.wait(watch.core, deadline_s=240)

        # 3. a torn newer checkpoint is skipped: --resume takes the newest complete one
        latest = CheckpointDir(str(ckpt_dir)).latest()
        assert latest is not None and latest.step >= every
        torn = ckpt_dir / f"step-{latest.step + 100:06d}"
        shutil.copytree(latest.path, torn)
        manifest = json.loads((torn / MANIFEST).read_text())
        manifest["step"] = latest.step + 100
        (torn / MANIFEST).write_text(json.dumps(manifest))
        (torn / "trainer" / "rank0.pt").write_bytes(b"half a file")  # cut short

        t0 = time.monotonic()
        proc = subprocess.Popen(cmd + ["--resume"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_driver_env(ray_tmp), cwd=EXAMPLE.parent.parent)
        lines, back_s = [], None
        for line in proc.stdout:
            lines.append(line)
            m = STEP_LINE.match(line)
            if m and back_s is None and int(m.group(1)) >= reached:
                back_s = time.monotonic() - t0
        proc.wait(timeout=600)
        out = "".join(lines)
        assert proc.returncode == 0, out[-4000:]
        result = _result(out)
        assert "skipping a torn checkpoint" in out and torn.name in out
        assert result["resumed_from"] == latest.step
        redone = [int(m.group(1)) for m in STEP_LINE.finditer(out)]
        assert redone[0] == latest.step + 1 and redone[-1] == steps, redone
        assert result["steps"] == steps and len(result["rewards"]) == steps
        with capsys.disabled():
            print(f"\ndriver kill: killed after step {reached}, resumed from checkpoint {latest.step}: "
                  f"{reached - latest.step} step(s) redone; the dead run's GCS, raylet and workers gone in "
                  f"{watch.core_s:.1f}s; restart -> back at step {reached}: {back_s:.1f}s; checkpoint saves: "
                  + ", ".join(re.findall(r"^checkpoint: step \d+ saved in \S+ \(([0-9.]+s)\)", out, re.M)))

        # 4. the same seed, uninterrupted (on the session's Ray): the same reward curve, exactly
        example = _load_example(EXAMPLE, "rlhf_grpo_resume_example")
        twinkle_ray.shutdown()
        try:
            twinkle_ray.initialize("ray", groups=example.groups(), seed=0)
            plain = example.run(steps, lr=0.01, seed=0, log=lambda *_: None)
        finally:
            twinkle_ray.shutdown()
        actors, pgs = leftovers()
        assert not actors and not pgs, (actors, pgs)
        assert result["rewards"] == plain["rewards"], (result["rewards"], plain["rewards"])

        # 2, the end: the agents too, every process of the killed run
        watch.wait(set(tree), deadline_s=240)
        with capsys.disabled():
            print(f"driver kill: all {len(tree)} processes of the killed run gone in {watch.all_s:.1f}s")
    finally:
        if watch is not None:
            watch.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)


FSDP_EXAMPLE = EXAMPLE.parent / "rlhf_fsdp_hf.py"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_fsdp_example_resumes_exactly(ray_session, tmp_path):
    """rlhf_fsdp_hf.py: a run of 4 steps (checkpoints 2 and 4); with checkpoint 4 gone, --resume redoes
    steps 3-4 from checkpoint 2 (FSDP2 shards, optimizer, RNGs) and ends with the same rewards and
    the same final weights (the greedy score of the HF checkpoint). Both drivers attach to the
    session's Ray (RAY_ADDRESS, as under ``ray job submit``): a resume is a new driver, and what it
    restores is all in the checkpoint, none of it in the Ray that ran the first one."""
    pytest.importorskip("transformers")
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, str(FSDP_EXAMPLE), "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir",
           str(ckpt), "--out-dir", str(tmp_path / "out")]
    runs = []
    for extra in ([], ["--resume"]):
        if extra:
            shutil.rmtree(ckpt / "step-000004")
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=900, env=env,
                              cwd=EXAMPLE.parent.parent)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs.append(_result(proc.stdout))
    full, resumed = runs
    assert (full["resumed_from"], full["checkpoints"]) == (None, [2, 4])
    assert (resumed["resumed_from"], resumed["checkpoints"], resumed["steps"]) == (2, [4], 4)
    assert resumed["rewards"] == full["rewards"]
    assert resumed["greedy_reward"] == full["greedy_reward"]
