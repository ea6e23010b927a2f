"""The routing invariant, tested from the outside on a seeded table of cases (docs/routing.md).

A LazyResult passed to another gang's method is routed, not fetched. Whatever the result's
shape, the collect mode and the producer / consumer layouts, each consumer worker must receive
exactly what *fetching* the result (``result()``) and passing that value would give
(``dispatch`` of the consumer's mode: its data rank's part under ``'slice_dp'``, a list cut by
worker index under ``'slice'``, the whole value under ``'all'``). A tuple value (a method with
several return values, collected element-wise) is passed element by element, each element as
an argument in its place. Where cutting is impossible (fewer items than consumer parts, lists
of different lengths under ``'slice'``), the routed call raises the same kind of error that
dispatching the fetched value raises. (Generated cases: test_routing_rule.py, pure, and
test_routing_gangs.py, through real gangs.)

The cases come from a seeded table: every (shape, collect mode) pair at least once, with
producer and consumer layouts (dp, dp x tp, dp x pp, gpus_per_worker=2, execute='first') and
consumer dispatch modes drawn by a seeded generator. Four gangs, made once for the module,
serve every case.
"""

from __future__ import annotations

import random
import sys
from collections import namedtuple

import numpy as np
import pytest

from conftest import leftovers
from twinkle_ray import DeviceGroup, DeviceMesh, get_rank, remote_class, remote_function

# four gangs made once for the module: the quick tier leaves them out
pytestmark = pytest.mark.slow

Pair = namedtuple("Pair", "tokens logprobs")

# --------------------------------------------------------------------------- result shapes


def shape_value(shape: str, r: int):
    """What producer gang rank ``r`` returns for ``shape`` (distinct values per rank)."""
    base = 100 * r
    if shape == "list":
        return [base + j for j in range(4)]
    if shape == "uneven":
        return [base + j for j in range(2 + 2 * (r % 2))]  # 2, 4, 2, 4 items
    if shape == "tuple":  # (tokens, logprobs) of different lengths
        return ([base + j for j in range(4)], [base + 50 + j for j in range(2 + (r % 2))])
    if shape == "namedtuple":
        return Pair([base + j for j in range(3)], [float(base + j) for j in range(3)])
    if shape == "dict":
        return {"ids": [base + j for j in range(4)], "mask": [j % 2 for j in range(4)], "step": 7}
    if shape == "ndarray":
        return np.arange(6, dtype=np.int64).reshape(3, 2) + base
    if shape == "tensor":
        import torch  # in the workers only for this shape: they start faster without it

        return torch.arange(4, dtype=torch.float32) + base
    if shape == "nested":  # tuple of (list, dict)
        return ([base + j for j in range(2 + (r % 2))], {"x": [base, base + 1, base + 2], "t": 1})
    if shape == "scalar_pair":  # a batch and a per-rank number
        return ([base, base + 1, base + 2], r * 0.5)
    if shape == "empty":
        return []
    raise AssertionError(shape)


SHAPES = ("list", "uneven", "tuple", "namedtuple", "dict", "ndarray", "tensor", "nested",
          "scalar_pair", "empty")


def _reverse(results, mesh):
    return results[::-1]


@remote_class(distributed=False)
class Node:
    def __init__(self, device_mesh: DeviceMesh | None = None):
        self.mesh = device_mesh

    # producers: one method per collect mode (dispatch='all'; the rank picks the values)
    @remote_function(dispatch="all", collect="none")
    def p_none(self, shape):
        return shape_value(shape, get_rank())

    @remote_function(dispatch="all", collect="flatten")
    def p_flatten(self, shape):
        return shape_value(shape, get_rank())

    @remote_function(dispatch="all", collect="first")
    def p_first(self, shape):
        return shape_value(shape, get_rank())

    @remote_function(dispatch="all", collect="mean")
    def p_mean(self, shape):
        return shape_value(shape, get_rank())

    @remote_function(dispatch="all", collect="sum")
    def p_sum(self, shape):
        return shape_value(shape, get_rank())

    @remote_function(dispatch="all", collect="last_pp")
    def p_last_pp(self, shape):
        return shape_value(shape, get_rank())

    @remote_function(dispatch="all", collect=_reverse)
    def p_custom(self, shape):
        return shape_value(shape, get_rank())

    @remote_function(dispatch="all", execute="first", collect="none")
    def p_first_worker(self, shape):
        return shape_value(shape, get_rank())

    @remote_function(dispatch="all", execute="first", collect="flatten")
    def p_first_worker_flat(self, shape):
        return shape_value(shape, get_rank())

    @remote_function(dispatch="all", collect="flatten")
    def p_pair(self):
        return get_rank() * 10, get_rank() * 10 + 1

    @remote_function(dispatch="all", collect="none")
    def p_pair_none(self):
        return get_rank() * 10, get_rank() * 10 + 1

    @remote_function(dispatch="all", collect="flatten")
    def p_uneven_dict(self):
        """A dict whose keys have different lengths (per-sample tokens, per-prompt prompts)."""
        r = get_rank()
        return {"tok": [10 * r + j for j in range(4)], "prompt": [f"p{r}"], "temp": 0.7}

    @remote_function(dispatch="all", collect="flatten")
    def p_sample(self):
        """A sampler's (tokens, logprobs): two rows per rank."""
        r = get_rank()
        return [[r, 2 * r], [r, 2 * r + 1]], [-0.5 * r, -0.25 * r]

    @remote_function(dispatch="balance", collect="flatten", chunk_size=3)
    def p_balance(self, shape, items):
        """A balanced producer (issue 26): chunks of ``items`` on whichever data group is free."""
        vals = [100 * get_rank() + x for x in items]
        return (vals, [-x for x in vals]) if shape == "tuple" else vals

    # consumers: what each worker received, wrapped in a list (so collect='none' keeps it whole)
    @remote_function(dispatch="slice_dp", collect="none")
    def c_slice_dp(self, x):
        return [x]

    @remote_function(dispatch="slice", collect="none")
    def c_slice(self, x):
        return [x]

    @remote_function(dispatch="all", collect="none")
    def c_all(self, x):
        return [x]

    @remote_function(dispatch="slice_dp", execute="first", collect="none")
    def c_first_worker(self, x):
        return [x]

    @remote_function(dispatch="all", collect="none")
    def mesh_view(self, n):
        """(gang rank, the mesh's data rank, its slice of n items, its pp rank) in this worker."""
        s = self.mesh.get_slice(n)
        return [(get_rank(), self.mesh.data_rank, s.start, s.stop, self.mesh.pp_rank)]


MODES = {"none": "p_none", "flatten": "p_flatten", "first": "p_first", "mean": "p_mean",
         "sum": "p_sum", "last_pp": "p_last_pp", "custom": "p_custom"}
FIRST_MODES = {"none": "p_first_worker", "flatten": "p_first_worker_flat"}
# name -> (group, mesh sizes, gpus per worker)
LAYOUTS = {
    "dp": ("four", dict(dp_size=4), 1),
    "dp_tp": ("four", dict(dp_size=2, tp_size=2), 1),
    "dp_pp": ("four", dict(pp_size=2, dp_size=2), 1),
    "gpw2": ("pairs", dict(dp_size=2, tp_size=2), 2),  # a vLLM TP=2 sampler's mesh
    "gpw2_pp": ("pairs", dict(pp_size=2, tp_size=2), 2),
}
CONSUMERS = ("c_slice_dp", "c_slice", "c_all", "c_first_worker")


@pytest.fixture(scope="module")
def gangs(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("four", 4, "cuda"),
                                   DeviceGroup("pairs", 4, "cuda", gpus_per_worker=2)])
    made = {}
    for name, (group, sizes, gpw) in LAYOUTS.items():
        mesh = DeviceMesh.from_sizes(**sizes)
        made[name] = (Node(device_mesh=mesh, remote_group=group), mesh, gpw)
    yield made
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


# --------------------------------------------------------------------------- the reference


def _is_tensor(v) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def passed(value, consumer: str, n: int, mesh: DeviceMesh, gpw: int) -> list:
    """What each consumer worker that runs the call receives when ``value`` is passed to it."""
    from twinkle_ray.core.dispatch import dispatch

    if consumer in ("c_all", "c_first_worker"):  # execute='first': the value whole, as plain ones
        return [value] * (1 if consumer == "c_first_worker" else n)
    mode = "slice" if consumer == "c_slice" else "slice_dp"
    per = dispatch(mode, n, (value,), {}, device_mesh=mesh, gpus_per_worker=gpw)
    return [args[0] for args, _ in per]


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if _is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# --------------------------------------------------------------------------- the table


def case_table(seed: int = 27) -> list[tuple]:
    """(producer layout, producer method, shape, consumer layout, consumer method) rows."""
    rng = random.Random(seed)
    layouts, rows = list(LAYOUTS), []
    for shape in SHAPES:
        for method in MODES.values():
            rows.append((rng.choice(layouts), method, shape, rng.choice(layouts), rng.choice(CONSUMERS)))
        for method in FIRST_MODES.values():  # execute='first' producers
            rows.append((rng.choice(layouts), method, shape, rng.choice(layouts), rng.choice(CONSUMERS)))
    # every producer layout into every consumer layout and dispatch, for the tuple shape
    for p in layouts:
        for c in layouts:
            for consumer in CONSUMERS[:3]:
                rows.append((p, rng.choice(["p_none", "p_flatten"]), rng.choice(["tuple", "uneven"]),
                             c, consumer))
    for shape in ("list", "tuple"):  # dispatch='balance' producers (10 items, chunks of 3)
        for p in layouts:
            rows.append((p, "p_balance", shape, rng.choice(layouts), rng.choice(CONSUMERS)))
    return rows


CASES = case_table()


def fetched_or_error(lazy):
    try:
        return lazy(), None
    except Exception as e:  # noqa: BLE001 -- compared with the routed outcome
        return None, e


def test_routed_equals_fetched_then_sliced(gangs):
    ran, failures = 0, []
    for producer_layout, method, shape, consumer_layout, consumer in CASES:
        producer = gangs[producer_layout][0]
        node, mesh, gpw = gangs[consumer_layout]
        n = mesh.world_size // gpw
        lazy = getattr(producer, method)(*((shape, list(range(10))) if method == "p_balance" else (shape,)))
        value, fetch_error = fetched_or_error(lazy)
        label = f"{producer_layout}.{method}({shape}) -> {consumer_layout}.{consumer}"
        ran += 1
        if method == "p_balance" and fetch_error is not None:  # 10 items: always fetchable
            failures.append(f"{label}: fetching raised {fetch_error!r}")
            continue
        expected, expected_error = [], None
        if fetch_error is None:
            try:
                expected = passed(value, consumer, n, mesh, gpw)
            except ValueError as e:
                expected_error = e
        else:
            expected_error = fetch_error
        try:
            got = getattr(node, consumer)(lazy)()
        except Exception as e:  # noqa: BLE001
            if expected_error is None:
                failures.append(f"{label}: raised {type(e).__name__}: {str(e)[:200]}")
            elif not isinstance(e, type(expected_error)):
                failures.append(f"{label}: raised {type(e).__name__}, fetched path "
                                f"{type(expected_error).__name__}")
            continue
        if expected_error is not None:
            failures.append(f"{label}: no error, but fetching/slicing raised {expected_error!r}")
            continue
        got = [got] if consumer == "c_first_worker" else got  # one worker: unwrapped
        got = [g[0] for g in got]
        if len(got) != len(expected) or not all(same(g, e) for g, e in zip(got, expected, strict=True)):
            failures.append(f"{label}: routed {got!r} != fetched-then-sliced {expected!r}")
    print(f"routing invariant: {ran} cases")
    assert ran == len(CASES) > 100, ran
    assert not failures, f"{len(failures)} of {ran} cases differ:\n" + "\n".join(failures[:25])


def test_tuple_results_route_as_the_fetched_tuple_passed(gangs):
    """Routed tuple results equal the fetched tuple, passed: joined element-wise by collect,
    then cut as a tuple (along its own length) by slice_dp."""
    dp, _, _ = gangs["dp"]  # 4 ranks, dp=4
    pairs, _, _ = gangs["gpw2"]  # 2 workers, dp=2
    assert dp.p_pair()() == ([0, 10, 20, 30], [1, 11, 21, 31])
    assert pairs.c_all(dp.p_pair())() == [[([0, 10, 20, 30], [1, 11, 21, 31])]] * 2
    assert pairs.c_all(dp.p_pair_none())() == [[([0, 10, 20, 30], [1, 11, 21, 31])]] * 2
    fetched = dp.p_sample()()  # (tokens, logprobs)
    assert pairs.c_slice_dp(dp.p_sample())() == pairs.c_slice_dp(fetched)()
    assert pairs.c_slice_dp(dp.p_sample())() == [[(fetched[0],)], [(fetched[1],)]]


def test_dict_with_keys_of_different_lengths_routes_key_by_key(gangs):
    """A dict whose values differ in length is sliced key by key, as slice_dp splits the
    fetched value, never handed whole to every data rank."""
    dp, _, _ = gangs["dp"]  # 4 ranks
    pairs, mesh, gpw = gangs["gpw2"]  # 2 workers, dp=2
    fetched = dp.p_uneven_dict()()
    assert fetched == {"tok": [10 * r + j for r in range(4) for j in range(4)],
                       "prompt": ["p0", "p1", "p2", "p3"], "temp": [0.7] * 4}
    got = pairs.c_slice_dp(dp.p_uneven_dict())()
    assert got == [[{"tok": fetched["tok"][:8], "prompt": ["p0", "p1"], "temp": [0.7] * 2}],
                   [{"tok": fetched["tok"][8:], "prompt": ["p2", "p3"], "temp": [0.7] * 2}]]
    plain = pairs.c_slice_dp(fetched)()  # the same value passed plainly: split the same way
    assert got == plain
    assert pairs.c_first_worker(dp.p_uneven_dict())() == [fetched] == pairs.c_first_worker(fetched)()


def test_mesh_in_gang_worker_agrees_with_routing(gangs):
    """Item 2: a worker's own mesh (data_rank, get_slice) is the slice the dispatcher sent it."""
    for name in ("gpw2", "gpw2_pp", "dp_pp", "dp_tp"):
        node, mesh, gpw = gangs[name]
        n = mesh.world_size // gpw
        sent = node.c_slice_dp(list(range(8)))()
        views = node.mesh_view(8)()
        for w, (got, view) in enumerate(zip(sent, views, strict=True)):
            rank, data_rank, start, stop, pp_rank = view[0]
            assert rank == w  # twinkle_ray.get_rank(): the gang rank
            assert data_rank == mesh.get_data_rank_from_global_rank(w * gpw), (name, w, view)
            assert pp_rank == (mesh.get_local_rank("pp", rank=w * gpw) if mesh.has_dim("pp") else None)
            assert got[0] == list(range(start, stop)), (name, w, got, view)
        assert len(sent) == n
