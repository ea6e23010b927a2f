"""A large gang's lazy call replies with one ref, not one per rank (docs/decisions/packed-replies.md: flat in the size).

Past ``PACK_REFS_OVER`` refs (outputs plus length records), the dispatcher packs a lazy call's
refs into one object it owns (``Reply.packed``); every reader unpacks it: the caller's
``get()``, another gang's router (a producer's plan it does not have at hand) and a consumer
worker fetching an aligned producer's plan for uneven lengths. Each must see exactly the values
a small gang's plain reply gives.
"""

from __future__ import annotations

import pickle
import time
import warnings

import pytest
import ray

from conftest import NAMESPACE
from twinkle_ray import DeviceGroup, DeviceMesh, get_rank, remote_class, remote_function
from twinkle_ray.runtime.errors import WorkerDiedError
from twinkle_ray.runtime.reply import PACK_REFS_OVER

N = 9  # 9 outputs + 9 length records: over PACK_REFS_OVER

pytestmark = pytest.mark.slow  # a 9-worker gang


@remote_class(distributed=False)
class Rows:
    def __init__(self, device_mesh: DeviceMesh | None = None):
        pass

    @remote_function(dispatch="all", collect="flatten")
    def rows(self, uneven: bool = False):
        r = get_rank()
        return [10 * r + j for j in range(1 + (r % 2 if uneven else 0))]

    @remote_function(dispatch="slice_dp", collect="none")
    def seen(self, batch):
        return list(batch)

    @remote_function(dispatch="all", collect="flatten")
    def tile(self, n: int):
        return [10 * get_rank() + j for j in range(n)]

    @remote_function(dispatch="balance", collect="flatten", chunk_size=2)
    def square(self, xs):
        return [x * x for x in xs]


@pytest.fixture(scope="module")
def gangs(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("big", N, "cpu", cpus_per_worker=0.5),
                                   DeviceGroup("small", 2, "cpu", cpus_per_worker=0.5),
                                   DeviceGroup("lone", 2, "cpu", cpus_per_worker=0.5)])
    big = Rows(device_mesh=DeviceMesh.from_sizes(dp_size=N), remote_group="big")
    small = Rows(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="small")
    lone = Rows(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="lone")
    yield big, small, lone
    twinkle_ray.shutdown()


def _expected(uneven: bool) -> list[int]:
    return [10 * r + j for r in range(N) for j in range(1 + (r % 2 if uneven else 0))]


def test_large_reply_is_one_ref_and_get_sees_every_rank(gangs):
    big, _, _ = gangs
    out = big.rows()
    reply = ray.get(out.reply_ref)
    assert 2 * N > PACK_REFS_OVER
    assert reply.refs == [] and reply.records == [] and reply.bundle is not None
    assert out.get() == _expected(False)
    assert len(out.refs) == N and out.ranks == list(range(N))


def test_packed_producer_routes_into_another_gang(gangs):
    big, small, _ = gangs
    for uneven in (False, True):
        want = _expected(uneven)
        got = small.seen(big.rows(uneven)).get()
        half = (len(want) + 1) // 2
        assert got == [want[:half], want[half:]]


def test_packed_aligned_producer_with_uneven_lengths_routes_into_its_own_gang(gangs):
    big, _, _ = gangs
    want = _expected(True)  # 13 items over 9 data ranks: windows cross the outputs
    got = big.seen(big.rows(True)).get()
    assert [x for part in got for x in part] == want
    assert [len(part) for part in got] == [2, 2, 2, 2, 1, 1, 1, 1, 1]


def test_balanced_positions_records_travel_packed(gangs):
    big, small, _ = gangs
    out = big.square(list(range(23)))
    assert ray.get(out.reply_ref).bundle is not None
    assert out.get() == [x * x for x in range(23)]  # in input order, from the packed records
    got = small.seen(big.square(list(range(23)))).get()
    assert got[0] + got[1] == [x * x for x in range(23)]


def test_a_collected_result_passed_on_does_not_carry_its_refs(gangs):
    big, small, _ = gangs
    out = big.rows()
    assert out.get() == _expected(False)  # the caller unpacked its refs...
    copy = pickle.loads(pickle.dumps(out))
    assert copy.route_facts().reply is None  # ...and a copy sent on reads the reply ref instead
    assert small.seen(out).get() == [_expected(False)[:5], _expected(False)[5:]]


def _kill_dispatcher(proxy) -> None:
    dispatcher = ray.get_actor(proxy.label, namespace=NAMESPACE)
    ray.kill(dispatcher, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):  # dead before anything reads its objects
        for _ in range(100):
            ray.get(dispatcher.death.remote(0), timeout=10)
            time.sleep(0.1)


def test_a_call_that_lost_inputs_of_a_dead_producer_dispatcher_names_that_producer(gangs):
    """A small producer's reply carries its refs: the consumer's tasks are sent, and fail on
    length records whose owner (the producer's dispatcher) is gone. That is the producer's
    death, not one of the consumer's ranks (it was named 'rank 0 of big' before). Ray may
    still serve a dead owner's small objects for a while (as below): each try then gets the
    values, so the call's own error, 6 items for 9 data-parallel ranks, until the death."""
    big, _, lone = gangs
    out = lone.tile(3)
    ray.get(out.reply_ref)
    _kill_dispatcher(lone)
    deadline, died = time.monotonic() + 30, None
    while died is None and time.monotonic() < deadline:
        try:
            big.seen(out).get()
        except WorkerDiedError as e:
            died = e
        except ValueError as e:  # the values were still served: the consumer's own error
            assert "batch of 6 items (from Rows.tile) is smaller" in str(e), e
            time.sleep(1.0)
        else:
            raise AssertionError("6 items were routed to 9 data-parallel ranks")
    if died is None:
        warnings.warn("Ray still served the dead producer dispatcher's objects after 30 s: "
                      "only the values were checked, not the death", stacklevel=1)
    else:
        assert died.kind == "dispatcher" and died.group == "lone", died


def test_a_dead_producer_dispatcher_is_named_by_get_and_by_a_consumer(gangs):
    """Last in the module: it kills the big gang's dispatcher (the fixture tears it down).

    Ray may still serve objects of a dead owner that sit in this node's store for a moment, so
    each read gives either the right values or the dispatcher's death, named: never another
    gang's rank, never Ray's raw OwnerDiedError."""
    big, small, _ = gangs
    first, second = big.rows(), big.rows()
    ray.get([first.reply_ref, second.reply_ref])  # the replies are here; the bundles stay there
    _kill_dispatcher(big)

    def outcome(read):
        try:
            return read()
        except WorkerDiedError as e:
            assert e.kind == "dispatcher" and e.group == "big", e
            return "died"

    assert outcome(first.get) in (_expected(False), "died")
    assert outcome(lambda: small.seen(second).get()) in (
        [_expected(False)[:5], _expected(False)[5:]], "died")
