"""A call with nothing routed travels without a head (runtime.message): its worker reads the method
from the task's name and reports the task's id where it reported the call's number. The stuck
check maps those ids back to numbers (``GangState.tasks``), so it still tells a peer stuck in the
failed call from one on an earlier call, and it says so when a call is too old to be known.

The first tests drive the stuck check with stand-in workers (no Ray); the last one runs a real
gang and reads, while a call runs, what its worker says it is running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from twinkle_ray import DeviceGroup, get_rank, remote_class, remote_function
from twinkle_ray.runtime.errors import GangStuckError
from twinkle_ray.runtime.health import DeathRecord, Health
from twinkle_ray.runtime.message import WorkerCall
from twinkle_ray.runtime.ranks import GangState, TaskNumbers


class _Says:
    """A stand-in worker whose ``progress()`` says ``current``."""

    def __init__(self, current):
        self.current = current
        self.progress = SimpleNamespace(remote=self._progress)

    async def _progress(self):
        return self.current


def _health(currents: list, limit: int = 16) -> tuple[Health, GangState, list]:
    spec = SimpleNamespace(slots=[], label="g/Model", stuck_grace_s=0.01,
                           group=SimpleNamespace(name="g"), cls_name="Model")
    st = GangState(spec, distributed=True, tasks=TaskNumbers(limit=limit))
    st.workers = [_Says(c) for c in currents]
    failures: list = []

    async def on_failure(error):
        failures.append(error)

    return Health(st, DeathRecord(), on_failure), st, failures


def _report(health: Health, call, rank: int = 1) -> None:
    async def go():
        health.report_failure(0, call, rank, "step", "KeyError: 'x'")
        await health.checked()
    asyncio.run(go())


def test_a_peer_in_the_failed_named_call_is_stuck():
    health, st, failures = _health(["t0-of-call-5", None])
    st.tasks.add("t0-of-call-5", 5)  # rank 0's task of call 5
    st.tasks.add("t1-of-call-5", 5)  # rank 1's, which failed
    _report(health, "t1-of-call-5")
    assert len(failures) == 1 and isinstance(failures[0], GangStuckError)
    assert failures[0].stuck == [0]


def test_a_peer_on_an_earlier_named_call_is_not_stuck():
    health, st, failures = _health(["t0-of-call-4", None])
    st.tasks.add("t0-of-call-4", 4)
    st.tasks.add("t1-of-call-5", 5)
    _report(health, "t1-of-call-5")
    assert failures == []


def test_numbered_and_named_reports_meet_in_one_check():
    """A routed call carries its number, a named one its task id: both name the same calls."""
    health, st, failures = _health([7, None])
    st.tasks.add("t1-of-call-7", 7)
    _report(health, "t1-of-call-7")
    assert [e.stuck for e in failures] == [[0]]


def test_a_failure_in_a_call_too_old_to_know_is_logged_not_checked(caplog):
    health, st, failures = _health(["t0-of-call-1", None], limit=2)
    st.tasks.add("t0-of-call-1", 1)
    st.tasks.add("t1-of-call-1", 1)
    st.tasks.add("t0-of-call-2", 2)  # the oldest entry goes
    st.tasks.add("t1-of-call-2", 2)
    with caplog.at_level(logging.WARNING, logger="twinkle_ray.runtime.health"):
        _report(health, "t1-of-call-1")
    assert failures == []  # unknown: no gang is torn down on a guess
    assert "too old to check" in caplog.text and "step()" in caplog.text


def test_the_method_is_read_from_the_task_name_whatever_the_group_is_called():
    call = WorkerCall.from_name("team.a/Model-2.train_step", "ff00", ([1],), {"k": 2})
    assert (call.method, call.seq, call.lead, call.args, call.kwargs) == (
        "train_step", "ff00", (), ([1],), {"k": 2})


# ---------------------------------------------------------------------------- a real gang
@remote_class(distributed=False)
class Sleeper:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="all", collect="none")
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return get_rank()


@pytest.mark.slow
def test_a_running_named_call_is_known_by_the_id_of_its_task(runtime):
    """While a plain call runs, each worker says it runs the task whose output the call's
    LazyResult holds (a task id, not a number), and the dispatcher keeps a bounded table of
    them."""
    import ray

    from conftest import NAMESPACE

    runtime.initialize(groups=[DeviceGroup("nt", 2, "cpu")])
    g = Sleeper(remote_group="nt")
    assert g.nap(0.0)() == [0, 1]
    out = g.nap(3.0)
    workers = [ray.get_actor(f"nt/Sleeper/{r}", namespace=NAMESPACE) for r in (0, 1)]
    deadline = time.monotonic() + 60
    while True:
        running = ray.get([w.progress.remote() for w in workers])
        if all(isinstance(x, str) for x in running):
            break
        assert time.monotonic() < deadline, f"the workers never said they ran it: {running}"
        time.sleep(0.1)
    assert running == [ref.task_id().hex() for ref in out.refs]
    assert out() == [0, 1]
    dispatcher = ray.get_actor("nt/Sleeper", namespace=NAMESPACE)
    assert ray.get(dispatcher.stats.remote())["named_tasks"] >= 4  # two calls on two ranks
