"""twinkle_ray.checkpoint: atomic step directories, newest complete lookup, torn checkpoints skipped."""

from __future__ import annotations

import json
import os

import pytest

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
