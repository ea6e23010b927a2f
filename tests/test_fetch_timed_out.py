"""Ray's ObjectFetchTimedOutError is not read as a worker's death.

Ray raises it when no copy of an object was found within ``fetch_fail_timeout_milliseconds``; no
worker is known dead. A caller's ``get()`` (``lazy.fetch``) and a consumer worker's fetch of a
producer's output (``routed.pull``) raise it as itself, with a note naming the gang, the rank and
the method; they used to turn it into a WorkerDiedError that named a live rank as dead. Ray
cannot be made to time a fetch out on one machine, so ``ray.get`` raises it for one ref here.
"""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import ObjectFetchTimedOutError

from twinkle_ray.runtime.lazy import GangRef, fetch
from twinkle_ray.runtime.routed import pull


@pytest.fixture
def one_ref_times_out(ray_session, monkeypatch):
    refs = [ray.put([k]) for k in range(3)]
    bad = refs[1]
    real_get = ray.get

    def get(obj, *args, **kwargs):
        if obj == bad or (isinstance(obj, list) and bad in obj):
            raise ObjectFetchTimedOutError(bad.hex(), None, "")
        return real_get(obj, *args, **kwargs)

    monkeypatch.setattr(ray, "get", get)
    return refs


GANG = GangRef("trainer", "Model", dispatcher=None)


def test_a_callers_get_raises_it_naming_the_rank(one_ref_times_out):
    with pytest.raises(ObjectFetchTimedOutError) as info:
        fetch(one_ref_times_out, [0, 1, 2], GANG, "forward", None)
    assert ("while fetching the output of Model.forward() on rank 1 of group 'trainer': Ray found no "
            "copy of it in time (no worker death is known)") in info.value.__notes__


def test_a_consumers_fetch_raises_it_naming_the_producer(one_ref_times_out):
    with pytest.raises(ObjectFetchTimedOutError) as info:
        pull(one_ref_times_out, GANG, "forward", [4, 5, 6])
    assert any("Model.forward() on rank 5 of group 'trainer'" in n for n in info.value.__notes__)
