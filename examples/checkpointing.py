"""Driver side of the RLHF examples' ``--checkpoint-dir`` / ``--resume`` (both examples use it).

A checkpoint of step N is one atomic directory ``DIR/step-00000N/`` (see
:mod:`twinkle_ray.checkpoint`)::

    trainer/rank<r>.pt   each trainer rank's state_dict(): model (with its policy version), optimizer
    sampler/rank<r>.pt   each sampler rank's state_dict(): its sampling RNG
    driver.pt            the step, the loader's position, the per-step history, the driver's RNGs
    MANIFEST.json        written last: step, file sizes and hashes, the policy version

The gangs write their own files (``save_state(path)``: every rank into the
directory, which must be reachable from every worker: one machine, or a
shared filesystem). Resuming loads every rank's file back with the gang's
``load_rank_state(path)`` method (each example class defines it) and puts the
loader and the RNGs where they were, so the rest of the run is the same as an
uninterrupted one.

Example::

    ckpt, latest = open_checkpoints(args.checkpoint_dir, resume=True)
    if latest is not None:
        state = restore(latest, loader=loader, gangs={"trainer": trainer, "sampler": sampler})
    ...
    save(ckpt, step, loader=loader, gangs={...}, version=step, history=rewards)
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch

from twinkle_ray.checkpoint import Checkpoint, CheckpointDir

logger = logging.getLogger(__name__)

DRIVER_FILE = "driver.pt"


def rng_state() -> dict:
    """The driver's RNG states (Python, NumPy, torch)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def open_checkpoints(directory: str | None, resume: bool) -> tuple[CheckpointDir | None, Checkpoint | None]:
    """(the run's CheckpointDir or None, the checkpoint to resume from or None).

    ``resume`` without a complete checkpoint starts from scratch (logged);
    leftovers of a save cut short by a kill are removed.
    """
    if not directory:
        if resume:
            raise ValueError("--resume needs --checkpoint-dir")
        return None, None
    ckpt = CheckpointDir(directory)
    if not resume:
        return ckpt, None
    for path in ckpt.clean_temp():
        logger.info("removed the leftovers of an unfinished save: %s", path)
    latest = ckpt.latest()
    if latest is None:
        logger.info("--resume: no complete checkpoint in %s; starting from step 1", directory)
    return ckpt, latest


def save(ckpt: CheckpointDir, step: int, *, loader, gangs: dict[str, Any], version: int,
         history: list) -> str:
    """Write step ``step``'s checkpoint (atomic); returns its directory."""
    with ckpt.save(step, meta={"version": int(version)}) as tmp:
        for name, gang in gangs.items():
            gang.save_state(os.path.join(tmp, name))
        torch.save({"step": step, "version": int(version), "loader": loader.state_dict(),
                    "history": list(history), "rng": rng_state()}, os.path.join(tmp, DRIVER_FILE))
    return ckpt.path(step)


def restore(checkpoint: Checkpoint, *, loader, gangs: dict[str, Any]) -> dict:
    """Load ``checkpoint`` into the gangs, the loader and the driver's RNGs; returns the driver state."""
    state = torch.load(checkpoint.file(DRIVER_FILE), weights_only=False)
    if state["step"] != checkpoint.step:
        raise ValueError(f"{checkpoint.path}: driver state of step {state['step']} in the checkpoint "
                         f"of step {checkpoint.step}")
    for name, gang in gangs.items():
        gang.load_rank_state(checkpoint.file(name))()
    loader.load_state_dict(state["loader"])
    set_rng_state(state["rng"])
    return state
