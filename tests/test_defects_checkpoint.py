"""CheckpointDir: a save does not re-hash the checkpoints it keeps, and a re-save killed between
its two renames loses nothing (issue 27, item 11)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from twinkle_ray import checkpoint
from twinkle_ray.checkpoint import CheckpointDir

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


def _save(ckpt: CheckpointDir, step: int, payload: bytes) -> None:
    with ckpt.save(step) as tmp, open(os.path.join(tmp, "rank0.pt"), "wb") as f:
        f.write(payload)


def test_a_small_save_with_keep_hashes_only_its_own_bytes(tmp_path, counting):
    ckpt = CheckpointDir(str(tmp_path), keep=4)
    for step in range(1, 5):
        _save(ckpt, step, bytes([step]) * BIG)
    counting.hashed = 0
    _save(ckpt, 5, b"ok")
    assert counting.hashed == 2  # the new file only: none of the 4 x 4 MiB kept or pruned
    assert ckpt.steps() == [2, 3, 4, 5]


def test_latest_still_detects_a_corrupted_checkpoint(tmp_path, counting):
    ckpt = CheckpointDir(str(tmp_path), keep=3)
    for step in (1, 2):
        _save(ckpt, step, bytes([step]) * BIG)
    with open(ckpt.path(2) + "/rank0.pt", "r+b") as f:  # same size, one byte flipped
        f.seek(BIG // 2)
        f.write(b"\xff")
    _save(ckpt, 3, b"ok")  # pruning keeps it: sizes match, no hash read
    assert sorted(os.listdir(tmp_path)) == ["step-000001", "step-000002", "step-000003"]
    shutil.rmtree(ckpt.path(3))
    counting.hashed = 0
    latest = ckpt.latest()
    assert latest.step == 1  # step 2 fails its sha256 and is skipped
    assert counting.hashed == 2 * BIG  # step 2 read (and rejected), then step 1


def test_pruning_still_drops_a_checkpoint_whose_sizes_are_wrong(tmp_path):
    ckpt = CheckpointDir(str(tmp_path), keep=2)
    for step in (1, 2):
        _save(ckpt, step, b"x" * 100)
    with open(ckpt.path(2) + "/rank0.pt", "ab") as f:  # torn: the manifest says 100 bytes
        f.write(b"more")
    _save(ckpt, 3, b"ok")
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
    _save(ckpt, 5, b"old")
    _resave_killed_between_the_renames(str(tmp_path), 5)
    left = sorted(os.listdir(tmp_path))
    assert "step-000005" not in left and len(left) == 2, left  # both copies under temporary names
    removed = ckpt.clean_temp()
    assert sorted(os.listdir(tmp_path)) == ["step-000005"], removed
    latest = ckpt.latest()
    assert latest.step == 5
    assert open(latest.file("rank0.pt"), "rb").read() == b"old"
