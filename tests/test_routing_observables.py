"""Routed equals passed in every observable (quick tier): a LazyResult given to a method and the
same result fetched and passed must arrive alike in all a method can see of them: value, type,
dtype, shape, strides and contiguity, the writeable flag, device, and which arguments are one
object (``f(x, x)``: two objects, as two passed arguments are unpickled one by one).

Each rank describes what it received (:func:`describe`, run in the rank: the way back would
change what is described); the routed call's descriptions must equal the passed call's. The
generated test draws the same LazyResult in several places at once, arrays and tensors from
non-contiguous producers (Fortran-ordered, strided, transposed, a view of a larger storage),
small payloads (in the task's bytes) and large ones (the object store). Two small gangs, made
once for the module. (The value-only oracle over many layouts: test_routing_gangs.py.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import leftovers
from twinkle_ray import DeviceGroup, DeviceMesh, get_rank, remote_class, remote_function

EXAMPLES = 200 if os.environ.get("TWINKLE_HYPOTHESIS_PROFILE") == "long" else 12
WIDE = 8192  # float32 columns: 32 KB a row, so a part of two rows or more is put when passed


def make(kind: str, layout: str, rows: int, wide: bool, rank: int):
    """Producer rank ``rank``'s value: ``kind`` ('list', 'ndarray', 'tensor', 'dict') with
    ``rows`` items laid out as ``layout`` ('C', 'F', 'strided', 'view': of a larger storage)."""
    if kind == "list":
        return [100 * rank + j for j in range(rows)]
    if kind == "dict":
        return {"ids": [100 * rank + j for j in range(rows)],
                "x": make("ndarray", layout, rows, wide, rank), "step": rank}
    cols = WIDE if wide else 3
    base = np.arange(rows * cols * 2, dtype=np.float32).reshape(rows, 2 * cols) + 1000 * rank
    if layout == "C":
        arr = np.ascontiguousarray(base[:, :cols])
    elif layout == "F":
        arr = np.asfortranarray(base[:, :cols])
    elif layout == "strided":
        arr = base[:, ::2]
    else:  # 'view': rows of a larger array
        arr = np.concatenate([base[:, :cols], base[:, :cols]])[:rows]
    if kind == "ndarray":
        return arr
    import torch

    t = torch.from_numpy(np.ascontiguousarray(base))
    if layout == "C":
        return t[:, :cols].contiguous()
    if layout == "F":
        return t[:, :cols].contiguous().T.contiguous().T  # column-major strides
    if layout == "strided":
        return t[:, ::2]  # its storage holds the other columns too
    return torch.cat([t, t])[:rows, :cols]  # a view of a larger storage


def describe(value, seen: dict | None = None):
    """Everything a method can observe of ``value``, mutable objects numbered in order of
    first sight (a repeat names its first sight: identity between and within arguments)."""
    import sys

    seen = {} if seen is None else seen
    torch = sys.modules.get("torch")
    if isinstance(value, list | dict | np.ndarray) or (torch and isinstance(value, torch.Tensor)):
        if id(value) in seen:
            return ("same as", seen[id(value)])
        seen[id(value)] = len(seen)
    if isinstance(value, np.ndarray):
        f = value.flags
        return ("ndarray", str(value.dtype), value.shape, value.strides, f.c_contiguous,
                f.f_contiguous, f.writeable, value.tolist())
    if torch and isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.stride(),
                value.is_contiguous(), str(value.device), value.tolist())
    if isinstance(value, dict):
        return (type(value).__name__, [(k, describe(v, seen)) for k, v in value.items()])
    if isinstance(value, list | tuple):
        return (type(value).__name__, [describe(v, seen) for v in value])
    return (type(value).__name__, value)


@remote_class(distributed=False)
class Node:
    def __init__(self, device_mesh: DeviceMesh | None = None):
        self.mesh = device_mesh

    @remote_function(dispatch="all", collect="none")
    def p_none(self, *spec):
        return make(*spec, get_rank())

    @remote_function(dispatch="all", collect="flatten")
    def p_flatten(self, *spec):
        return make(*spec, get_rank())

    @remote_function(dispatch="all", collect="flatten")
    def p_per_rank(self, kind, layouts, rows, wide):
        """Rank r's value laid out as ``layouts[r]`` with ``rows[r]`` rows."""
        return make(kind, layouts[get_rank()], rows[get_rank()], wide, get_rank())

    @remote_function(dispatch="all", collect="first")
    def p_first(self, *spec):
        return make(*spec, get_rank())

    @remote_function(dispatch="all", collect="none")
    def c_all(self, *args, **kwargs):
        return [describe((args, kwargs))]

    @remote_function(dispatch="slice_dp", collect="none")
    def c_slice_dp(self, *args, **kwargs):
        return [describe((args, kwargs))]

    @remote_function(dispatch="slice", collect="none")
    def c_slice(self, *args, **kwargs):
        return [describe((args, kwargs))]

    @remote_function(dispatch="all", collect="none")
    def c_change_first(self, a, b):
        """Changes its first argument in place; returns what its second is then."""
        target = a[0] if isinstance(a, list) and a and isinstance(a[0], dict | np.ndarray) else a
        if isinstance(target, list):
            target.append(-1)
        else:  # a dict, an array (raises when read-only, routed or passed alike)
            target[0] = -1
        return [describe(b)]

    @remote_function(dispatch="slice_dp", collect="none")
    def c_flat_view(self, x):
        return [x.view(-1).tolist()]


@pytest.fixture(scope="module")
def gangs(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("obs", 2, "cpu")])
    made = {"producer": Node(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="obs"),
            "consumer": Node(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="obs")}
    yield made
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


def outcome(call):
    try:
        return call(), None
    except (ValueError, TypeError) as e:  # compared by type
        return None, e


# --------------------------------------------------------------------------- the three defects


@pytest.mark.parametrize("kind", ["list", "dict", "ndarray"])
def test_one_lazy_result_in_two_arguments_arrives_as_two_objects(gangs, kind):
    """Guards against: ``c.f(x, x)`` (dispatch='all') got one object in both places, so a
    method that changed its first argument in place changed its second. Fetched and passed
    twice it arrives as two objects: routed, too."""
    p, c = gangs["producer"], gangs["consumer"]
    for method in ("p_flatten", "p_none", "p_first"):
        x = getattr(p, method)(kind, "C", 3, False)
        fetched = x()
        routed, routed_error = outcome(lambda x=x: c.c_change_first(x, x)())
        passed, passed_error = outcome(lambda v=fetched: c.c_change_first(v, v)())
        assert type(routed_error) is type(passed_error), (method, routed_error, passed_error)
        assert routed == passed, (method, routed, passed)


@pytest.mark.parametrize("wide", [False, True])  # in the task's bytes / put
def test_a_routed_array_has_the_writeable_flag_of_the_passed_one(gangs, wide):
    """Guards against: a small array routed arrived writable while fetched and passed it
    arrives read-only (a fetched output is read-only; pickled in band, it stays so)."""
    p, c = gangs["producer"], gangs["consumer"]
    for method in ("p_first", "p_none", "p_flatten"):
        x = getattr(p, method)("ndarray", "C", 2, wide)
        assert c.c_all(x)() == c.c_all(x())(), (method, wide)
        assert c.c_slice_dp(x)() == c.c_slice_dp(x())(), (method, wide)


@pytest.mark.parametrize("method", ["p_first", "p_flatten"])
def test_a_routed_tensor_window_is_contiguous_when_the_passed_one_is(gangs, method):
    """Guards against: a routed tensor window kept a non-contiguous producer's strides, so
    ``x.view(-1)`` raised only when routed; fetched and passed the window is contiguous."""
    p, c = gangs["producer"], gangs["consumer"]
    x = getattr(p, method)("tensor", "strided", 4, False)
    assert c.c_flat_view(x)() == c.c_flat_view(x())()
    assert c.c_slice_dp(x)() == c.c_slice_dp(x())()


@pytest.mark.parametrize("kind,layouts,rows,wide", [
    ("ndarray", ("F", "F"), (2, 2), True),  # windows aligned with the outputs
    ("ndarray", ("F", "F"), (2, 2), False),  # (small: in the task's bytes)
    ("ndarray", ("F", "F"), (3, 1), True),  # one window in output 0, one across both
    ("ndarray", ("F", "C"), (3, 1), True),  # mixed: np.concatenate lays the join out C-ordered
    ("ndarray", ("C", "F"), (1, 3), False),
    ("dict", ("C", "F"), (1, 3), True),
])
def test_a_window_of_a_join_of_fortran_ordered_outputs_arrives_as_passed(gangs, kind, layouts,
                                                                          rows, wide):
    """Guards against: Fortran-ordered outputs joined (collect='flatten') and cut by slice_dp:
    np.concatenate keeps their layout, so a window of the join is not contiguous and, passed,
    arrives as a writable C-ordered copy; routed it arrived read-only (a window of one output
    stood for it, as for C-ordered outputs)."""
    p, c = gangs["producer"], gangs["consumer"]
    x = p.p_per_rank(kind, list(layouts), list(rows), wide)
    assert c.c_slice_dp(x)() == c.c_slice_dp(x())(), (layouts, rows, wide)


# --------------------------------------------------------------------------- the oracle

PLACES = ("arg", "kwarg", "dict", "list", "twice")


def place(lazy, places: list[str], batch: list) -> tuple[tuple, dict]:
    """(args, kwargs) with ``lazy`` at each of ``places`` (a plain batch beside it in a dict)."""
    args, kwargs = [], {}
    for i, where in enumerate(places):
        if where == "arg":
            args.append(lazy)
        elif where == "kwarg":
            kwargs[f"k{i}"] = lazy
        elif where == "dict":
            args.append({"routed": lazy, "plain": batch})
        elif where == "list":
            args.append([lazy, "beside"])
        else:  # twice in one argument
            args.append([lazy, lazy])
    return tuple(args), kwargs


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["ndarray", "tensor", "dict", "list"]),
       layout=st.sampled_from(["C", "F", "strided", "view"]), rows=st.integers(1, 4),
       wide=st.booleans(), method=st.sampled_from(["p_none", "p_flatten", "p_first"]),
       dispatch=st.sampled_from(["c_all", "c_slice_dp", "c_slice"]),
       places=st.lists(st.sampled_from(PLACES), min_size=1, max_size=3))
def test_routed_and_passed_arrive_alike_in_every_observable(gangs, kind, layout, rows, wide,
                                                            method, dispatch, places):
    lazy = getattr(gangs["producer"], method)(kind, layout, rows, wide)
    fetched = lazy()
    fn = getattr(gangs["consumer"], dispatch)
    batch = list(range(4))
    routed, routed_error = outcome(lambda: fn(*place(lazy, places, batch)[0],
                                              **place(lazy, places, batch)[1])())
    passed, passed_error = outcome(lambda: fn(*place(fetched, places, batch)[0],
                                              **place(fetched, places, batch)[1])())
    if routed_error is not None or passed_error is not None:
        assert type(routed_error) is type(passed_error), (routed_error, passed_error)
        return
    assert len(routed) == len(passed)
    for rank, (got, want) in enumerate(zip(routed, passed, strict=True)):
        assert got == want, (rank, got, want)
