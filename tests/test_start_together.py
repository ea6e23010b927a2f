"""start_together(): gangs made in one block start up at the same time, and the block's end
waits for all of them; a start-up that fails closes every gang of the block and raises."""

from __future__ import annotations

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


def _groups():
    return [DeviceGroup("ta", 2, "cpu"), DeviceGroup("tb", 2, "cpu")]


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
    with pytest.raises(RuntimeError, match=r"gang tb/Slow failed to start \(rank \d\): "
                                           r"ValueError: no constructor today"):
        with start_together():
            a = Slow(2.0, remote_group="ta")
            b = Slow(fail=True, remote_group="tb")
    assert b.closed == "its start-up failed: RuntimeError"
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
