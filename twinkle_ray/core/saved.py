"""Where a gang's saved state is found again, and how a restoring rank makes it its own.

Pure (no Ray, no torch): the runtime's workers use it when they restore a state after a
rebuild, and :mod:`twinkle_ray.checkpoint` names its temporary folders by the same rule
(``TMP_PREFIX``), so that a file saved inside a checkpoint save is found after the save renamed
its folder to ``step-N``.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

__all__ = ["SAVES_KEPT", "TMP_PREFIX", "find_saved", "kept_saves", "newest_complete",
           "own_state", "saved_exists", "saved_places"]

# How many of a gang's saves to files a rebuild may fall back on (newest first): a save
# aborted or pruned since (a CheckpointDir's ``keep``) leaves the one before it.
SAVES_KEPT = 3

# A CheckpointDir save writes into ``root/.tmp-step-<step:06d>-<pid>-<n>/`` and renames it to
# ``root/step-<step:06d>/`` when it ends.
TMP_PREFIX = ".tmp-step-"
_TMP_RE = re.compile(r"^" + re.escape(TMP_PREFIX) + r"(\d+)-")


def saved_places(path: str) -> list[str]:
    """Where a file written at ``path`` may be found later, in the order to look.

    A file written inside the temporary folder that :meth:`twinkle_ray.checkpoint.CheckpointDir.save` hands out
    (``root/.tmp-step-000010-<pid>-<n>/...``) moves with it to ``root/step-000010/...`` when
    the save ends: both places, the temporary one first (a rebuild inside the ``with`` block
    reads it there). Any other path: itself. A gang's ``save_state(path=...)`` remembers its
    files by the path it was given; its rebuilds look for them here.

    >>> saved_places("/ck/.tmp-step-000010-77-ab12cd34/trainer/rank0.pt")
    ['/ck/.tmp-step-000010-77-ab12cd34/trainer/rank0.pt', '/ck/step-000010/trainer/rank0.pt']
    >>> saved_places("/ck/states/rank0.pt")
    ['/ck/states/rank0.pt']
    """
    parts = path.split(os.sep)
    for i in range(len(parts) - 1, -1, -1):
        m = _TMP_RE.match(parts[i])
        if m is not None:
            return [path, os.sep.join([*parts[:i], f"step-{m.group(1)}", *parts[i + 1:]])]
    return [path]


def own_state(state: Any) -> Any:
    """A saved state made the restoring rank's own: a deep copy. A state read from Ray's object
    store holds its arrays as read-only views of the stored copy (zero-copy); the copy is
    writable, equal, and shares no memory with the saved one, so the first in-place update
    after a rebuild neither fails nor reaches the save a later rebuild reads again.

    >>> import numpy as np
    >>> saved = np.arange(3); saved.flags.writeable = False
    >>> mine = own_state({"w": saved})["w"]
    >>> mine.flags.writeable, np.shares_memory(mine, saved), mine.tolist()
    (True, False, [0, 1, 2])
    """
    return copy.deepcopy(state)


def find_saved(path: str) -> str:
    """The first of :func:`saved_places` that exists; FileNotFoundError naming each place
    looked at (a checkpoint pruned or removed since the save).

    >>> find_saved("/nowhere/.tmp-step-000003-1-x/rank0.pt")
    Traceback (most recent call last):
    FileNotFoundError: saved state not found: looked at /nowhere/.tmp-step-000003-1-x/rank0.pt, /nowhere/step-000003/rank0.pt
    """
    places = saved_places(path)
    for place in places:
        if os.path.exists(place):
            return place
    raise FileNotFoundError(f"saved state not found: looked at {', '.join(places)}")


def saved_exists(path: str) -> bool:
    """Whether a file saved at ``path`` is still found at one of :func:`saved_places`.

    >>> saved_exists("/nowhere/.tmp-step-000003-1-x/rank0.pt")
    False
    """
    return any(os.path.exists(place) for place in saved_places(path))


def kept_saves(history: list[list], save: list, keep: int = SAVES_KEPT) -> list[list]:
    """A gang's save history (oldest first) after ``save`` (one entry per rank: its file, or
    a state held in memory). Saves to files keep the ``keep`` newest; a save in memory is
    always there to restore, so nothing older is kept with it (nor is it kept once a newer
    save is made: it holds a whole state).

    >>> kept_saves([["a/rank0.pt"], ["b/rank0.pt"], ["c/rank0.pt"]], ["d/rank0.pt"])
    [['b/rank0.pt'], ['c/rank0.pt'], ['d/rank0.pt']]
    >>> ref = object()  # a state in memory (an ObjectRef)
    >>> kept_saves([["a/rank0.pt"]], [ref]) == [[ref]]
    True
    """
    if not all(isinstance(x, str) for x in save):
        return [list(save)]
    files = [entry for entry in history if all(isinstance(x, str) for x in entry)]
    return [*files, list(save)][-keep:]


def newest_complete(found: list[list[bool]]) -> int | None:
    """Given ``found[r][i]`` (whether rank ``r`` finds its file of save ``i``; saves newest
    first), the first save every rank finds; None when there is none.

    >>> newest_complete([[False, True], [True, True]])
    1
    >>> newest_complete([[False], [True]]) is None
    True
    """
    if not found:
        return None
    for i in range(len(found[0])):
        if all(rank[i] for rank in found):
            return i
    return None
