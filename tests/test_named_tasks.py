"""A call with nothing routed travels without a head (runtime.message): its worker reads the method
from the task's name and reports the task's id where it reported the call's number. The stuck
check maps those ids back to numbers (``GangState.tasks``), so it still tells a peer stuck in the
failed call from one on an earlier call, and it says so when a call is too old to be known.

The first tests drive the stuck check with stand-in workers (no Ray); the last one runs a real
gang and reads, while a call waits for a file, what its workers say they are running.
"""

from __future__ import annotations

import asyncio
import logging
import os
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
    st.tasks.add(5, ["t0-of-call-5", "t1-of-call-5"])  # rank 1's task failed
    _report(health, "t1-of-call-5")
    assert len(failures) == 1 and isinstance(failures[0], GangStuckError)
    assert failures[0].stuck == [0]


def test_a_peer_on_an_earlier_named_call_is_not_stuck():
    health, st, failures = _health(["t0-of-call-4", None])
    st.tasks.add(4, ["t0-of-call-4", "t1-of-call-4"])
    st.tasks.add(5, ["t0-of-call-5", "t1-of-call-5"])
    _report(health, "t1-of-call-5")
    assert failures == []


def test_a_peer_on_an_earlier_routed_call_is_not_stuck_by_a_named_one():
    """A routed call carries its number (a head), a named one its task's id: a peer still on
    routed call 4 while named call 5 fails is on an earlier call."""
    health, st, failures = _health([4, None])
    st.tasks.add(5, ["t0-of-call-5", "t1-of-call-5"])
    _report(health, "t1-of-call-5")
    assert failures == []


def test_a_call_is_forgotten_whole_or_not_at_all():
    """The table drops the oldest calls with all their tasks: a failed rank's task is never
    known while its peer's task of the same call is forgotten."""
    health, st, failures = _health(["t0-of-call-6", None], limit=3)
    st.tasks.add(5, ["t0-of-call-5", "t1-of-call-5"])
    st.tasks.add(6, ["t0-of-call-6", "t1-of-call-6"])  # over the limit: call 5 goes, whole
    assert st.tasks.number("t0-of-call-5") is None and st.tasks.number("t1-of-call-5") is None
    assert st.tasks.number("t0-of-call-6") == st.tasks.number("t1-of-call-6") == 6
    _report(health, "t1-of-call-6")  # forgot call 5, and not half of call 6: rank 0 is stuck
    assert [e.stuck for e in failures] == [[0]]


def test_a_failure_in_a_call_too_old_to_know_is_logged_not_checked(caplog):
    health, st, failures = _health(["t0-of-call-1", None], limit=2)
    st.tasks.add(1, ["t0-of-call-1", "t1-of-call-1"])
    st.tasks.add(2, ["t0-of-call-2", "t1-of-call-2"])  # call 1 goes
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
class Waiter:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="all", collect="none")
    def wait_for(self, path: str) -> int:
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return get_rank()


@pytest.mark.slow
def test_a_running_named_call_is_known_by_the_id_of_its_task(runtime, tmp_path):
    """While a plain call runs, each worker says it runs the task whose output the call's
    LazyResult holds (a task id, not a number), and the dispatcher keeps them in its table."""
    import ray

    from conftest import NAMESPACE

    runtime.initialize(groups=[DeviceGroup("nt", 2, "cpu")])
    g = Waiter(remote_group="nt")
    go = str(tmp_path / "go")
    out = g.wait_for(go)
    workers = [ray.get_actor(f"nt/Waiter/{r}", namespace=NAMESPACE) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 90
        while True:
            running = ray.get([w.progress.remote() for w in workers])
            if all(isinstance(x, str) for x in running):
                break
            assert time.monotonic() < deadline, f"the workers never said they ran it: {running}"
            time.sleep(0.1)
        assert running == [ref.task_id().hex() for ref in out.refs]
    finally:
        open(go, "w").close()
    assert out() == [0, 1]
    dispatcher = ray.get_actor("nt/Waiter", namespace=NAMESPACE)
    assert ray.get(dispatcher.stats.remote())["named_tasks"] == 2  # one call on two ranks
