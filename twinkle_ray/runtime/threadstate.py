"""Torch's thread-local state, carried from the thread that built the instance to another.

Calls through a Compiled Graph run on the graph's own thread in the worker,
not on the thread where the user's ``__init__`` ran. Torch keeps some state
per thread: grad mode, autocast (per device type, with its dtype) and the
current CUDA device; ``set_num_threads`` is per process but is set again
anyway. :func:`capture` reads that state after ``__init__``;
:func:`apply` sets it on the calling thread (the worker does this once per
graph thread, before its first call there).

Example::

    >>> state = capture()          # torch not imported here: nothing to carry
    >>> apply(state)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TorchThreadState:
    """What ``capture`` read; ``apply`` sets the same on another thread."""

    grad: bool
    num_threads: int
    autocast: dict = field(default_factory=dict)  # device type -> (enabled, dtype)
    cuda_device: int | None = None


def capture() -> TorchThreadState | None:
    """The calling thread's torch state, or None when torch was never imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    autocast = {}
    for dev in ("cpu", "cuda"):
        try:
            autocast[dev] = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        except (RuntimeError, TypeError, AttributeError):  # an older torch or no such backend
            continue
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.current_device()
    return TorchThreadState(torch.is_grad_enabled(), torch.get_num_threads(), autocast, cuda)


def apply(state: TorchThreadState | None) -> None:
    """Set ``state`` on the calling thread (None: nothing to do)."""
    if state is None:
        return
    import torch

    torch.set_grad_enabled(state.grad)
    if torch.get_num_threads() != state.num_threads:
        torch.set_num_threads(state.num_threads)
    for dev, (enabled, dtype) in state.autocast.items():
        torch.set_autocast_enabled(dev, enabled)
        torch.set_autocast_dtype(dev, dtype)
    if state.cuda_device is not None:
        torch.cuda.set_device(state.cuda_device)
