"""A payload that reports every process that unpickles it.

B4 must show that the payload of a LazyResult never passes through the driver
or the dispatcher. A ``Tracer`` rides inside each payload dict next to the
numpy array; Ray deserialises an object whole, so whichever process fetches the
payload unpickles the tracer too, and ``_arrived`` writes one small file
``<pid>-<uuid>`` holding the payload's byte count into the trace directory.
Summing those files per pid tells exactly which processes received how many
payload bytes -- a measurement, not an assumption.

Example::

    batch = make_batch(rows=1024, cols=256, trace_dir="/tmp/t")   # {'x': ndarray, 'tag': Tracer}
    ray.get(ray.put(batch))                                        # unpickled here: records our pid
    bytes_by_pid("/tmp/t")                                         # {12345: 1048576}
"""

from __future__ import annotations

import os
import uuid
from collections import Counter

import numpy as np


class Tracer:
    """A small marker that records (pid, nbytes) in ``trace_dir`` whenever it is unpickled."""

    __slots__ = ("trace_dir", "nbytes")

    def __init__(self, trace_dir: str, nbytes: int):
        self.trace_dir = trace_dir
        self.nbytes = nbytes

    def __reduce__(self):
        return (_arrived, (self.trace_dir, self.nbytes))

    def __eq__(self, other: object) -> bool:  # concat keeps one tracer per piece (a list)
        return self is other

    __hash__ = object.__hash__


def _arrived(trace_dir: str, nbytes: int) -> Tracer:
    """Unpickling hook: note that this process received ``nbytes`` of payload."""
    path = os.path.join(trace_dir, f"{os.getpid()}-{uuid.uuid4().hex}")
    with open(path, "w") as f:
        f.write(str(nbytes))
    return Tracer(trace_dir, nbytes)


def make_batch(rows: int, cols: int, trace_dir: str) -> dict:
    """A float32 batch of ``rows`` x ``cols`` with its tracer (``rows`` is the batch dimension)."""
    x = np.ones((rows, cols), dtype=np.float32)
    return {"x": x, "tag": Tracer(trace_dir, x.nbytes)}


def bytes_by_pid(trace_dir: str) -> Counter:
    """Payload bytes unpickled per process id, from the files in ``trace_dir``."""
    out: Counter = Counter()
    for name in os.listdir(trace_dir):
        pid = int(name.split("-", 1)[0])
        with open(os.path.join(trace_dir, name)) as f:
            out[pid] += int(f.read() or 0)
    return out


def clear(trace_dir: str) -> None:
    """Forget earlier records."""
    for name in os.listdir(trace_dir):
        os.unlink(os.path.join(trace_dir, name))
