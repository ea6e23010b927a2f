"""The routing rule, pure (no Ray): generated outputs against the fetch-then-pass oracle.

A consumer rank's argument is ``split(spec, collect(producer outputs))[rank]``. The oracle
here is written from the public functions a caller uses: ``collect`` (what ``get()`` gives)
and ``dispatch`` (what passing that value gives each worker), with a method's several return
values passed element by element, each as an argument in its place. The routed side is
``core.routing.Routed``: records, skeletons, and only the covering outputs fetched.

Generated: nested lists / tuples / dicts (and OrderedDicts) / namedtuples / ndarrays / tensors,
per-rank scalars,
uneven and empty sequences, ranks whose outputs differ in type; every collect mode; producer
meshes with and without pipeline stages; 'slice' and 'slice_dp' consumers of 1-4 parts, with
plain list arguments beside the routed one. The example budget is the profile's (conftest:
``ci`` by default, ``long`` with ``--hypothesis-profile=long``).
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinkle_ray.core.dispatch import (
    Split,
    collect,
    dispatch,
    slice_length,
    span,
)
from twinkle_ray.core.mesh import DeviceMesh
from twinkle_ray.core.routing import Routed, Source, record_balanced, record_of

Pair = namedtuple("Pair", "a b")

# --------------------------------------------------------------------------- generated values

LEAF = st.sampled_from(["int", "float", "str", "none", "arr0"])
SEQ = st.one_of(st.just(("list",)), st.just(("tupleseq",)), st.just(("tensor",)),
                st.tuples(st.just("nd"), st.sampled_from(["int64", "float32"]),
                          st.sampled_from([(), (2,)])))
INNER = st.recursive(
    st.one_of(LEAF.map(lambda k: ("leaf", k)), SEQ),
    lambda children: st.tuples(
        st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3),
        st.sampled_from([dict, dict, OrderedDict]))  # a dict subclass keeps its type both ways
    .map(lambda d: ("dict", tuple(d[0].items()), d[1])),
    max_leaves=5)
TOP = st.one_of(
    INNER,
    st.tuples(st.just("tuple"), st.lists(INNER, min_size=1, max_size=3), st.booleans()),
    st.tuples(st.just("tuple"), st.lists(st.tuples(st.just("tuple"), st.lists(INNER, min_size=2,
                                                                              max_size=2),
                                                   st.just(False)), min_size=1, max_size=2),
              st.just(False)))


def make(spec, draw, rank: int, uneven: bool):
    """A value of ``spec`` for producer ``rank`` (distinct per rank; lengths drawn)."""
    kind = spec[0]
    if kind == "leaf":
        leaf = spec[1]
        if leaf == "int":
            return draw(st.integers(0, 3)) + 10 * rank
        if leaf == "float":
            return float(draw(st.integers(0, 3)))
        if leaf == "str":
            return f"r{rank}"
        if leaf == "arr0":
            return np.array(rank)
        return None
    if kind == "dict":
        return spec[2]((k, make(v, draw, rank, uneven)) for k, v in spec[1])
    if kind == "tuple":
        items = [make(v, draw, rank, uneven) for v in spec[1]]
        return Pair(*items) if spec[2] and len(items) == 2 else tuple(items)
    n = draw(st.integers(0, 4)) if uneven else 2
    if kind == "list":
        return [100 * rank + j for j in range(n)]
    if kind == "tupleseq":
        return tuple(f"t{rank}.{j}" for j in range(n))
    if kind == "tensor":
        return torch.arange(n, dtype=torch.float32) + rank
    _, dtype, trailing = spec
    size = n * int(np.prod(trailing, dtype=int))
    return (np.arange(size) + 100 * rank).astype(dtype).reshape((n, *trailing))


@st.composite
def case(draw):
    n = draw(st.integers(1, 4))
    spec = draw(TOP)
    uneven = draw(st.booleans())
    odd = draw(st.sampled_from([None, None, None, 0, n - 1]))  # one rank of another type
    other = draw(TOP) if odd is not None else None
    outputs = [make(other if r == odd else spec, draw, r, uneven) for r in range(n)]
    mode = draw(st.sampled_from(["none", "flatten", "first", "last_pp", "last_pp_first",
                                 "custom", "mean", "sum"]))
    meshes = [None, DeviceMesh.from_sizes(dp_size=n)]
    if n == 4:
        meshes += [DeviceMesh.from_sizes(pp_size=2, dp_size=2),
                   DeviceMesh.from_sizes(dp_size=2, tp_size=2)]
    mesh = draw(st.sampled_from(meshes))
    split_mode = draw(st.sampled_from(["slice_dp", "slice", "whole"]))
    parts = draw(st.integers(1, 4))
    index = draw(st.integers(0, parts - 1))
    plain = draw(st.sampled_from([None, 2, 4, 8])) if split_mode == "slice" else None
    return outputs, mode, mesh, split_mode, parts, index, plain


def _reverse(results, mesh):
    return results[::-1]


def collect_mode(mode):
    return _reverse if mode == "custom" else mode


# --------------------------------------------------------------------------- the oracle


def fetched_then_passed(outputs, mode, mesh, split_mode, parts, index, plain):
    """What the rank gets when the caller fetches the result and passes it."""
    if plain is not None:  # the caller's dispatch of its plain argument runs first, as routed
        dispatch("slice", parts, (None, list(range(plain))), {})
    workers = list(range(len(outputs)))
    value = collect(collect_mode(mode), outputs, device_mesh=mesh, worker_indices=workers)
    if split_mode == "whole":
        return value
    extra = [list(range(plain))] if plain is not None else []
    cmesh = DeviceMesh.from_sizes(dp_size=parts)
    return dispatch(split_mode, parts, (value, *extra), {}, device_mesh=cmesh)[index][0][0]


def routed(outputs, mode, mesh, split_mode, parts, index, plain, fetched: list):
    workers = list(range(len(outputs)))
    source = Source(collect_mode(mode), [record_of(o) for o in outputs], workers, mesh)

    def fetch(ks):
        fetched.extend(ks)
        return [outputs[k] for k in ks]

    r = Routed(source, fetch)
    if split_mode == "whole":
        return r.part(None)
    if split_mode == "slice":
        if plain is not None:  # the caller's own dispatch of the plain argument, first
            dispatch("slice", parts, (None, list(range(plain))), {})
        lengths = r.list_lengths("argument 0")
        if plain is not None:
            lengths["argument 1"] = plain
        split = Split("slice", parts, index, slice_len=slice_length(lengths))
    else:
        split = Split("slice_dp", parts, index)
    return r.part(split, "argument 0")


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def outcome(fn, *args):
    try:
        return fn(*args), None
    except (ValueError, TypeError, RuntimeError) as e:  # compared by type below
        return None, e


# --------------------------------------------------------------------------- the properties


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(case())
def test_routed_equals_fetched_then_passed(c):
    check(c)


def check(c) -> None:
    """Routed == fetched then passed (or both raise the same error type); outputs read once."""
    outputs, mode, mesh, split_mode, parts, index, plain = c
    want, want_error = outcome(fetched_then_passed, *c)
    fetched: list = []
    got, got_error = outcome(routed, *c, fetched)
    if want_error is not None or got_error is not None:
        assert type(got_error) is type(want_error), (want_error, got_error)
        return
    assert same(got, want), (got, want)
    if mode not in ("flatten", "none"):  # picks or reductions: every output is read, so an
        assert sorted(fetched) == list(range(len(outputs)))  # error on any rank raises
    assert len(fetched) == len(set(fetched))  # each at most once


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_an_even_flatten_pulls_only_the_covering_outputs(n, parts, data):
    """The fast path's point: a consumer part pulls the outputs that cover it, no more."""
    index = data.draw(st.integers(0, parts - 1))
    per = data.draw(st.integers(parts, 6))  # items per output (>= parts: never too small)
    outputs = [{"ids": list(range(r * per, (r + 1) * per)), "x": np.zeros((per, 2)) + r}
               for r in range(n)]
    fetched: list = []
    got = routed(outputs, "flatten", None, "slice_dp", parts, index, None, fetched)
    lo, hi = span(n * per, parts, index)  # items [lo, hi)
    assert got["ids"] == list(range(n * per))[lo:hi]
    assert sorted(fetched) == sorted({i // per for i in range(lo, hi)})


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 10), st.integers(1, 3), st.integers(1, 4), st.data())
def test_a_balanced_result_routes_in_input_order(n_items, groups, parts, data):
    """A dispatch='balance' producer's outputs, joined in input order, cut like any value."""
    index = data.draw(st.integers(0, parts - 1))
    chunk = data.draw(st.integers(1, 3))
    bounds = [(s, min(s + chunk, n_items)) for s in range(0, n_items, chunk)]
    owner = [data.draw(st.integers(0, groups - 1)) for _ in bounds]  # who ran each chunk
    tuples = data.draw(st.booleans())
    outputs, records = [], []
    for g in range(groups):
        mine = [(s, e) for (s, e), o in zip(bounds, owner, strict=True) if o == g]
        items = [x for s, e in mine for x in range(s, e)]
        value = (items, [-x for x in items]) if tuples else items
        value = value if mine else None
        outputs.append(value)
        records.append(record_balanced(value, mine))
    from twinkle_ray.core.balance import in_input_order

    fetched = list(range(n_items))
    full = (fetched, [-x for x in fetched]) if tuples else fetched
    assert in_input_order(outputs, [r[1] for r in records]) == full
    source = Source("flatten", records, list(range(groups)), balanced=True)
    pulled: list = []

    def fetch(ks):
        pulled.extend(ks)
        return [outputs[k] for k in ks]

    split = Split("slice_dp", parts, index)
    try:  # the oracle: the fetched value, passed
        want = dispatch("slice_dp", parts, (full,), {},
                        device_mesh=DeviceMesh.from_sizes(dp_size=parts))[index][0][0]
    except ValueError as e:
        with pytest.raises(ValueError, match=str(e).split(": ", 1)[1][:30].replace("(", r"\(")):
            Routed(source, fetch).part(split)
        return
    got = Routed(source, fetch).part(split)
    assert got == want
    if tuples:
        return  # a tuple is cut along its own length: whichever outputs hold its elements
    lo, hi = span(n_items, parts, index)
    assert set(pulled) <= {o for (s, e), o in zip(bounds, owner, strict=True)
                           if s < hi and e > lo}


@pytest.mark.parametrize("mode", ["none", "flatten", "first"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_dict_subclass_keeps_its_type(mode, n):
    """An OrderedDict output (nested too) reaches the consumer as an OrderedDict, as passed."""
    outputs = [OrderedDict(ids=list(range(4 * r, 4 * r + 4)), meta=OrderedDict(r=r)) for r in range(n)]
    for index in (0, 1):
        check((outputs, mode, None, "slice_dp", 2, index, None))



@pytest.mark.parametrize("orders", [("F", "F"), ("F", "C"), ("C", "F")])
@pytest.mark.parametrize("rows", [(2, 2), (3, 1)])
def test_a_window_of_a_join_of_fortran_ordered_arrays_is_laid_out_as_the_real_one(orders, rows):
    """Guards against: a window of one Fortran-ordered output stood for the same window of
    the join, made C-ordered as for a join of C-ordered outputs; np.concatenate keeps the
    outputs' layout (C when mixed), so the real window is laid out otherwise."""
    outputs = [np.asfortranarray(np.arange(r * 3.0).reshape(r, 3) + 10 * k) if o == "F"
               else np.arange(r * 3.0).reshape(r, 3) + 10 * k
               for k, (o, r) in enumerate(zip(orders, rows, strict=True))]
    source = Source("flatten", [record_of(o) for o in outputs], workers=[0, 1])
    whole = np.concatenate(outputs)
    for index in range(2):
        split = Split("slice_dp", 2, index)
        got = Routed(source, lambda ks: [outputs[k] for k in ks]).part(split)
        want = whole[slice(*span(len(whole), 2, index))]
        assert got.tolist() == want.tolist()
        assert (got.strides, got.flags.c_contiguous, got.flags.f_contiguous) == (
            want.strides, want.flags.c_contiguous, want.flags.f_contiguous), (orders, rows, index)
