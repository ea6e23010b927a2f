"""One restart budget per gang, kept across dispatcher respawns (issue 28, item 2).

A gang's ``max_restarts`` counts every rebuild: the dispatcher's automatic rebuilds after a
worker died and the creator's respawns of a dead dispatcher. A respawned dispatcher starts
with the history of the rebuilds before it, so killing the dispatcher never refills the budget.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from conftest import NAMESPACE
from twinkle_ray import DeviceGroup, WorkerDiedError, remote_class, remote_function
from twinkle_ray.runtime.errors import GangRebuildError

WAIT_S = 60.0


@remote_class(max_restarts=1)
class Once:
    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


@remote_class(max_restarts=2)
class Twice(Once):
    pass


def _settle(g, want=(GangRebuildError, WorkerDiedError), wait_s: float = WAIT_S):
    """Call ``g.pid()`` until it answers (returns the pids) or raises one of ``want`` that is
    not a plain death seen before the rebuild (returns the error)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return g.pid()()
        except want as e:
            if isinstance(e, GangRebuildError) or e.kind == "dispatcher" or "not rebuilt" in str(e):
                return e
        assert time.monotonic() < deadline, "the gang neither answered nor stayed down"
        time.sleep(0.2)


def _kill_worker(g, rank: int = 0) -> None:
    os.kill(g.pid()()[rank], signal.SIGKILL)


def _kill_dispatcher(g) -> None:
    ray.kill(ray.get_actor(g.label, namespace=NAMESPACE), no_restart=True)
    deadline = time.monotonic() + WAIT_S
    while True:  # the creator's proxy sees the death on its next call
        try:
            g.pid()()
        except WorkerDiedError as e:
            assert e.kind == "dispatcher", e
            return
        assert time.monotonic() < deadline
        time.sleep(0.2)


@pytest.mark.slow
def test_a_respawn_spends_the_budget_a_worker_death_would_use(runtime):
    runtime.initialize(groups=[DeviceGroup("b1", 2, "cpu")])
    g = Once(remote_group="b1")
    _kill_dispatcher(g)
    assert len(g.pid()()) == 2  # respawned: the one restart max_restarts=1 allows
    _kill_worker(g)
    err = _settle(g)
    assert isinstance(err, GangRebuildError), err
    assert "restart budget is spent" in str(err) and "max_restarts=1" in str(err), err
    desc = g.topology()
    assert desc["restarts"] == 1 and desc["dead"] and not desc["rebuilding"], desc  # the respawn


@pytest.mark.slow
def test_a_dispatcher_death_after_a_rebuild_finds_the_budget_spent(runtime):
    runtime.initialize(groups=[DeviceGroup("b2", 2, "cpu")])
    g = Once(remote_group="b2")
    _kill_worker(g, 1)
    got = _settle(g)
    assert isinstance(got, list) and len(got) == 2, got  # the one automatic rebuild
    _kill_dispatcher(g)
    with pytest.raises(WorkerDiedError, match=r"its dispatcher died and is not rebuilt \(its "
                                              r"restart budget is spent: max_restarts=1\)"):
        g.pid()()


@pytest.mark.slow
def test_rebuild_respawn_rebuild_is_two_restarts_not_three(runtime):
    runtime.initialize(groups=[DeviceGroup("b3", 2, "cpu")])
    g = Twice(remote_group="b3")
    _kill_worker(g, 1)
    assert len(_settle(g)) == 2  # rebuild 1
    _kill_dispatcher(g)
    assert len(g.pid()()) == 2  # respawn: rebuild 2
    _kill_worker(g, 0)
    err = _settle(g)
    assert isinstance(err, GangRebuildError), err
    assert "restart budget is spent (2 automatic rebuild(s); max_restarts=2)" in str(err), err
    assert g.topology()["restarts"] == 2  # the rebuild and the respawn, counted across it
