"""The call's wire format (runtime.wire): arguments pickled once by the caller, routed values
as slots wherever they sit, refs and large arrays kept out of the bytes; and proxies found by
name. The codec runs without Ray; the put and lookup tests use the session's Ray.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from twinkle_ray.core.dispatch import call_targets
from twinkle_ray.runtime.wire import (
    PUT_BYTES,
    Cut,
    Encoding,
    Routable,
    Route,
    Task,
    decode,
    mark_cuts,
    unpicklable,
)


class Fake(Routable):
    """A stand-in LazyResult: what the codec sees of one."""

    def __init__(self, name: str):
        self.name = name

    def route_facts(self) -> Route:
        return Route(reply_ref=None, method=self.name)


@dataclasses.dataclass
class Batch:
    rollouts: object
    adv: list


class Holder:
    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner


def _round_trip(args: tuple, kwargs: dict, split=None, tops: tuple = ()):
    enc = Encoding(own_gang=None)
    s = enc.encode(args, kwargs, split)
    task = Task("m", 1, "value", s.args, s.kwargs, s.nested, (), split)
    if not tops and s.tops:  # what Ray does for a task's top-level refs
        import ray

        tops = tuple(ray.get(s.tops))
    got = decode(task, tops, lambda j: f"<slot {j}: {enc.routes[j].method}>")
    return enc, s, got


def test_plain_arguments_round_trip_through_one_pickle():
    args = ({"ids": [1, 2], "t": 0.5}, (3, "x"), np.arange(4))
    enc, s, (a, kw) = _round_trip(args, {"k": None})
    assert a[0] == args[0] and a[1] == args[1] and np.array_equal(a[2], args[2]) and kw == {"k": None}
    assert enc.routes == [] and s.tops == [] and s.nested == []
    assert all(isinstance(b, bytes) for b in (*s.args, *s.kwargs.values()))  # one pickle each
    enc, s, got = _round_trip((), {})
    assert s.args == () and s.kwargs == {} and got == ((), {})  # nothing to send: no bytes


def test_a_routed_value_anywhere_in_the_arguments_is_a_slot():
    """Guards against: a LazyResult inside a dict reached the rank as a LazyResult object, whole. The
    pickler finds them wherever pickle walks: dicts, lists, tuples, dataclass fields, slots of
    a user's object, sets, keyword arguments; the same one twice is one slot."""
    x, y = Fake("x"), Fake("y")
    args = ({"rollouts": x, "adv": [1, 2]}, [y, 3], (x,), Batch(y, [1]), Holder(x), frozenset({y}))
    enc, _, (a, kw) = _round_trip(args, {"kw": x})
    assert [r.method for r in enc.routes] == ["x", "y"]
    assert a[0] == {"rollouts": "<slot 0: x>", "adv": [1, 2]}
    assert a[1] == ["<slot 1: y>", 3] and a[2] == ("<slot 0: x>",)
    assert a[3] == Batch("<slot 1: y>", [1]) and a[4].inner == "<slot 0: x>"
    assert a[5] == frozenset({"<slot 1: y>"}) and kw == {"kw": "<slot 0: x>"}
    assert all(not r.cut for r in enc.routes)  # none at a position a dispatch cuts


def test_mark_cuts_marks_what_the_dispatch_cuts_and_names_where():
    x = Fake("x")
    a, kw = mark_cuts("slice_dp", (x, {"r": x, "deep": {"q": x}, "l": [x]}, [x]), {"k": x})
    assert isinstance(a[0], Cut) and a[0].location == "argument 0"
    assert a[1]["r"].location == "argument 1 ['r']" and a[1]["deep"]["q"].location == "argument 1 ['deep'] ['q']"
    assert a[1]["l"][0] is x and a[2][0] is x  # inside a list: an item, passed whole
    assert isinstance(kw["k"], Cut) and kw["k"].location == "argument 'k'"
    a, _ = mark_cuts("slice", (x, {"r": x}), {})  # 'slice' cuts whole list arguments only
    assert isinstance(a[0], Cut) and a[1]["r"] is x
    plain = ({"r": 1},)
    assert mark_cuts("slice_dp", plain, {})[0] is plain  # nothing routed: nothing copied
    assert mark_cuts("all", (x,), {})[0][0] is x
    enc, _, (got, _) = _round_trip(mark_cuts("slice_dp", ({"r": x},), {})[0], {})
    assert enc.routes[0].cut and enc.routes[0].location == "argument 0 ['r']"
    assert got[0] == {"r": "<slot 0: x>"}


def test_large_arrays_and_large_bytes_leave_the_message(ray_session):
    import ray

    big = np.zeros(PUT_BYTES // 8, dtype=np.float64)  # exactly PUT_BYTES: put
    args = ({"x": big, "small": np.ones(3)},)
    enc, s, _ = _round_trip(args, {})
    assert len(s.tops) == 1 and len(s.args[0]) < PUT_BYTES  # the array went to the object store
    _, _, (a, _) = _round_trip(args, {}, tops=tuple(ray.get(s.tops)))
    assert np.array_equal(a[0]["x"], big) and np.array_equal(a[0]["small"], np.ones(3))
    data = list(range(40_000))  # a large value pickle keeps in the bytes (~120 KB, measured)
    enc, s, _ = _round_trip((data, 1), {})
    assert s.args[0] == 0 and isinstance(s.args[1], bytes)  # that argument's pickle was put
    task = Task("m", 1, "value", s.args, s.kwargs, s.nested, (), None)
    assert decode(task, tuple(ray.get(s.tops)), None) == ((data, 1), {})
    ref = ray.put(b"raw")
    enc, s, _ = _round_trip((ref, [ref]), {})
    assert s.tops == [ref] and s.nested == [ref]  # whole: resolved by Ray; nested: stays a ref
    task = Task("m", 1, "value", s.args, s.kwargs, s.nested, (), None)
    a, _ = decode(task, (b"raw",), None)
    assert a[0] == b"raw" and a[1] == [ref]  # bytes passed whole are the value, not a pickle


def test_an_argument_the_rank_cannot_unpickle_is_named(tmp_path, monkeypatch):
    import sys

    (tmp_path / "only_here.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_here

    enc = Encoding(own_gang=None)
    s = enc.encode((1, only_here.Thing()), {}, None)
    del sys.modules["only_here"]
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    task = Task("m", 1, "value", s.args, s.kwargs, s.nested, (), None)
    with pytest.raises(TypeError, match=r"M.m\(\) on rank 0: argument 1 cannot be unpickled in "
                                        r"this Ray worker \(ModuleNotFoundError: No module named "
                                        r"'only_here'\): only_here is importable in the caller but "
                                        r"not in the gang's Ray workers; ship it with runtime_env "
                                        r"py_modules or working_dir; the call did not run"):
        decode(task, (), None, "M.m() on rank 0")


def test_an_argument_that_cannot_be_pickled_is_named():
    assert unpicklable((1, threading.Lock()), {}).startswith("argument 1 of type lock")
    assert unpicklable((1,), {"f": threading.Lock()}).startswith("argument 'f' of type lock")
    assert unpicklable((1,), {}) is None
    with pytest.raises(TypeError, match="argument 'f' of type lock cannot be pickled"):
        Encoding(own_gang=None).encode((1,), {"f": threading.Lock()}, None)


def test_targets():
    assert call_targets("first", (1, 2), 4) == [0]
    assert call_targets("peer", (0, 2), 4) == [0, 1]
    assert call_targets("peer", None, 3) == [0, 1, 2]  # no caller rank: every worker


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

    from twinkle_ray.runtime import errors, reply, wire

    for module in (errors, reply, wire):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_many_small_arguments_together_never_carry_payload_through_the_dispatcher(ray_session):
    """Each argument under PUT_BYTES, forty of them over it: the largest are put until what
    stays in the task comes to less than PUT_BYTES."""
    import ray

    args = tuple(b"x" * (60_000 - i) for i in range(40))
    kwargs = {f"k{i}": "y" * (60_000 - i) for i in range(10)}
    enc, s, _ = _round_trip(args, kwargs)
    inline = [v for v in [*s.args, *s.kwargs.values()] if isinstance(v, bytes)]
    assert sum(map(len, inline)) < PUT_BYTES
    task = Task("m", 1, "value", s.args, s.kwargs, s.nested, (), None)
    assert decode(task, tuple(ray.get(s.tops)), None) == (args, kwargs)


def test_a_tensor_view_travels_as_its_own_elements():
    """torch pickles a view with its whole storage: a slice of a 4 MB batch would carry 4 MB."""
    import pickle

    import torch

    batch = torch.arange(1_000_000, dtype=torch.float32)
    enc, s, _ = _round_trip((batch[:10], batch.view(1000, 1000)[:, :2]), {})
    assert sum(len(a) for a in s.args) < 20_000
    first, column = (pickle.loads(a) for a in s.args)
    assert torch.equal(first, batch[:10]) and first.untyped_storage().nbytes() == 40
    assert torch.equal(column, batch.view(1000, 1000)[:, :2])
