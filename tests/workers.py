"""Worker classes the failure, restart and recovery tests share (plain classes: each test module
makes its own ``@remote_class`` of them, with the restart policy it needs).

Importable by Ray workers: ``conftest.ray_session`` puts ``tests/`` on their PYTHONPATH, and
``node_loss_driver.py`` runs from ``tests/`` as a script.
"""

from __future__ import annotations

import time

from twinkle_ray import get_rank, remote_function


class Sleeper:
    """A call that takes ``seconds`` on every rank: something to kill a worker under."""

    @remote_function(dispatch="all", collect="none")
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return get_rank()


class Collective:
    """An all-reduce over the gang's torch.distributed world (every rank must join)."""

    @remote_function(dispatch="all", collect="first")
    def allreduce(self) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0])
        dist.all_reduce(t)
        return t.item()


class Valued(Sleeper):
    """A per-rank value that ``state_dict()`` saves and a rebuilt rank gets back."""

    def __init__(self):
        self.value = 0

    @remote_function(dispatch="all", collect="none")
    def set_value(self, v: int) -> None:
        self.value = v * 10 + get_rank()

    @remote_function(dispatch="all", collect="none")
    def get_value(self) -> int:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
