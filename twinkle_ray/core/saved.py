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

__all__ = ["TMP_PREFIX", "find_saved", "own_state", "saved_places"]

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
