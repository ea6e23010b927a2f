"""Atomic step checkpoints in a directory: write, find the newest complete one, detect torn ones.

A run that checkpoints every few steps keeps one directory per saved step
under its checkpoint root::

    DIR/step-000010/      a complete checkpoint of step 10
        MANIFEST.json     written last: the step, every file with its size and sha256, metadata
        trainer/rank0.pt  ...whatever the run put there
    DIR/.tmp-step-000015-<pid>-<n>/   a save under way (or killed mid-way): never read

A save happens in a temporary directory; the manifest is written (and
fsynced) last, then the directory is renamed to its final name in one
``os.rename``. A reader therefore sees either no ``step-N`` or a whole one.
A checkpoint is *complete* when its manifest parses, names its own step,
and every file it lists exists with the listed size and hash; anything else
is *torn* (a copy cut short, a disk that lost a file, a hand edit) and is
skipped with a warning, so :meth:`CheckpointDir.latest` falls back to the
previous complete one. Hashing is for a resume: :meth:`CheckpointDir.latest`
and :meth:`CheckpointDir.complete` check every hash, while pruning after a
save (``keep=``) reads only manifests and file sizes, so a save never
re-reads the checkpoints it keeps. Leftover temporary directories of dead
writers are removed by :meth:`CheckpointDir.clean_temp`; a re-save of a step
killed between its two renames loses nothing (``clean_temp`` puts the old
copy back under its name).

No Ray, no torch: the caller writes whatever files it wants into the
directory that :meth:`CheckpointDir.save` hands it (e.g. a gang's
``save_state(path)`` writes one file per rank there).

Example::

    >>> import tempfile, os
    >>> ckpt = CheckpointDir(tempfile.mkdtemp())
    >>> with ckpt.save(10, meta={"version": 10}) as tmp:
    ...     with open(os.path.join(tmp, "driver.json"), "w") as f:
    ...         _ = f.write("{}")
    >>> ckpt.latest().step, ckpt.latest().meta["version"]
    (10, 10)
    >>> os.path.basename(ckpt.latest().path)
    'step-000010'
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .core.saved import TMP_PREFIX as _TMP_PREFIX
from .core.saved import find_saved, own_state, saved_places

logger = logging.getLogger(__name__)

__all__ = ["Checkpoint", "CheckpointDir", "TornCheckpointError", "find_saved", "own_state", "saved_places"]

MANIFEST = "MANIFEST.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
_OLD_RE = re.compile(r"^(step-\d+)\.old-")


class TornCheckpointError(RuntimeError):
    """A step directory that is not a complete checkpoint (the message says what is wrong)."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its step, directory and the metadata saved with it."""

    step: int
    path: str
    meta: dict[str, Any] = field(default_factory=dict)

    def file(self, *parts: str) -> str:
        """A path inside the checkpoint."""
        return os.path.join(self.path, *parts)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory fds: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _files(root: str) -> list[str]:
    out = []
    for here, _dirs, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(here, name), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


class CheckpointDir:
    """The checkpoints of one run under ``root`` (created if missing).

    Args:
        root: the checkpoint directory.
        keep: how many complete checkpoints to keep after a save (the
            newest ones); None keeps all.

    >>> import tempfile
    >>> ckpt = CheckpointDir(tempfile.mkdtemp(), keep=2)
    >>> for step in (5, 10, 15):
    ...     with ckpt.save(step):
    ...         pass
    >>> ckpt.steps()
    [10, 15]
    """

    def __init__(self, root: str, keep: int | None = None):
        if keep is not None and keep < 1:
            raise ValueError(f"CheckpointDir: keep must be >= 1 or None, got {keep!r}")
        self.root = os.path.abspath(root)
        self.keep = keep
        os.makedirs(self.root, exist_ok=True)

    def path(self, step: int) -> str:
        """The final directory of ``step``'s checkpoint (``root/step-000010``)."""
        if step < 0:
            raise ValueError(f"a checkpoint step must be >= 0, got {step}")
        return os.path.join(self.root, f"step-{step:06d}")

    @contextlib.contextmanager
    def save(self, step: int, meta: dict[str, Any] | None = None) -> Iterator[str]:
        """Write ``step``'s checkpoint: yields a temporary directory to fill.

        On a clean exit the manifest is written and the directory renamed to
        :meth:`path` (replacing an older checkpoint of the same step); on an
        exception the temporary directory is removed and nothing changes.
        ``meta`` (JSON-serialisable) is stored in the manifest.
        """
        final = self.path(step)
        tmp = os.path.join(self.root, f"{_TMP_PREFIX}{step:06d}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        try:
            yield tmp
            files = _files(tmp)
            manifest = {
                "step": step,
                "created": time.time(),
                "files": {rel: {"size": os.path.getsize(os.path.join(tmp, rel)),
                                "sha256": _sha256(os.path.join(tmp, rel))} for rel in files},
                "meta": dict(meta or {}),
            }
            for rel in files:  # the data reaches the disk before the manifest that vouches for it
                with open(os.path.join(tmp, rel), "rb") as f:
                    os.fsync(f.fileno())
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if os.path.exists(final):  # a re-save of the same step (a resumed run redoing it)
                old = final + f".old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("checkpoint of step %d saved in %s", step, final)
        if self.keep is not None:
            self.prune(self.keep)

    def verify(self, path: str, hashes: bool = True) -> Checkpoint:
        """The checkpoint in ``path``; raises TornCheckpointError naming what is wrong.

        ``hashes=False`` checks the manifest and the files' presence and sizes only
        (no file is read): what pruning needs, not what a resume needs.
        """
        m = _STEP_RE.match(os.path.basename(path))
        if m is None:
            raise TornCheckpointError(f"{path}: not a step directory (step-NNNNNN)")
        step = int(m.group(1))
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise TornCheckpointError(f"{path}: no {MANIFEST} (the save did not finish)") from None
        except (OSError, ValueError) as e:
            raise TornCheckpointError(f"{path}: unreadable {MANIFEST}: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("step") != step:
            raise TornCheckpointError(f"{path}: {MANIFEST} names step {manifest.get('step') if isinstance(manifest, dict) else None}, "
                                      f"the directory step {step}")
        for rel, want in dict(manifest.get("files", {})).items():
            file = os.path.join(path, rel)
            if not os.path.isfile(file):
                raise TornCheckpointError(f"{path}: file {rel} is missing")
            size = os.path.getsize(file)
            if size != want.get("size"):
                raise TornCheckpointError(f"{path}: file {rel} has {size} bytes, the manifest says {want.get('size')}")
            if hashes and _sha256(file) != want.get("sha256"):
                raise TornCheckpointError(f"{path}: file {rel} does not match its sha256 in the manifest")
        return Checkpoint(step, path, dict(manifest.get("meta", {})))

    def _step_dirs(self) -> list[tuple[int, str]]:
        out = []
        for name in os.listdir(self.root):
            m = _STEP_RE.match(name)
            if m and os.path.isdir(os.path.join(self.root, name)):
                out.append((int(m.group(1)), os.path.join(self.root, name)))
        return sorted(out)

    def complete(self, hashes: bool = True) -> list[Checkpoint]:
        """Every complete checkpoint, oldest first (torn ones are logged and skipped).

        ``hashes=False`` judges completeness by manifests and file sizes only (see :meth:`verify`).
        """
        out = []
        for _step, path in self._step_dirs():
            try:
                out.append(self.verify(path, hashes))
            except TornCheckpointError as e:
                logger.warning("skipping a torn checkpoint: %s", e)
        return out

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, ascending."""
        return [c.step for c in self.complete()]

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint, or None; a torn newer one is skipped with a warning."""
        for _step, path in reversed(self._step_dirs()):
            try:
                return self.verify(path)
            except TornCheckpointError as e:
                logger.warning("skipping a torn checkpoint: %s", e)
        return None

    def prune(self, keep: int) -> list[str]:
        """Remove all but the ``keep`` newest complete checkpoints; returns the removed paths.

        Torn step directories older than the oldest kept one go too. ``keep`` must be
        at least 1 (the newest checkpoint is what a resume needs). Completeness is judged by
        manifests and file sizes, without hashing (a save must not re-read every checkpoint
        it keeps); :meth:`latest` checks the hashes on resume.
        """
        if keep < 1:
            raise ValueError(f"prune(keep={keep}): keep must be >= 1 (the newest checkpoint stays)")
        complete = self.complete(hashes=False)
        kept = {c.path for c in complete[-keep:]}
        oldest_kept = min((c.step for c in complete[-keep:]), default=None)
        removed = []
        for step, path in self._step_dirs():
            if path in kept or oldest_kept is None or step > oldest_kept:
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    def clean_temp(self) -> list[str]:
        """Remove the temporary directories that dead writers left (saves cut short); returns them.

        A re-save of a step killed between its two renames left the step's old copy under
        ``step-N.old-*`` and no ``step-N``: that copy is renamed back to ``step-N`` (it was
        the live checkpoint), not removed. Call it when no save of this run is under way
        (at the start of a resume).
        """
        for name in sorted(os.listdir(self.root)):
            m = _OLD_RE.match(name)
            final = os.path.join(self.root, m.group(1)) if m else None
            if final is not None and not os.path.exists(final):
                os.rename(os.path.join(self.root, name), final)
                _fsync_dir(self.root)
                logger.warning("restored %s from %s (a re-save of it was cut short)", final, name)
        removed = []
        for name in os.listdir(self.root):
            if name.startswith(_TMP_PREFIX) or _OLD_RE.match(name):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                removed.append(os.path.join(self.root, name))
        return removed
