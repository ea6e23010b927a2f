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

from twinkle_ray.runtime.diagnose import GangRef, fetch
from twinkle_ray.runtime.routed import pull


def _failing_get(monkeypatch, errors: dict) -> None:
    """``ray.get`` raises ``errors[ref]`` for those refs (alone or in a list)."""
    real_get = ray.get

    def get(obj, *args, **kwargs):
        for ref in (obj if isinstance(obj, list) else [obj]):
            if ref in errors:
                raise errors[ref]
        return real_get(obj, *args, **kwargs)

    monkeypatch.setattr(ray, "get", get)


@pytest.fixture
def one_ref_times_out(ray_session, monkeypatch):
    refs = [ray.put([k]) for k in range(3)]
    _failing_get(monkeypatch, {refs[1]: ObjectFetchTimedOutError(refs[1].hex(), None, "")})
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


def test_a_death_on_a_later_rank_outranks_a_timeout(ray_session, monkeypatch):
    from ray.exceptions import RayActorError

    from twinkle_ray.runtime.errors import WorkerDiedError

    refs = [ray.put([k]) for k in range(3)]
    _failing_get(monkeypatch, {refs[1]: ObjectFetchTimedOutError(refs[1].hex(), None, ""),
                               refs[2]: RayActorError("a2", "The actor is dead because it was killed.")})
    with pytest.raises(WorkerDiedError, match="rank 2"):
        fetch(refs, [0, 1, 2], GANG, "forward", None)


def test_a_ranks_own_timeout_fetching_its_inputs_is_its_error(ray_session, monkeypatch):
    """A consumer rank whose task raised the timeout (fetching a producer's output): its error as
    the rank raised it (a task error), not a note that its own output was not found."""
    from ray.exceptions import RayTaskError

    refs = [ray.put([k]) for k in range(2)]
    cause = ObjectFetchTimedOutError("ab" * 14, None, "")
    cause.add_note("while fetching the output of Producer.rows() on rank 3 of group 'p'")
    _failing_get(monkeypatch, {refs[1]: RayTaskError("run", "traceback", cause).as_instanceof_cause()})
    with pytest.raises(ObjectFetchTimedOutError) as info:
        fetch(refs, [0, 1], GANG, "forward", None)
    notes = info.value.__notes__
    assert any("Producer.rows() on rank 3" in n for n in notes)
    assert any(n.startswith("raised in Model.forward() on rank 1 of group 'trainer'") for n in notes)
    assert not any("while fetching the output of Model.forward()" in n for n in notes)


def test_a_death_a_rank_raised_outranks_an_earlier_ranks_timeout_and_user_error(ray_session, monkeypatch):
    """A consumer rank that found its producer dead raises WorkerDiedError in its task: that death
    is what the caller gets, whatever an earlier rank failed with."""
    from ray.exceptions import RayTaskError

    from twinkle_ray.runtime.errors import WorkerDiedError

    refs = [ray.put([k]) for k in range(2)]
    died = WorkerDiedError("producer", "Producer", 3, None, "killed")
    for earlier in (ObjectFetchTimedOutError(refs[0].hex(), None, ""),
                    RayTaskError("run", "traceback", ValueError("bad row")).as_instanceof_cause()):
        _failing_get(monkeypatch, {refs[0]: earlier,
                                   refs[1]: RayTaskError("run", "traceback", died).as_instanceof_cause()})
        with pytest.raises(WorkerDiedError, match="rank 3 of Producer in group 'producer' died"):
            fetch(refs, [0, 1], GANG, "forward", None)


def _bundled_reply(n: int = 2):
    """A large gang's reply: its output refs as one bundle the dispatcher owns (``packed``)."""
    from twinkle_ray.runtime.reply import Reply

    bundle = ray.put(([ray.put(k) for k in range(n)], [None] * n))
    return ray.put(Reply(refs=[], records=[], workers=list(range(n)), bundle=bundle)), bundle


def test_a_callers_fetch_of_the_output_refs_raises_it_not_a_death(ray_session, monkeypatch):
    # The caller fetches a large gang's output refs (the bundle) when it first needs them; Ray
    # not finding a copy in time used to be read as the dispatcher's death (ObjectLostError).
    from twinkle_ray.runtime.lazy import LazyResult

    plan, bundle = _bundled_reply()
    _failing_get(monkeypatch, {bundle: ObjectFetchTimedOutError(bundle.hex(), None, "")})
    result = LazyResult(plan, collect="none", gang=GANG, method="forward")
    with pytest.raises(ObjectFetchTimedOutError) as info:
        result.reply()
    assert ("while fetching the refs of the outputs of Model.forward() on group 'trainer': Ray "
            "found no copy of it in time (no worker death is known)") in info.value.__notes__


def test_a_consumers_fetch_of_the_producers_output_refs_raises_it_not_a_death(ray_session, monkeypatch):
    from twinkle_ray.runtime.routed import RouteIn, Slots

    plan, bundle = _bundled_reply()
    _failing_get(monkeypatch, {bundle: ObjectFetchTimedOutError(bundle.hex(), None, "")})
    # a consumer rank whose part needs output 1, not among its task's arguments: it reads the
    # producer's reply for that output's ref
    route = RouteIn("none", [0, 1], reply_ref=plan, producer=GANG, method="forward")
    with pytest.raises(ObjectFetchTimedOutError) as info:
        Slots((route,), None, "consume", "g").value(0)
    assert any("the refs of the outputs of Model.forward()" in n for n in info.value.__notes__)


def test_a_consumers_fetch_names_a_producer_death_over_an_earlier_ranks_error(ray_session, monkeypatch):
    # As for a caller's get: a dead producer worker explains its peers' errors. pull used to
    # raise the first failing rank's error in rank order.
    from ray.exceptions import RayActorError, RayTaskError

    from twinkle_ray.runtime.errors import WorkerDiedError

    refs = [ray.put([k]) for k in range(2)]
    _failing_get(monkeypatch, {
        refs[0]: RayTaskError("run", "traceback", RuntimeError("gloo: peer closed")).as_instanceof_cause(),
        refs[1]: RayActorError("a2", "The actor is dead because it was killed."),
    })
    with pytest.raises(WorkerDiedError, match="rank 5") as info:
        pull(refs, GANG, "forward", [4, 5])
    assert "while fetching an output of Model.forward() on group 'trainer' as an input" in info.value.__notes__
