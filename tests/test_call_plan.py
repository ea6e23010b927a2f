"""The call's parts: the worker message format, the router's plan, proxies found by name.

Pure parts run without Ray; the lookup test starts a small gang.
"""

from __future__ import annotations

import pytest

from twinkle_ray.runtime.message import WorkerCall
from twinkle_ray.runtime.routed import Pieces, Window
from twinkle_ray.runtime.routing import _with_aligned_slots, call_targets, needs_lengths


def test_worker_call_round_trips_through_the_task_form():
    call = WorkerCall("forward", 3, ("len0", "own"), (1, [2]), {"k": 4})
    args = call.task_args()
    assert args[0] == b"forward/3/2"  # one bytes head: Ray carries it cheaper than a str
    assert WorkerCall.from_task(args[0], args[1:], call.kwargs) == call
    unnumbered = WorkerCall("__next__", None, (), (), {})
    assert WorkerCall.from_task(unnumbered.task_args()[0], (), {}) == unnumbered
    bare = WorkerCall.from_task("noop", (5,), {})
    assert (bare.method, bare.seq, bare.lead, bare.args) == ("noop", None, (), (5,))


def test_targets_and_length_records():
    assert call_targets("first", (1, 2), 4) == [0]
    assert call_targets("peer", (0, 2), 4) == [0, 1]
    assert call_targets("peer", None, 3) == [0, 1, 2]  # no caller rank: every worker
    assert needs_lengths(None, 4) and needs_lengths("first", 4) and needs_lengths("none", 1)
    # several 'none' outputs too: a tuple's record says they are joined element-wise (issue 27)
    assert not needs_lengths("sum", 4) and needs_lengths("none", 2)


def test_aligned_slots_leave_the_planned_markers_alone():
    marker = Pieces(None, window=Window(2, 0), aligned=0, refs_ref="held", n_refs=2, own="out0")
    extra, args, kwargs = _with_aligned_slots(2, (marker, 7), {"again": marker})
    assert extra == ["out0"]  # the same value twice travels once
    assert args[0] is kwargs["again"] and args[0].aligned_slot == 2 and args[0].own is None
    assert marker.aligned_slot is None and marker.own == "out0"  # the plan's marker is unchanged
    other = Pieces(["r0", "r1"], window=Window(2, 1), aligned=1)
    extra, args, _ = _with_aligned_slots(0, (other,), {})
    assert extra == ["r1"] and args[0].aligned_slot == 0 and other.aligned_slot is None


@pytest.mark.timeout(180)
def test_lookup_returns_a_proxy_like_the_original(ray_session):
    import twinkle_ray
    from conftest import NAMESPACE, leftovers
    from twinkle_ray import DeviceGroup, remote_class, remote_function
    from twinkle_ray.runtime.proxy import GangProxy

    @remote_class(execute="first")
    class Loader:
        @remote_function(dispatch="all", collect="none")
        def rank(self) -> int:
            return int(__import__("os").environ["RANK"])

    twinkle_ray.shutdown()
    twinkle_ray.initialize("ray", groups=[DeviceGroup("lk", ranks=2, device_type="CPU")],
                           namespace=NAMESPACE, lazy_collect=False)
    try:
        original = Loader(remote_group="lk")
        found = GangProxy.lookup("lk/Loader", namespace=NAMESPACE)
        assert original.rank() == 0 and found.rank() == 0  # values, not LazyResults, in both
        assert found._execute == original._execute == "first"
    finally:
        twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs


def test_docstring_examples():
    import doctest

    from twinkle_ray.runtime import errors, message, ranks, routing

    for module in (errors, message, ranks, routing):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__
