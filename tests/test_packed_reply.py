"""A large gang's lazy call replies with one ref, not one per rank (DESIGN 7: flat in the size).

Past ``PACK_REFS_OVER`` refs (outputs plus length records), the dispatcher packs a lazy call's
refs into one object it owns (``CallOutput.packed``); every reader unpacks it: the caller's
``get()``, another gang's router (a producer's plan it does not have at hand) and a consumer
worker fetching an aligned producer's plan for uneven lengths. Each must see exactly the values
a small gang's plain reply gives.
"""

from __future__ import annotations

import pytest
import ray

from twinkle_ray import DeviceGroup, DeviceMesh, get_rank, remote_class, remote_function
from twinkle_ray.runtime.lazy import PACK_REFS_OVER

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


@pytest.fixture(scope="module")
def gangs(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("big", N, "cpu", cpus_per_worker=0.5),
                                   DeviceGroup("small", 2, "cpu", cpus_per_worker=0.5)])
    big = Rows(device_mesh=DeviceMesh.from_sizes(dp_size=N), remote_group="big")
    small = Rows(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="small")
    yield big, small
    twinkle_ray.shutdown()


def _expected(uneven: bool) -> list[int]:
    return [10 * r + j for r in range(N) for j in range(1 + (r % 2 if uneven else 0))]


def test_large_reply_is_one_ref_and_get_sees_every_rank(gangs):
    big, _ = gangs
    out = big.rows()
    reply = ray.get(out._plan_ref)
    assert 2 * N > PACK_REFS_OVER
    assert reply.refs == [] and reply.metas == [] and reply.bundle is not None
    assert out.get() == _expected(False)
    assert len(out.refs) == N and out.ranks == list(range(N))


def test_packed_producer_routes_into_another_gang(gangs):
    big, small = gangs
    for uneven in (False, True):
        want = _expected(uneven)
        got = small.seen(big.rows(uneven)).get()
        half = (len(want) + 1) // 2
        assert got == [want[:half], want[half:]]


def test_packed_aligned_producer_with_uneven_lengths_routes_into_its_own_gang(gangs):
    big, _ = gangs
    want = _expected(True)  # 13 items over 9 data ranks: windows cross the outputs
    got = big.seen(big.rows(True)).get()
    assert [x for part in got for x in part] == want
    assert [len(part) for part in got] == [2, 2, 2, 2, 1, 1, 1, 1, 1]
