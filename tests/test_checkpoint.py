"""twinkle_ray.checkpoint: atomic step directories, newest complete lookup, torn checkpoints skipped;
a save hashes only its own bytes, and a re-save killed between its renames loses nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from twinkle_ray import checkpoint
from twinkle_ray.checkpoint import MANIFEST, CheckpointDir, TornCheckpointError


def _save(ckpt: CheckpointDir, step: int, payload: bytes = b"x" * 100, meta: dict | None = None) -> str:
    with ckpt.save(step, meta=meta) as tmp:
        os.makedirs(os.path.join(tmp, "trainer"))
        with open(os.path.join(tmp, "trainer", "rank0.pt"), "wb") as f:
            f.write(payload)
    return ckpt.path(step)


def test_save_is_a_named_step_directory_with_a_manifest(tmp_path):
    ckpt = CheckpointDir(str(tmp_path))
    path = _save(ckpt, 10, meta={"version": 10})
    assert os.path.basename(path) == "step-000010"
    assert sorted(os.listdir(tmp_path)) == ["step-000010"]  # no temporary directory left
    manifest = json.load(open(os.path.join(path, MANIFEST)))
    assert manifest["step"] == 10 and set(manifest["files"]) == {os.path.join("trainer", "rank0.pt")}
    latest = ckpt.latest()
    assert (latest.step, latest.meta, latest.file("trainer", "rank0.pt")) == (
        10, {"version": 10}, os.path.join(path, "trainer", "rank0.pt"))


def test_latest_is_the_newest_complete(tmp_path):
    ckpt = CheckpointDir(str(tmp_path))
    for step in (5, 10, 15):
        _save(ckpt, step)
    assert ckpt.latest().step == 15 and ckpt.steps() == [5, 10, 15]


def test_empty_directory_has_no_checkpoint(tmp_path):
    assert CheckpointDir(str(tmp_path / "new")).latest() is None


def test_a_failed_save_leaves_nothing(tmp_path):
    ckpt = CheckpointDir(str(tmp_path))
    _save(ckpt, 5)
    with pytest.raises(RuntimeError, match="boom"):
        with ckpt.save(10) as tmp:
            open(os.path.join(tmp, "half.pt"), "wb").write(b"abc")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["step-000005"] and ckpt.latest().step == 5


@pytest.mark.parametrize("damage, message", [
    ("truncate", "has 10 bytes, the manifest says 100"),
    ("flip", "does not match its sha256"),
    ("remove_file", "is missing"),
    ("remove_manifest", "no MANIFEST.json"),
    ("garble_manifest", "unreadable MANIFEST.json"),
])
def test_a_torn_checkpoint_is_detected_and_the_previous_one_used(tmp_path, caplog, damage, message):
    ckpt = CheckpointDir(str(tmp_path))
    _save(ckpt, 5)
    path = _save(ckpt, 10)
    data = os.path.join(path, "trainer", "rank0.pt")
    if damage == "truncate":
        open(data, "wb").write(b"x" * 10)
    elif damage == "flip":
        open(data, "wb").write(b"y" * 100)
    elif damage == "remove_file":
        os.remove(data)
    elif damage == "remove_manifest":
        os.remove(os.path.join(path, MANIFEST))
    else:
        open(os.path.join(path, MANIFEST), "w").write('{"step": 10, "fil')
    with pytest.raises(TornCheckpointError, match=message):
        ckpt.verify(path)
    with caplog.at_level("WARNING", logger="twinkle_ray.checkpoint"):
        assert ckpt.latest().step == 5
    assert any("torn checkpoint" in r.getMessage() and "step-000010" in r.getMessage() for r in caplog.records)


def test_a_manifest_of_another_step_is_torn(tmp_path):
    ckpt = CheckpointDir(str(tmp_path))
    _save(ckpt, 5)
    os.rename(ckpt.path(5), ckpt.path(7))  # a directory renamed by hand
    with pytest.raises(TornCheckpointError, match="names step 5, the directory step 7"):
        ckpt.verify(ckpt.path(7))
    assert ckpt.latest() is None


def test_leftovers_of_a_killed_save_are_ignored_then_cleaned(tmp_path):
    ckpt = CheckpointDir(str(tmp_path))
    _save(ckpt, 5)
    dead = tmp_path / ".tmp-step-000010-999999-deadbeef"   # a writer killed mid-save
    dead.mkdir()
    (dead / "rank0.pt").write_bytes(b"partial")
    assert ckpt.latest().step == 5
    assert ckpt.clean_temp() == [str(dead)] and sorted(os.listdir(tmp_path)) == ["step-000005"]


def test_resaving_a_step_replaces_it(tmp_path):
    ckpt = CheckpointDir(str(tmp_path))
    _save(ckpt, 5, payload=b"old")
    _save(ckpt, 5, payload=b"new!")
    assert open(ckpt.latest().file("trainer", "rank0.pt"), "rb").read() == b"new!"
    assert os.listdir(tmp_path) == ["step-000005"]


def test_keep_prunes_old_checkpoints_and_older_torn_ones(tmp_path):
    ckpt = CheckpointDir(str(tmp_path), keep=2)
    _save(ckpt, 5)
    os.remove(os.path.join(ckpt.path(5), MANIFEST))  # torn, older than what is kept: goes too
    for step in (10, 15, 20):
        _save(ckpt, step)
    assert sorted(os.listdir(tmp_path)) == ["step-000015", "step-000020"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep must be >= 1"):
        CheckpointDir(str(tmp_path), keep=0)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        CheckpointDir(str(tmp_path)).prune(0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        CheckpointDir(str(tmp_path)).path(-1)
    with pytest.raises(TornCheckpointError, match="not a step directory"):
        CheckpointDir(str(tmp_path)).verify(str(tmp_path))


# ==========================================================================================
# CheckpointDir: a save does not re-hash the checkpoints it keeps, and a re-save killed between
# its two renames loses nothing (issue 27, item 11).
BIG = 4 << 20  # bytes per older checkpoint


class _CountingHashlib:
    """Stands in for ``hashlib`` in the module under test; counts the bytes it hashes."""

    def __init__(self):
        self.hashed = 0

    def sha256(self, data: bytes = b""):
        counter, real = self, hashlib.sha256(data)
        counter.hashed += len(data)

        class _H:
            def update(self, chunk: bytes) -> None:
                counter.hashed += len(chunk)
                real.update(chunk)

            def hexdigest(self) -> str:
                return real.hexdigest()

        return _H()


@pytest.fixture
def counting(monkeypatch) -> _CountingHashlib:
    fake = _CountingHashlib()
    monkeypatch.setattr(checkpoint, "hashlib", fake)
    return fake


def _save_payload(ckpt: CheckpointDir, step: int, payload: bytes) -> None:
    with ckpt.save(step) as tmp, open(os.path.join(tmp, "rank0.pt"), "wb") as f:
        f.write(payload)


def test_a_small_save_with_keep_hashes_only_its_own_bytes(tmp_path, counting):
    ckpt = CheckpointDir(str(tmp_path), keep=4)
    for step in range(1, 5):
        _save_payload(ckpt, step, bytes([step]) * BIG)
    counting.hashed = 0
    _save_payload(ckpt, 5, b"ok")
    assert counting.hashed == 2  # the new file only: none of the 4 x 4 MiB kept or pruned
    assert ckpt.steps() == [2, 3, 4, 5]


def test_latest_still_detects_a_corrupted_checkpoint(tmp_path, counting):
    ckpt = CheckpointDir(str(tmp_path), keep=3)
    for step in (1, 2):
        _save_payload(ckpt, step, bytes([step]) * BIG)
    with open(ckpt.path(2) + "/rank0.pt", "r+b") as f:  # same size, one byte flipped
        f.seek(BIG // 2)
        f.write(b"\xff")
    _save_payload(ckpt, 3, b"ok")  # pruning keeps it: sizes match, no hash read
    assert sorted(os.listdir(tmp_path)) == ["step-000001", "step-000002", "step-000003"]
    shutil.rmtree(ckpt.path(3))
    counting.hashed = 0
    latest = ckpt.latest()
    assert latest.step == 1  # step 2 fails its sha256 and is skipped
    assert counting.hashed == 2 * BIG  # step 2 read (and rejected), then step 1


def test_pruning_still_drops_a_checkpoint_whose_sizes_are_wrong(tmp_path):
    ckpt = CheckpointDir(str(tmp_path), keep=2)
    for step in (1, 2):
        _save_payload(ckpt, step, b"x" * 100)
    with open(ckpt.path(2) + "/rank0.pt", "ab") as f:  # torn: the manifest says 100 bytes
        f.write(b"more")
    _save_payload(ckpt, 3, b"ok")
    assert ckpt.steps() == [1, 3]


def _resave_killed_between_the_renames(root: str, step: int) -> None:
    """Re-save ``step`` in a child process killed (os._exit, no cleanup) at the second rename."""
    code = textwrap.dedent(f"""
        import os
        from twinkle_ray.checkpoint import CheckpointDir
        real, calls = os.rename, []
        def rename(src, dst):
            calls.append(src)
            if len(calls) == 2:
                os._exit(9)  # killed after 'step-N -> step-N.old-*', before 'tmp -> step-N'
            real(src, dst)
        os.rename = rename
        with CheckpointDir({root!r}).save({step}) as tmp:
            open(os.path.join(tmp, "rank0.pt"), "wb").write(b"new")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == 9, proc.stderr.decode()


def test_a_resave_killed_between_its_renames_loses_nothing(tmp_path):
    ckpt = CheckpointDir(str(tmp_path))
    _save_payload(ckpt, 5, b"old")
    _resave_killed_between_the_renames(str(tmp_path), 5)
    left = sorted(os.listdir(tmp_path))
    assert "step-000005" not in left and len(left) == 2, left  # both copies under temporary names
    removed = ckpt.clean_temp()
    assert sorted(os.listdir(tmp_path)) == ["step-000005"], removed
    latest = ckpt.latest()
    assert latest.step == 5
    assert open(latest.file("rank0.pt"), "rb").read() == b"old"
