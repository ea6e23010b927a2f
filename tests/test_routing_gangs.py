"""Routing through real gangs, generated (hypothesis), against the fetch-then-pass oracle.

For each generated case a producer gang returns per-rank values of a generated shape under a
generated collect mode; the LazyResult goes to a consumer gang at a generated position in the
arguments (a whole argument, a keyword, inside a dict beside a plain batch, inside a list, a
tuple, a dataclass). The oracle is the same consumer call with the fetched value in its place:
every rank must receive exactly the same thing (or both calls raise the same kind of error).

The gangs are made once for the module; the example budget is fixed (``EXAMPLES``, larger under
``TWINKLE_HYPOTHESIS_PROFILE=long``). The pure rule is tested far harder, without Ray, in
test_routing_rule.py; this module shows the runtime keeps to it.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections import namedtuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import leftovers
from twinkle_ray import DeviceGroup, DeviceMesh, get_rank, remote_class, remote_function

EXAMPLES = 400 if os.environ.get("TWINKLE_HYPOTHESIS_PROFILE") == "long" else 30
Pair = namedtuple("Pair", "a b")

pytestmark = pytest.mark.slow  # four gangs and a few dozen calls per example (~1 min)


@dataclasses.dataclass
class Box:
    value: object
    tag: str = "box"


# --------------------------------------------------------------------------- shapes

LEAF = st.sampled_from([("int",), ("str",), ("float",), ("const",)])
SEQ = st.sampled_from([("list",), ("ndarray",), ("tensor",), ("tupleseq",)])
INNER = st.recursive(LEAF | SEQ, lambda ch: st.dictionaries(
    st.sampled_from("abc"), ch, min_size=1, max_size=3).map(lambda d: ("dict", tuple(d.items()))),
    max_leaves=4)
SHAPE = INNER | st.tuples(st.just("tuple"), st.lists(INNER, min_size=2, max_size=2), st.booleans())


def make(spec: tuple, rank: int, rng: random.Random):
    kind = spec[0]
    if kind == "int":
        return rng.randrange(4) + 10 * rank
    if kind == "const":  # the same on every rank
        return 16
    if kind == "float":
        return float(rank)
    if kind == "str":
        return f"r{rank}"
    if kind == "dict":
        return {k: make(v, rank, rng) for k, v in spec[1]}
    if kind == "tuple":
        items = [make(v, rank, rng) for v in spec[1]]
        return Pair(*items) if spec[2] else tuple(items)
    n = rng.randrange(1, 5)
    if kind == "list":
        return [100 * rank + j for j in range(n)]
    if kind == "tupleseq":
        return tuple(f"t{rank}.{j}" for j in range(n))
    if kind == "ndarray":
        return np.arange(2 * n, dtype=np.int64).reshape(n, 2) + 100 * rank
    import torch

    return torch.arange(n, dtype=torch.float32) + rank


def _reverse(results, mesh):
    return results[::-1]


@remote_class(distributed=False)
class Node:
    def __init__(self, device_mesh: DeviceMesh | None = None):
        self.mesh = device_mesh

    def _value(self, spec, seed):
        r = get_rank()
        return make(spec, r, random.Random(seed * 31 + r))

    @remote_function(dispatch="all", collect="none")
    def p_none(self, spec, seed):
        return self._value(spec, seed)

    @remote_function(dispatch="all", collect="flatten")
    def p_flatten(self, spec, seed):
        return self._value(spec, seed)

    @remote_function(dispatch="all", collect="first")
    def p_first(self, spec, seed):
        return self._value(spec, seed)

    @remote_function(dispatch="all", collect="last_pp")
    def p_last_pp(self, spec, seed):
        return self._value(spec, seed)

    @remote_function(dispatch="all", collect=_reverse)
    def p_custom(self, spec, seed):
        return self._value(spec, seed)

    @remote_function(dispatch="all", collect="last_pp")
    def p_first_stage_raises(self):
        if get_rank() == 0:
            raise KeyError("stage 0 failed")
        return [get_rank()]

    @remote_function(dispatch="all", collect="mean")
    def p_mean_counts(self):
        import torch

        return torch.tensor([get_rank(), 3])  # int64 on every rank

    @remote_function(dispatch="all", collect="flatten")
    def p_array(self):
        return np.arange(4) + 10 * get_rank()

    @remote_function(dispatch="all", collect="flatten")
    def p_floats(self, n):
        return np.arange(n, dtype=np.float32) + 1000 * get_rank()

    @remote_function(dispatch="slice_dp", collect="none")
    def c_writeable(self, x):
        return x.flags.writeable

    @remote_function(dispatch="all", collect="none")
    def c_default_dtype(self, name):
        import torch

        torch.set_default_dtype(getattr(torch, name))

    @remote_function(dispatch="balance", collect="flatten", chunk_size=2)
    def c_balance(self, items, extra):
        shown = extra.tolist() if hasattr(extra, "tolist") else extra
        return [(list(items), repr(shown))] * len(items)

    @remote_function(dispatch="all", collect="first")
    def c_describe(self, x):
        return str(x.dtype), x.tolist()

    @remote_function(dispatch="slice_dp", collect="none")
    def c_slice_dp(self, *args, **kwargs):
        return {"args": args, "kwargs": kwargs}

    @remote_function(dispatch="slice", collect="none")
    def c_slice(self, *args, **kwargs):
        return {"args": args, "kwargs": kwargs}

    @remote_function(dispatch="all", collect="none")
    def c_all(self, *args, **kwargs):
        return {"args": args, "kwargs": kwargs}


PRODUCERS = ("p_none", "p_flatten", "p_first", "p_last_pp", "p_custom")
CONSUMERS = ("c_slice_dp", "c_slice", "c_all")
POSITIONS = ("arg", "kwarg", "dict", "list", "tuple", "dataclass")


@pytest.fixture(scope="module")
def gangs(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("four", 4, "cuda"),
                                   DeviceGroup("pairs", 4, "cuda", gpus_per_worker=2)])
    made = {
        "dp4": Node(device_mesh=DeviceMesh.from_sizes(dp_size=4), remote_group="four"),
        "pp2_dp2": Node(device_mesh=DeviceMesh.from_sizes(pp_size=2, dp_size=2), remote_group="four"),
        "dp2_tp2": Node(device_mesh=DeviceMesh.from_sizes(dp_size=2, tp_size=2), remote_group="four"),
        "gpw2": Node(device_mesh=DeviceMesh.from_sizes(dp_size=2, tp_size=2), remote_group="pairs"),
    }
    yield made
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


def place(value, position: str, plain: list):
    """(args, kwargs) with ``value`` at ``position`` (a plain batch beside it in a dict)."""
    if position == "arg":
        return (value,), {}
    if position == "kwarg":
        return (), {"x": value}
    if position == "dict":
        return ({"routed": value, "plain": plain},), {}
    if position == "list":
        return ([value, "beside"],), {}
    if position == "tuple":
        return ((value, "beside"),), {}
    return (Box(value),), {}


def same(a, b) -> bool:
    import torch

    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray | torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a):
        return same(dataclasses.astuple(a), dataclasses.astuple(b))
    return a == b


def outcome(call):
    try:
        return call(), None
    except (ValueError, TypeError) as e:  # compared by type
        return None, e


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(shape=SHAPE, seed=st.integers(0, 1000), producer=st.sampled_from(["dp4", "pp2_dp2"]),
       method=st.sampled_from(PRODUCERS), consumer=st.sampled_from(["dp2_tp2", "gpw2", "dp4"]),
       dispatch=st.sampled_from(CONSUMERS), position=st.sampled_from(POSITIONS),
       plain=st.integers(2, 6))
def test_a_routed_value_is_what_fetching_and_passing_it_gives(gangs, shape, seed, producer, method,
                                                              consumer, dispatch, position, plain):
    lazy = getattr(gangs[producer], method)(shape, seed)
    fetched, fetch_error = outcome(lazy)
    if fetch_error is not None:  # e.g. 'last_pp' of values that do not join
        with pytest.raises(type(fetch_error)):
            getattr(gangs[consumer], dispatch)(*place(lazy, position, [])[0])()
        return
    batch = list(range(plain))
    fn = getattr(gangs[consumer], dispatch)
    args, kwargs = place(lazy, position, batch)
    routed, routed_error = outcome(lambda: fn(*args, **kwargs)())
    args, kwargs = place(fetched, position, batch)
    passed, passed_error = outcome(lambda: fn(*args, **kwargs)())
    if routed_error is not None or passed_error is not None:
        assert type(routed_error) is type(passed_error), (routed_error, passed_error)
        return
    assert len(routed) == len(passed)
    for rank, (got, want) in enumerate(zip(routed, passed, strict=True)):
        assert same(got, want), (rank, got, want)


def test_a_lazy_result_in_a_dict_is_cut_like_the_list_beside_it(gangs):
    """Guards against: ``trainer.step({"rollouts": sampler_out, "adv": adv})`` with slice_dp sliced
    the plain list and handed every rank the whole LazyResult object: 8 rollouts paired with 4
    advantages. Now both keys are cut by the data rank."""
    sampler, trainer = gangs["dp4"], gangs["gpw2"]  # 4 sampler ranks, a dp=2 trainer
    out = sampler.p_flatten(("list",), 0)
    rollouts = out()
    got = trainer.c_slice_dp({"rollouts": out, "adv": list(range(len(rollouts)))})()
    half = len(rollouts) // 2 + len(rollouts) % 2
    assert [r["args"][0] for r in got] == [
        {"rollouts": rollouts[:half], "adv": list(range(half))},
        {"rollouts": rollouts[half:], "adv": list(range(half, len(rollouts)))}]


def test_per_rank_scalars_keep_their_shape_routed_or_passed(gangs):
    """Guards against: per-rank ``{'rank': r, 'n': 16, 'sum': s}`` reached a consumer as
    ``{'rank': [0], 'n': 16, 'sum': [120]}``: per-rank values wrapped, the equal one collapsed,
    the shape depending on the values. Now every per-rank value is one per rank, routed or
    passed."""
    producer, consumer = gangs["dp4"], gangs["gpw2"]
    spec = ("dict", (("rank", ("float",)), ("n", ("const",)), ("sum", ("int",))))
    out = producer.p_flatten(spec, 3)
    fetched = out()
    assert fetched["rank"] == [0.0, 1.0, 2.0, 3.0] and fetched["n"] == [16, 16, 16, 16]
    routed = consumer.c_slice_dp(out)()
    passed = consumer.c_slice_dp(fetched)()
    assert routed == passed
    assert [r["args"][0]["rank"] for r in routed] == [[0.0, 1.0], [2.0, 3.0]]
    assert [r["args"][0]["n"] for r in routed] == [[16, 16], [16, 16]]


@pytest.mark.parametrize("kind", ["array", "dict", "tuple"])
def test_balance_cuts_a_routed_value_as_it_cuts_the_passed_one(gangs, kind):
    """A balanced method cuts its list arguments into chunks; anything else (an array, a dict,
    a tuple) goes whole to every chunk, routed or passed alike."""
    producer, consumer = gangs["pp2_dp2"], gangs["dp4"]
    out = {"array": producer.p_array(), "dict": producer.p_flatten(("dict", (("a", ("list",)),)), 1),
           "tuple": producer.p_flatten(("tuple", (("list",), ("list",)), False), 2)}[kind]
    items = list(range(6))
    assert consumer.c_balance(items, out)() == consumer.c_balance(items, out())()


def test_a_routed_list_is_cut_into_the_chunks_of_a_balanced_call(gangs):
    producer, consumer = gangs["dp4"], gangs["dp4"]
    out = producer.p_flatten(("list",), 5)
    passed = consumer.c_balance(list(range(len(out()))), out())()
    assert consumer.c_balance(list(range(len(out()))), out)() == passed
    assert [chunk for chunk, _ in passed][0] == [0, 1]  # each chunk saw its own part


def test_a_mean_is_the_same_whichever_process_collects_it(gangs):
    """collect='mean' of integer tensors is float32, in the driver (get) as in a consumer rank
    (routed) whose default dtype is float64."""
    producer, consumer = gangs["dp4"], gangs["dp2_tp2"]
    consumer.c_default_dtype("float64")()
    try:
        m = producer.p_mean_counts()
        assert consumer.c_describe(m)() == consumer.c_describe(m())() == ("torch.float32", [1.5, 3.0])
    finally:
        consumer.c_default_dtype("float32")()


def test_a_dict_subclass_keeps_its_type_routed_or_passed(gangs):
    from collections import OrderedDict, defaultdict

    producer, consumer = gangs["dp4"], gangs["dp2_tp2"]
    out = producer.p_flatten(("list",), 7)
    for make_dict in (OrderedDict, lambda **kw: defaultdict(list, **kw)):
        routed = consumer.c_slice_dp(make_dict(x=out, t=0.5))()
        passed = consumer.c_slice_dp(make_dict(x=out(), t=0.5))()
        assert [type(r["args"][0]) for r in routed] == [type(r["args"][0]) for r in passed]
        assert all(same(a, b) for a, b in zip(routed, passed, strict=True))


def test_an_error_on_a_rank_the_collect_does_not_read_is_raised(gangs):
    """collect='last_pp' reads the last stage; an error raised on an earlier stage is raised
    by get() and by the consumer of the routed result, never dropped."""
    producer, consumer = gangs["pp2_dp2"], gangs["dp4"]
    with pytest.raises(KeyError, match="stage 0 failed"):
        producer.p_first_stage_raises().get(timeout=60)
    with pytest.raises(KeyError, match="stage 0 failed") as info:
        consumer.c_all(producer.p_first_stage_raises()).get(timeout=60)
    notes = "\n".join(info.value.__notes__)  # the producer named, not only the consumer
    assert "Node.p_first_stage_raises() on rank 0 of group 'four'" in notes, notes


@pytest.mark.parametrize("n", [100, 20_000])  # 400 B and 80 KB per producer rank
def test_a_routed_array_is_writeable_exactly_when_a_passed_one_is(gangs, n):
    """A passed array under 64 KB travels in the task's bytes (writable); a larger one is put
    (read-only, zero-copy). A routed one follows the same rule, whatever the layout."""
    producer = gangs["dp4"]
    out = producer.p_floats(n)
    for consumer in ("dp4", "dp2_tp2"):  # one output per rank, or two joined
        c = gangs[consumer]
        assert c.c_writeable(out)() == c.c_writeable(out())(), (consumer, n)
