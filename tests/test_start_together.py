"""start_together(): gangs made in one block start up at the same time, and the block's end
waits for all of them; a start-up that fails closes every gang of the block and raises."""

from __future__ import annotations

import threading
import time

import pytest

from twinkle_ray import (
    DeviceGroup,
    get_device_placement,
    remote_class,
    remote_function,
    start_together,
)
from twinkle_ray.runtime.session import current


@remote_class()
class Slow:
    """Its constructor takes ``seconds``, and says when it ran."""

    def __init__(self, seconds: float = 0.0, fail: bool = False):
        self.began = time.time()
        time.sleep(seconds)
        if fail:
            raise ValueError("no constructor today")
        self.ended = time.time()

    @remote_function(dispatch="all", collect="first")
    def ran(self) -> tuple[float, float]:
        return self.began, self.ended

    @remote_function(dispatch="all", collect="first")
    def take(self, other) -> str:
        return other.label


@remote_class(max_restarts=1)
class Healing(Slow):
    pass


@remote_class()
class Holder:
    def __init__(self, other):
        self.other = other


def _groups(size: int = 2):
    return [DeviceGroup("ta", size, "cpu"), DeviceGroup("tb", size, "cpu")]


@pytest.mark.slow
def test_gangs_made_in_a_block_start_at_the_same_time_and_are_up_after_it(runtime):
    runtime.initialize(groups=_groups())
    with start_together():
        a = Slow(3.0, remote_group="ta")
        b = Slow(3.0, remote_group="tb")
        assert a.start_under_way is not None  # returned at once: its start-up runs
        assert "gang ta/Slow: 2 worker(s), starting" in get_device_placement()
    assert a.start_under_way is None and b.start_under_way is None
    assert a.backend == "gloo" and b.backend == "gloo"
    (a0, a1), (b0, b1) = a.ran()(), b.ran()()
    # The two constructors ran at the same time: each began before the other ended. Made one
    # after another, b's constructor would only begin once a's had ended.
    assert b0 < a1 and a0 < b1, ((a0, a1), (b0, b1))
    assert "gang tb/Slow: 2 worker(s), backend gloo" in get_device_placement()


@pytest.mark.slow
def test_a_call_in_the_block_waits_for_its_gang(runtime):
    runtime.initialize(groups=_groups())
    with start_together():
        a = Slow(1.0, remote_group="ta")
        began, ended = a.ran()()  # waits for a's start-up, not for the block's end
        assert a.start_under_way is None and ended - began >= 1.0


@pytest.mark.slow
def test_a_failed_start_closes_every_gang_of_the_block_and_raises_its_error(runtime):
    runtime.initialize(groups=_groups())
    with pytest.raises(ValueError, match=r"gang tb/Slow failed to start \(rank \d\): "
                                           r"ValueError: no constructor today"):
        with start_together():
            a = Slow(2.0, remote_group="ta")
            b = Slow(fail=True, remote_group="tb")
    assert b.closed == "its start-up failed: ValueError"
    assert a.closed.startswith("another gang of its start_together() block did not start")
    with pytest.raises(RuntimeError, match="gang ta/Slow is gone"):
        a.ran()
    assert current().gangs == []
    # the groups' devices were given back: new gangs start on them, one by one as usual
    assert Slow(remote_group="ta").ran()() and Slow(remote_group="tb").ran()()


@pytest.mark.slow
def test_a_block_that_raises_closes_its_gangs(runtime):
    runtime.initialize(groups=_groups())
    with pytest.raises(KeyError, match="user's own"):
        with start_together():
            a = Slow(remote_group="ta")
            raise KeyError("user's own")
    assert a.closed == "its start_together() block raised"
    assert current().gangs == []


# ------------------------------------------------------------------ start-up limits (1 worker)
@pytest.mark.slow
def test_plain_construction_past_start_timeout_names_the_limit(runtime):
    runtime.initialize(groups=_groups(1), start_timeout_s=2)
    with pytest.raises(TimeoutError) as info:
        Slow(30.0, remote_group="ta")
    assert str(info.value) == "start-up of gang ta/Slow (1 worker(s)) did not finish within 2s"
    assert current().gangs == []


@pytest.mark.slow
def test_a_start_timeout_in_a_block_names_the_limit_and_closes_the_block(runtime):
    runtime.initialize(groups=_groups(1), start_timeout_s=2)
    with pytest.raises(TimeoutError) as info:
        with start_together():
            a = Slow(30.0, remote_group="ta")
            b = Slow(remote_group="tb")
    assert str(info.value) == "start-up of gang ta/Slow (1 worker(s)) did not finish within 2s"
    assert a.closed and b.closed and current().gangs == []


@pytest.mark.slow
def test_a_gang_closed_while_starting_is_gone_and_leaves_the_block_alone(runtime):
    runtime.initialize(groups=_groups(1))
    with start_together():
        a = Slow(2.0, remote_group="ta")
        b = Slow(remote_group="tb")
        a.close()  # the user no longer wants it
        with pytest.raises(RuntimeError, match=r"gang ta/Slow is gone \(closed\)"):
            a.ran()
    assert b.closed is None and b.ran()()


@pytest.mark.slow
def test_after_a_failed_block_a_gang_still_starting_then_is_gone(runtime):
    runtime.initialize(groups=_groups(1))
    with pytest.raises(ValueError, match="gang tb/Slow failed to start"):
        with start_together():
            a = Slow(8.0, remote_group="ta")
            Slow(fail=True, remote_group="tb")
    with pytest.raises(RuntimeError, match=r"gang ta/Slow is gone \(another gang of its "
                                           r"start_together\(\) block did not start"):
        a.ran()


@pytest.mark.slow
def test_shutdown_inside_the_block_leaves_it_nothing_to_wait_for(runtime):
    runtime.initialize(groups=_groups(1))
    with start_together():
        a = Slow(2.0, remote_group="ta")
        runtime.shutdown()
    assert a.closed == "twinkle_ray.shutdown() was called"


@pytest.mark.slow
def test_a_failure_another_thread_met_first_still_fails_the_block(runtime):
    runtime.initialize(groups=_groups(1))
    seen = []

    def use(p):
        try:
            p.ran()()
        except Exception as e:  # the user's thread
            seen.append(e)

    with pytest.raises(ValueError, match="gang ta/Slow failed to start"):
        with start_together():
            a = Slow(fail=True, remote_group="ta")
            b = Slow(3.0, remote_group="tb")
            t = threading.Thread(target=use, args=(a,))
            t.start()
            t.join()
    assert seen and "gang ta/Slow failed to start" in " ".join(seen[0].__notes__)
    assert b.closed is not None  # its block failed: it is not left running


@pytest.mark.slow
@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "in-a-list"])
def test_a_gang_that_failed_to_start_passed_on_raises_its_own_error(runtime, nested):
    runtime.initialize(groups=_groups(1))
    with pytest.raises(ValueError, match="gang ta/Slow failed to start"):
        with start_together():
            a = Slow(fail=True, remote_group="ta")
            Holder([a] if nested else a, remote_group="tb")  # not "cannot be pickled"
    assert current().gangs == []


@pytest.mark.slow
def test_passing_a_starting_gang_does_not_hold_up_the_receivers_other_callers(runtime):
    runtime.initialize(groups=_groups(1))
    b = Slow(remote_group="tb")
    b.ran()()
    with start_together():
        a = Slow(6.0, remote_group="ta")
        t = threading.Thread(target=lambda: b.take(a)())  # waits for a's start-up
        t.start()
        time.sleep(1.0)
        b.ran()()  # another thread's call on b goes ahead (before: it waited under b's turn lock)
        assert a.start_under_way is not None  # so it did not wait for a
        t.join()


@pytest.mark.slow
def test_abort_of_a_gang_still_starting_does_nothing(runtime):
    runtime.initialize(groups=_groups(1))
    with start_together():
        a = Slow(3.0, remote_group="ta")
        a.abort("weight sync failed elsewhere")  # no call has run: no rank is stuck
    assert a.ran()() and a.topology()["restarts"] == 0


@pytest.mark.slow
def test_an_inner_blocks_failure_closes_the_outer_blocks_gangs(runtime):
    runtime.initialize(groups=_groups(1))
    with pytest.raises(ValueError, match="gang tb/Slow failed to start"):
        with start_together():
            a = Healing(2.0, remote_group="ta")
            with start_together():
                Slow(fail=True, remote_group="tb")
    assert a.closed and current().gangs == []


@pytest.mark.slow
def test_an_error_right_after_the_dispatcher_is_made_leaves_nothing(runtime, monkeypatch):
    from conftest import leftovers
    from twinkle_ray.runtime.spec import GangSpec

    runtime.initialize(groups=_groups(1))

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt("between the dispatcher's creation and its proxy")

    monkeypatch.setattr(GangSpec, "gang_ref", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Slow(remote_group="ta")
    monkeypatch.undo()
    actors, _ = leftovers(timeout_s=5)
    assert not actors, [a.get("name") for a in actors]


def _starting_proxy(error: BaseException):
    """A proxy whose start-up ends in ``error`` (no Ray: stand-ins for the gang and its start)."""
    from types import SimpleNamespace

    from twinkle_ray.runtime.proxy import GangProxy
    from twinkle_ray.runtime.together import Start

    def finish(wait):
        raise error

    start = Start(None, "start-up of gang g/Slow (1 worker(s))", None, finish)
    gang = SimpleNamespace(dispatcher=None, group="g", cls_name="Slow", n_workers=1)
    return GangProxy(Slow, gang, "all", True, {"label": "g/Slow"}, starting=start)


def test_a_ctrl_c_while_waiting_is_not_kept_as_the_gangs_error():
    p = _starting_proxy(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        p.wait_started()
    assert p.closed == "its start-up failed: KeyboardInterrupt"
    p.wait_started()  # no phantom Ctrl-C later (pickling the proxy, passing it on)
    with pytest.raises(RuntimeError, match=r"gang g/Slow is gone \(its start-up failed"):
        p._check_open()


def test_a_start_error_is_raised_again_with_a_fresh_traceback():
    import traceback

    p = _starting_proxy(ValueError("no constructor today"))
    depths = []
    for _ in range(3):
        with pytest.raises(ValueError, match="no constructor today") as info:
            p.wait_started()
        depths.append(len(traceback.extract_tb(info.value.__traceback__)))
    assert depths[1] == depths[2], depths  # not one frame more at each raise


def test_a_task_that_outlives_its_block_makes_gangs_that_wait():
    """A task created in the block copies the context: after the block's end it must not
    leave a gang unstarted in the ended block (no Ray: a stand-in proxy)."""
    import asyncio

    from twinkle_ray.runtime.together import join_or_wait

    class Stand:
        waited = False

        def wait_started(self):
            self.waited = True

    made = Stand()

    async def main():
        with start_together():
            task = asyncio.get_running_loop().create_task(asyncio.sleep(0.05))
            later = asyncio.get_running_loop().create_task(_after(task))
        await later

    async def _after(task):
        await task  # the block has ended by now
        join_or_wait(made)

    asyncio.run(main())
    assert made.waited
