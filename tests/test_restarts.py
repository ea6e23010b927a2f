"""Restarts: how a gang is rebuilt after a failure, and what bounds it.

- death classification (Ray's structured fields only), one restart policy, rebuild failures
  that say why, restart metrics;
- the dispatcher killed: rebuilt under its name with the saved state (``max_restarts``), or a
  clear error; outputs lost with their dispatcher named so;
- one restart budget per gang, kept across dispatcher respawns;
- ``abort()`` during ``restart()`` never starts a second build; one build at a time;
- a rebuild re-probes its placement (a bundle moved to another node);
- gang health: no stuck check where no rank can be stuck, a rebuild bounded by
  ``start_timeout_s``, a rebuilding Serve replica not healthy, proxy copies that find a
  respawned dispatcher.

Worker shared classes: ``workers.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from test_metrics import _metrics_url, _wait_for
from workers import Valued

from conftest import NAMESPACE, live_actors
from twinkle_ray import DeviceGroup, WorkerDiedError, get_rank, remote_class, remote_function
from twinkle_ray.runtime.errors import (
    DIED,
    NODE_LOST,
    OUTAGE,
    PREEMPTED,
    GangRebuildError,
    classify_death,
)
from twinkle_ray.runtime.health import DeathRecord
from twinkle_ray.runtime.rebuild import Rebuilder
from twinkle_ray.runtime.restarts import RestartPolicy
from twinkle_ray.serve import replica_bundles

LIMIT_S = 30.0
TABLE = {"aa01": (0, "node-a", "10.0.0.1"), "bb02": (1, "node-b", "10.0.0.2")}


# ---------------------------------------------------------------------------- the classifier
def test_classifier_tells_death_preemption_node_loss_and_outage_apart():
    died = classify_death(RayActorError("aa01", "The actor is dead because it was killed"), TABLE,
                          alive_nodes={"node-a", "node-b"})
    assert (died.kind, died.rank, died.node_id) == (DIED, 0, "node-a")
    lost = classify_death(RayActorError("bb02", "whatever the text says"), TABLE,
                          alive_nodes={"node-a"})
    assert (lost.kind, lost.rank, lost.node_ip) == (NODE_LOST, 1, "10.0.0.2")
    pre = classify_death(RayActorError("bb02", "x", preempted=True), TABLE, alive_nodes={"node-a"})
    assert pre.kind == PREEMPTED and "pre-empted" in pre.cause
    out = classify_death(ActorUnavailableError("Socket closed", bytes.fromhex("bb02" * 8)),
                         {"bb02" * 8: (1, "node-b", "10.0.0.2")})
    assert out.kind == OUTAGE and out.rank == 1  # an outage is not a death


def test_classifier_ignores_actors_that_are_not_ours_and_never_reads_names():
    # The text names a worker of ours; the actor id does not: not ours.
    text = "The actor died...\n\tname: team/a/Model/1\n\tnamespace: x"
    assert classify_death(RayActorError("ffff", text), TABLE) is None
    assert classify_death(ActorDiedError(), TABLE) is None  # no actor id at all
    assert classify_death(ValueError("aa01"), TABLE) is None


def test_restart_policy_is_bounded_within_its_window():
    p = RestartPolicy(max_restarts=1, window_s=5.0)
    assert [p.allow(t) for t in (0.0, 1.0, 6.0, 6.5)] == [True, False, True, False]
    assert RestartPolicy(2).describe() == "max_restarts=2"
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        RestartPolicy(-1)


def test_rebuild_error_keeps_the_death_and_says_why():
    death = WorkerDiedError("team/a", "Model", 1, "10.0.0.2", "its node left", "ab" * 28, NODE_LOST)
    e = GangRebuildError(death, "PlacementError: missing {CPU: 2}")
    assert isinstance(e, WorkerDiedError) and (e.group, e.rank, e.kind) == ("team/a", 1, NODE_LOST)
    assert "automatic rebuild failed: PlacementError: missing {CPU: 2}" in str(e)
    assert "worker rank 1 of Model in group 'team/a' died (node 10.0.0.2, id abababab, node lost)" in str(e)
    import pickle

    again = pickle.loads(pickle.dumps(e))
    assert str(again) == str(e) and again.death.node_id == "ab" * 28


# ---------------------------------------------------------------------------- gangs
@remote_class()
class Plain:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    @remote_function(dispatch="all", collect="none")
    def echo(self, x=None):
        return x


@remote_class(max_restarts=1, distributed=False)  # no torch: each (re)build starts sooner
class FailsOnRebuild:
    """Starts once; a rebuild's constructor raises when the marker file exists."""

    def __init__(self, marker: str):
        if os.path.exists(marker) and get_rank() == 1:
            raise RuntimeError("cannot load weights on rank 1")

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


@remote_class(max_restarts=1, distributed=False)
class OneRestart:
    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


def _kill_and_expect(g, rank: int) -> WorkerDiedError:
    pids = g.pid()()
    t0 = time.monotonic()
    os.kill(pids[rank], signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as info:
        deadline = t0 + LIMIT_S
        while time.monotonic() < deadline:  # the next call raises once the death is seen
            g.pid()()
            time.sleep(0.1)
    assert time.monotonic() - t0 < LIMIT_S
    return info.value


@pytest.mark.slow
def test_a_slash_in_the_group_name_is_named_right(runtime):
    runtime.initialize(groups=[DeviceGroup("team/a", 2, "cpu")])
    g = Plain(remote_group="team/a")
    err = _kill_and_expect(g, 1)
    assert (err.group, err.cls, err.rank, err.kind) == ("team/a", "Plain", 1, DIED)
    assert err.node_id and "worker rank 1 of Plain in group 'team/a' died" in str(err)
    g.restart()
    assert len(g.pid()()) == 2


@pytest.mark.slow
def test_failed_automatic_rebuild_says_why(runtime, tmp_path):
    marker = str(tmp_path / "broken")
    runtime.initialize(groups=[DeviceGroup("rb", 2, "cpu")])
    g = FailsOnRebuild(marker, remote_group="rb")
    open(marker, "w").close()  # the rebuild's constructor will raise on rank 1
    t0 = time.monotonic()
    _kill_and_expect(g, 0)
    deadline = t0 + 120
    while True:  # the rebuild runs; once it failed, calls say why
        try:
            g.pid()()
        except GangRebuildError as e:
            err = e
            break
        except WorkerDiedError:
            assert time.monotonic() < deadline
            time.sleep(0.3)
    assert "its automatic rebuild failed" in str(err) and "cannot load weights on rank 1" in str(err)
    assert "worker rank 0 of FailsOnRebuild in group 'rb' died" in str(err)  # and the death
    desc = g.topology()
    assert "cannot load weights" in desc["rebuild_error"] and not desc["rebuilding"]
    with pytest.raises(GangRebuildError):
        g.check_health()
    os.remove(marker)
    g.restart()  # a manual restart once the cause is fixed
    assert len(g.pid()()) == 2


@pytest.mark.slow
def test_restart_budget_is_bounded_logged_and_counted(runtime):
    runtime.initialize(groups=[DeviceGroup("bud", 2, "cpu")])
    g = OneRestart(remote_group="bud")
    label = g.topology()["label"]
    _kill_and_expect(g, 1)
    deadline = time.monotonic() + 120
    while True:  # rebuilt automatically (the one restart the policy allows)
        try:
            old = g.pid()()
            break
        except WorkerDiedError:
            assert time.monotonic() < deadline
            time.sleep(0.3)
    assert g.topology()["restarts"] == 1
    err = _kill_and_expect(g, 0)
    deadline = time.monotonic() + 30
    while not isinstance(err, GangRebuildError) and time.monotonic() < deadline:
        try:
            g.pid()()
        except WorkerDiedError as e:
            err = e
        time.sleep(0.2)
    assert isinstance(err, GangRebuildError), err
    assert "restart budget is spent (1 automatic rebuild(s); max_restarts=1)" in str(err)
    assert g.topology()["restarts"] == 1 and old
    got = _wait_for(_metrics_url(), {"ray_twinkle_gang_restarts_total": 1,
                                     "ray_twinkle_gang_restarts_refused_total": 1}, gang=label)
    assert got["ray_twinkle_gang_restarts_total"] == 1, got
    assert got["ray_twinkle_gang_restarts_refused_total"] == 1, got


# ---------------------------------------------------------------------------- turns
class Unloadable:
    """Pickles fine here; unpickling it (in a rank: the dispatcher never unpickles arguments)
    raises."""

    def __getstate__(self):
        return {"x": 1}

    def __setstate__(self, state):
        raise ValueError("Unloadable cannot be restored")


@pytest.mark.slow
def test_an_argument_the_ranks_cannot_unpickle_is_named_and_never_stalls_the_next(runtime):
    runtime.initialize(groups=[DeviceGroup("up", 2, "cpu")])
    g = Plain(remote_group="up")
    assert len(g.pid()()) == 2
    bad = g.echo(x=Unloadable())  # pickled here; unpickling it in the ranks raises
    nxt = g.pid()  # made before anyone looked at the bad call
    assert len(nxt.get(timeout=30)) == 2
    with pytest.raises(TypeError, match=r"Plain.echo\(\) on rank \d of group 'up': argument 'x' "
                                        r"cannot be unpickled in this Ray worker \(ValueError: "
                                        r"Unloadable cannot be restored\): the call did not run"):
        bad.get()
    assert len(g.pid().get(timeout=30)) == 2  # and the calls after it


# ---------------------------------------------------------------------------- the dispatcher
@remote_class(max_restarts=1)
class Respawned(Valued):
    pass


@remote_class()
class Mortal(Valued):
    pass


def _kill_dispatcher_mid_call(g) -> WorkerDiedError:

    from conftest import NAMESPACE

    pending = g.sleep(30)
    time.sleep(0.5)
    label = g.topology()["label"]
    ray.kill(ray.get_actor(label, namespace=NAMESPACE), no_restart=True)
    with pytest.raises(WorkerDiedError) as info:
        pending.get(timeout=LIMIT_S)
    return info.value


@pytest.mark.slow
def test_killed_dispatcher_is_rebuilt_under_its_name_with_the_saved_state(runtime, tmp_path):
    runtime.initialize(groups=[DeviceGroup("dk", 2, "cpu")])
    g = Respawned(remote_group="dk")
    label = g.topology()["label"]
    g.set_value(5)()
    g.save_state(path=str(tmp_path))
    g.set_value(6)()  # lost with the gang
    t0 = time.monotonic()
    err = _kill_dispatcher_mid_call(g)
    to_error = time.monotonic() - t0
    assert err.kind == "dispatcher" and err.rank is None
    assert str(err).startswith("the dispatcher of Respawned in group 'dk' died (node ")
    g.save_state(path=str(tmp_path))  # the next call (a save too): a new dispatcher and gang,
    assert g.get_value()() == [50, 51]  # the saved state restored, then saved again
    print(f"\ndispatcher killed: error after {to_error:.1f}s (0.5 s of it before the kill); "
          f"next call answered {time.monotonic() - t0:.1f}s after the call began")
    assert g.topology()["label"] == label
    err = _kill_dispatcher_mid_call(g)  # max_restarts=1: the second death is final
    with pytest.raises(WorkerDiedError, match="its dispatcher died and is not rebuilt"):
        g.get_value()()


@pytest.mark.slow
def test_killed_dispatcher_without_max_restarts_keeps_a_clear_error(runtime):
    runtime.initialize(groups=[DeviceGroup("dm", 2, "cpu")])
    g = Mortal(remote_group="dm")
    err = _kill_dispatcher_mid_call(g)
    assert err.kind == "dispatcher" and "the dispatcher of Mortal in group 'dm' died" in str(err)
    with pytest.raises(WorkerDiedError, match="dispatcher of Mortal in group 'dm' died"):
        g.get_value()()


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_a_call_made_while_another_thread_replaces_the_dispatcher_goes_to_the_new_one(runtime,
                                                                                     monkeypatch):
    """A proxy shared by threads: one thread's call is being prepared (split, put) when another
    thread replaces the gang's dead dispatcher. The call goes to the new dispatcher, numbered
    in the new turn, not to the dead one (before: a spurious 'dispatcher died' for a call made
    after the recovery), and a LazyResult of the old dispatcher in its arguments keeps its gang
    (it is not the new dispatcher's own output)."""

    from twinkle_ray.runtime import proxy as proxy_module

    @ray.remote(num_cpus=0)
    class NewDispatcher:
        """Stands in for the dispatcher the other thread's respawn made: notes each call."""

        def __init__(self):
            self.calls = []

        @ray.method(num_returns=2)
        def call(self, call):
            [route] = call.routes  # the argument: a LazyResult, routed
            self.calls.append((call.method, tuple(call.turn[:2]), route.gang is not None))
            return None, True

        def seen(self) -> list:
            return self.calls

    runtime.initialize(groups=[DeviceGroup("dr", 1, "cpu")])
    g = Mortal(remote_group="dr")
    old = (g._gang.dispatcher, g._desc)
    new = NewDispatcher.remote()
    before = g.get_value()  # an output of the old dispatcher
    encode = proxy_module.GangProxy._encode

    def encode_then_replace(self, *args, **kwargs):  # the other thread's respawn lands during
        call = encode(self, *args, **kwargs)  # this call's preparation, before it takes its turn
        if g._gang.dispatcher is old[0]:
            g._use_dispatcher(new, old[1])
        return call

    monkeypatch.setattr(proxy_module.GangProxy, "_encode", encode_then_replace)
    try:
        result = g.set_value(before)
        assert ray.get(new.seen.remote(), timeout=30) == [("set_value", (g._caller_id, 0), True)]
        assert result.gang is g._gang
    finally:
        monkeypatch.undo()
        g._use_dispatcher(*old)
        ray.kill(new)


@remote_class(max_restarts=1)
class Keeper(Valued):
    @remote_function(dispatch="all", collect="none")
    def take(self, values: list) -> list:
        return values


def test_an_output_whose_owner_died_is_named_lost_with_its_dispatcher():
    """The naming itself, without waiting on Ray: a routed input's GangRef (no dispatcher) and
    Ray's OwnerDiedError name the dispatcher that owned the outputs and the method, never a
    worker rank, and advise calling the method again rather than restart() (its gang may be up
    again)."""
    from ray.exceptions import OwnerDiedError

    from twinkle_ray.runtime.diagnose import GangRef

    routed = GangRef("dl", "Keeper", dispatcher=None)
    err = routed.death_error(OwnerDiedError("ab" * 14, None, ""), 0, method="get_value")
    assert (err.kind, err.rank) == ("dispatcher", None)
    assert str(err).startswith("the dispatcher of Keeper in group 'dl' died (node ?): the outputs "
                               "of Keeper.get_value() were owned by it"), err
    assert "Call Keeper.get_value() again" in str(err) and "torn down" not in str(err), err


@ray.remote(num_cpus=0)
class _NoDeaths:
    """A stand-in dispatcher that knows of no death."""

    def death_of(self, actor_id, wait_s):
        return None


def test_a_lost_output_is_named_so_when_the_dispatcher_asked_knows_no_death(runtime):
    """A collected output ('mean', 'sum', custom) is routed with its gang's GangRef, dispatcher
    included; passed back to its own gang after a respawn, that is the new dispatcher, which
    knows no death. Ray's OwnerDiedError then still names the outputs lost with the dispatcher
    that owned them; it said 'worker rank 1 ... died (node ?) ... call .restart()' before."""
    from ray.exceptions import OwnerDiedError

    from twinkle_ray.runtime.diagnose import GangRef

    live = _NoDeaths.remote()
    try:
        mine = GangRef("dl", "Keeper", dispatcher=live)
        err = mine.death_error(OwnerDiedError("ab" * 14, None, ""), 1, method="get_mean")
        assert (err.kind, err.rank) == ("dispatcher", None), err
        assert "outputs of Keeper.get_mean() were owned by it" in str(err), err
        assert "worker rank" not in str(err) and "torn down" not in str(err), err
    finally:
        ray.kill(live)


@pytest.mark.slow
def test_an_output_made_before_a_dispatcher_respawn_is_named_lost_with_that_dispatcher(runtime):
    """A LazyResult kept from before the gang's dispatcher died and was respawned, passed to the
    rebuilt gang: its outputs were owned by the dead dispatcher. On one node Ray may serve a
    small one for a while after its owner died (seconds alone; over a minute once, in a full
    suite), so each try must give either the right values or the error naming that dispatcher
    (kind 'dispatcher', no rank) and the method; it said 'worker rank 0 ... died (node ?)'
    before, a death the rebuilt gang never had. The rebuilt gang is not torn down by it. (The
    naming is also tested without Ray's timing, above.)"""

    runtime.initialize(groups=[DeviceGroup("dl", 2, "cpu")])
    g = Keeper(remote_group="dl")
    g.set_value(3)()
    old = g.get_value()  # owned by the first dispatcher, never fetched here
    ray.get(old.reply_ref)  # its reply is here: only its outputs live in the dispatcher
    assert _kill_dispatcher_mid_call(g).kind == "dispatcher"
    assert g.get_value()() == [0, 0]  # respawned (no state saved to files): from its constructor
    deadline, err = time.monotonic() + 30, None
    while err is None and time.monotonic() < deadline:
        try:
            got = g.take(old).get(timeout=LIMIT_S)
        except WorkerDiedError as e:
            err = e
        else:
            assert got == [[30, 31], [30, 31]], got  # still served: the right values
            time.sleep(1.0)
    if err is None:
        warnings.warn("Ray still served the dead dispatcher's outputs after 30 s: only the "
                      "right values were checked, not the error", stacklevel=1)
    else:
        assert err.kind == "dispatcher" and err.rank is None, err
        assert "worker rank" not in str(err), err
        assert "Keeper.get_value()" in str(err) and str(err).startswith("the dispatcher of Keeper"), err
        assert "Call Keeper.get_value() again" in str(err) and "torn down" not in str(err), err
    assert g.get_value()() == [0, 0]  # the rebuilt gang still serves


# ==========================================================================================
# One restart budget per gang, kept across dispatcher respawns (issue 28, item 2).
#
# A gang's ``max_restarts`` counts every rebuild: the dispatcher's automatic rebuilds after a
# worker died and the creator's respawns of a dead dispatcher. A respawned dispatcher starts
# with the history of the rebuilds before it, so killing the dispatcher never refills the budget.
BUDGET_WAIT_S = 60.0


@remote_class(max_restarts=1)
class Once:
    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


@remote_class(max_restarts=2)
class Twice(Once):
    pass


def _settle(g, want=(GangRebuildError, WorkerDiedError), wait_s: float = BUDGET_WAIT_S):
    """Call ``g.pid()`` until it answers (returns the pids) or raises one of ``want`` that is
    not a plain death seen before the rebuild (returns the error)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return g.pid()()
        except want as e:
            if isinstance(e, GangRebuildError) or e.kind == "dispatcher" or "not rebuilt" in str(e):
                return e
        assert time.monotonic() < deadline, "the gang neither answered nor stayed down"
        time.sleep(0.2)


def _kill_worker(g, rank: int = 0) -> None:
    os.kill(g.pid()()[rank], signal.SIGKILL)


def _kill_dispatcher(g) -> None:
    ray.kill(ray.get_actor(g.label, namespace=NAMESPACE), no_restart=True)
    deadline = time.monotonic() + BUDGET_WAIT_S
    while True:  # the creator's proxy sees the death on its next call
        try:
            g.pid()()
        except WorkerDiedError as e:
            assert e.kind == "dispatcher", e
            return
        assert time.monotonic() < deadline
        time.sleep(0.2)


@pytest.mark.slow
def test_a_respawn_spends_the_budget_a_worker_death_would_use(runtime):
    runtime.initialize(groups=[DeviceGroup("b1", 2, "cpu")])
    g = Once(remote_group="b1")
    _kill_dispatcher(g)
    assert len(g.pid()()) == 2  # respawned: the one restart max_restarts=1 allows
    _kill_worker(g)
    err = _settle(g)
    assert isinstance(err, GangRebuildError), err
    assert "restart budget is spent" in str(err) and "max_restarts=1" in str(err), err
    desc = g.topology()
    assert desc["restarts"] == 1 and desc["dead"] and not desc["rebuilding"], desc  # the respawn


@pytest.mark.slow
def test_a_dispatcher_death_after_a_rebuild_finds_the_budget_spent(runtime):
    runtime.initialize(groups=[DeviceGroup("b2", 2, "cpu")])
    g = Once(remote_group="b2")
    _kill_worker(g, 1)
    got = _settle(g)
    assert isinstance(got, list) and len(got) == 2, got  # the one automatic rebuild
    _kill_dispatcher(g)
    with pytest.raises(WorkerDiedError, match=r"its dispatcher died and is not rebuilt \(its "
                                              r"restart budget is spent: max_restarts=1\)"):
        g.pid()()


@pytest.mark.slow
def test_rebuild_respawn_rebuild_is_two_restarts_not_three(runtime):
    runtime.initialize(groups=[DeviceGroup("b3", 2, "cpu")])
    g = Twice(remote_group="b3")
    _kill_worker(g, 1)
    assert len(_settle(g)) == 2  # rebuild 1
    _kill_dispatcher(g)
    assert len(g.pid()()) == 2  # respawn: rebuild 2
    _kill_worker(g, 0)
    err = _settle(g)
    assert isinstance(err, GangRebuildError), err
    assert "restart budget is spent (2 automatic rebuild(s); max_restarts=2)" in str(err), err
    assert g.topology()["restarts"] == 2  # the rebuild and the respawn, counted across it


# ==========================================================================================
# An abort() that arrives while restart() builds the gang never starts a second build.
#
# One build at a time (issue 28, item 2): whatever asks for a teardown while a build is under way,
# exactly one set of workers exists afterwards and nothing is left behind.
ABORT_WAIT_S = 60.0


@remote_class(max_restarts=1)
class SlowStart:
    """Its constructor sleeps while ``marker`` exists: a rebuild that takes a while."""

    def __init__(self, marker: str):
        if os.path.exists(marker):
            time.sleep(4.0)

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


def _workers(label: str) -> list[str]:
    return sorted(a["name"] for a in live_actors() if a.get("name", "").startswith(label + "/"))


@pytest.mark.slow
def test_abort_during_restart_leaves_one_set_of_workers(runtime, tmp_path):
    marker = str(tmp_path / "slow")
    runtime.initialize(groups=[DeviceGroup("ab", 2, "cpu")])
    g = SlowStart(marker, remote_group="ab")
    label = g.label
    first = g.pid()()
    open(marker, "w").close()  # from now on a build takes seconds
    done: dict = {}

    def restart():
        try:
            g.restart(timeout=ABORT_WAIT_S)
            done["ok"] = True
        except Exception as e:  # noqa: BLE001 — the test looks at it
            done["error"] = e

    t = threading.Thread(target=restart)
    t.start()
    deadline = time.monotonic() + ABORT_WAIT_S
    while True:  # the restart's workers exist and their constructors run
        names = [r["name"] for r in g.topology()["ranks"]]
        if all(n and "#" in n for n in names):
            break
        assert time.monotonic() < deadline, names
        time.sleep(0.1)
    g.abort("the other side of a collective failed")  # while restart() builds
    t.join(ABORT_WAIT_S)
    assert not t.is_alive()
    os.remove(marker)
    pids = g.pid()()  # the gang answers, on one set of workers
    assert len(pids) == 2 and not set(pids) & set(first), (pids, first)
    desc = g.topology()
    assert not desc["rebuilding"] and desc["dead"] is None, desc
    # The restart was the one build: the abort found no collective to end (the gang was being
    # built), so no build of it failed and no automatic rebuild was spent.
    assert desc["rebuild_error"] is None and desc["restarts"] == 0, desc
    time.sleep(1.0)  # a second build, if any, would have made its actors by now
    names = _workers(label)
    assert names == sorted(r["name"] for r in desc["ranks"]), names
    assert "ok" in done, done


# ==========================================================================================
# A gang rebuild re-probes its placement (issue 20 item 5): node, devices and the rendezvous
# address are read again on every (re)build, so a rebuild after a node loss starts where Ray
# re-placed the group's bundles. On a 2-node ray.cluster_utils.Cluster in its own driver.
MOVE = textwrap.dedent(
    """
    import json, os, time
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")  # a loaded machine starts slowly
    import ray
    from ray.cluster_utils import Cluster
    import twinkle_ray as twinkle
    from twinkle_ray import DeviceGroup, WorkerDiedError, remote_class, remote_function

    @remote_class(max_restarts=1)
    class W:
        @remote_function(dispatch="all", collect="none")
        def where(self):
            import torch, torch.distributed as dist
            t = torch.tensor([1.0]); dist.all_reduce(t)
            return [ray.get_runtime_context().get_node_id(), os.environ["CUDA_VISIBLE_DEVICES"],
                    os.environ["MASTER_ADDR"], t.item()]

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0,
                      "include_dashboard": False})
    first = cluster.add_node(num_cpus=2, num_gpus=2)
    try:
        twinkle.initialize(address=cluster.address, placement_timeout_s=120,
                           groups=[DeviceGroup("g", 2, "cuda")])
        w = W(remote_group="g")
        before = w.where()()
        second = cluster.add_node(num_cpus=2, num_gpus=2)
        cluster.remove_node(first)
        deadline = time.monotonic() + 300
        while True:  # calls fail until the gang is rebuilt on the new node
            try:
                after = w.where()()
                break
            except WorkerDiedError:
                assert time.monotonic() < deadline, f"no rebuild: {w.topology()}"
                time.sleep(0.5)
        topo = w.topology()
        print("RESULT " + json.dumps({
            "first": first.node_id, "second": second.node_id, "before": before, "after": after,
            "generation": topo["generation"], "master_addr": topo["master_addr"],
            "ranks": [[r["node_id"], r["devices"], r["node_ip"]] for r in topo["ranks"]]}))
        twinkle.shutdown()
        ray.shutdown()
    finally:
        cluster.shutdown()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(560)
def test_rebuild_follows_a_bundle_moved_to_another_node():
    """Issue 20 item 5: the node holding a gang is lost, Ray re-places its placement group on a
    new node, and the automatic rebuild starts there (node, devices, rendezvous re-probed)."""
    from test_runtime_layouts import run_script

    out, _ = run_script(MOVE, timeout=500)
    first, second = out["first"], out["second"]
    assert [r[0] for r in out["before"]] == [first, first]
    assert [r[0] for r in out["after"]] == [second, second]
    assert sorted(r[1] for r in out["after"]) == ["0", "1"]
    assert {r[3] for r in out["after"]} == {2.0}  # the new world's all-reduce
    assert [r[0] for r in out["ranks"]] == [second, second]
    assert out["generation"] >= 2
    assert out["master_addr"] == "127.0.0.1"  # one node: loopback rendezvous


# ==========================================================================================
# The rebuild room starts one build at a time: a failure reported while a build is under way
# (a restart() or an automatic rebuild) ends that build before the next starts (issue 28, item 2).
#
# Plain asyncio on the Rebuilder with a stand-in builder: no Ray needed.
class SlowBuilder:
    """Counts builds under way at once; each takes ``build_s``."""

    def __init__(self, max_restarts: int, build_s: float = 0.2):
        spec = SimpleNamespace(max_restarts=max_restarts, restart_window_s=None, restart_times=(),
                               restarts=0, label="g/C", metrics=False, start_timeout_s=None,
                               group=SimpleNamespace(name="g"), cls_name="C")
        self.state = SimpleNamespace(spec=spec, stopped=False, label="g/C", actor_ids=list)
        self.deaths = DeathRecord()
        self.build_s = build_s
        self.now = self.most = self.finished = 0

    async def kill(self, graceful: bool = False) -> None:
        pass

    async def start_within(self, limit) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(self.build_s)
        finally:
            self.now -= 1
        self.finished += 1
        self.deaths.revived()


def _rebuilder(max_restarts: int) -> tuple[Rebuilder, SlowBuilder]:
    builder = SlowBuilder(max_restarts)
    rebuilds = Rebuilder(builder)

    async def placed():
        return None

    rebuilds._placement_ready = placed
    return rebuilds, builder


def _death() -> WorkerDiedError:
    return WorkerDiedError("g", "C", 0, None, "killed")


def test_a_failure_during_restart_ends_that_build_first():
    async def main():
        rebuilds, builder = _rebuilder(max_restarts=1)
        restart = asyncio.ensure_future(rebuilds.restart())
        await asyncio.sleep(0.05)  # the restart's build is under way
        await rebuilds.fail(_death())  # an automatic rebuild follows it
        await restart
        await rebuilds.settled()
        return builder, rebuilds

    builder, rebuilds = asyncio.run(main())
    assert (builder.most, builder.finished, rebuilds.restarts) == (1, 1, 1)
    assert builder.deaths.error is None


def test_a_failure_past_the_budget_during_a_rebuild_ends_it_and_the_gang_stays_down():
    async def main():
        rebuilds, builder = _rebuilder(max_restarts=1)
        await rebuilds.fail(_death())  # the one automatic rebuild
        await asyncio.sleep(0.05)
        await rebuilds.fail(_death())  # its budget is spent: it ends, nothing more is built
        await rebuilds.settled()
        return builder

    builder = asyncio.run(main())
    assert (builder.most, builder.finished) == (1, 0)
    assert "restart budget is spent" in str(builder.deaths.error)


# ==========================================================================================
# Gang health (issue 27, items 3-5): no stuck check where no rank can be stuck, a rebuild with a
# deadline, and proxy copies that find a respawned dispatcher.
#
# 3. The stuck check only counts ranks running the *same* call, and never runs on a gang without
#    torch.distributed (no collective can block there).
# 4. A rebuild (automatic or ``restart()``) is bounded by ``start_timeout_s``: a constructor that
#    hangs on the rebuilt generation ends in GangRebuildError, what was half built is killed, and
#    ``restart()`` ends a hung rebuild; a rebuilding Serve replica is not healthy.
# 5. A GangProxy pickled into another gang's worker looks its gang up again by name once its
#    dispatcher was respawned by the creator's proxy.
WAIT_S = 150.0  # a guard against hangs on a loaded 2-core machine, not a performance bound


class _Ranks:
    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    @remote_function(dispatch="all", collect="none")
    def fail_or_work(self, fail_rank: int, work_s: float) -> int:
        """``fail_rank`` raises at once; the other ranks work ``work_s`` seconds."""
        if get_rank() == fail_rank:
            raise KeyError(f"bad item on rank {fail_rank}")
        time.sleep(work_s)
        return get_rank()

    @remote_function(dispatch="all", collect="none")
    def slow_on(self, rank: int, seconds: float) -> int:
        if get_rank() == rank:
            time.sleep(seconds)
        return get_rank()


@remote_class(distributed=False)
class Reward(_Ranks):
    """Like a reward worker or a vLLM sampler: no torch.distributed in the gang."""


# A stuck check 1 s after a failure (the default is 3 s): the test's busy rank sleeps 3x that.
@remote_class(stuck_grace_s=1.0)
class Trainer(_Ranks):
    """Two ranks with torch.distributed (gloo)."""


def _until(what: str, check, wait_s: float = WAIT_S):
    deadline = time.monotonic() + wait_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not seen within {wait_s:g}s"
        time.sleep(0.2)


# ---------------------------------------------------------------------------- 3. stuck check
@pytest.mark.slow
def test_no_stuck_check_in_a_gang_without_torch_distributed(runtime):
    runtime.initialize(groups=[DeviceGroup("rw", 2, "cpu")])
    g = Reward(remote_group="rw")
    pids = g.pid()()
    with pytest.raises(KeyError, match="bad item on rank 0"):
        g.fail_or_work(0, 6.0)()  # rank 1 works on past the grace period: it is not stuck
    assert g.pid()() == pids  # the same gang, not torn down
    desc = g.topology()
    assert (desc["dead"], desc["restarts"]) == (None, 0)


@pytest.mark.slow
def test_ranks_on_an_earlier_call_are_not_stuck(runtime):
    runtime.initialize(groups=[DeviceGroup("tr", 2, "cpu")])
    g = Trainer(remote_group="tr")
    pids = g.pid()()
    earlier = g.slow_on(1, 3.0)  # rank 1 is busy with this call past the grace period...
    with pytest.raises(KeyError, match="bad item on rank 0"):
        g.fail_or_work(0, 0.0)()  # ...while rank 0 raises on the next one
    assert earlier() == [0, 1]
    assert g.pid()() == pids  # no GangStuckError: rank 1 never ran the failed call stuck
    assert g.topology()["dead"] is None


# ---------------------------------------------------------------------------- 4. rebuild deadline
@remote_class(max_restarts=1, distributed=False)  # no torch to import: a quick first start
class HangsOnRebuild:
    """Starts once; a rebuilt rank 1 hangs in its constructor while ``marker`` exists (and says
    so by creating ``marker + '.hung'``)."""

    def __init__(self, marker: str):
        if get_rank() == 1 and os.path.exists(marker):
            open(marker + ".hung", "w").close()
            time.sleep(3600)

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


def _kill_rank(g, rank: int) -> None:
    os.kill(g.pid()()[rank], signal.SIGKILL)


def _workers_of(label: str) -> list[str]:
    return [a["name"] for a in live_actors() if (a.get("name") or "").startswith(label + "/")]


@pytest.mark.slow  # a rebuild left to its deadline (start_timeout_s, which also bounds the first start)
def test_a_hung_rebuild_ends_in_gang_rebuild_error_and_restart_brings_it_back(runtime, tmp_path):
    marker = str(tmp_path / "hang")
    # The rebuild waits this out: 20 s, still ~10x a no-torch gang's start on a loaded machine.
    runtime.initialize(groups=[DeviceGroup("hr", 2, "cpu")], start_timeout_s=20)
    g = HangsOnRebuild(marker, remote_group="hr")
    label = g.topology()["label"]
    open(marker, "w").close()  # the rebuilt rank 1 will hang
    _kill_rank(g, 0)
    desc = _until("the rebuild's end", lambda: (d := g.topology())["rebuild_error"] and d)
    assert not desc["rebuilding"] and os.path.exists(marker + ".hung")
    with pytest.raises(GangRebuildError) as info:
        g.pid()()
    err = str(info.value)
    assert "the constructor of rank(s) [1] did not finish within start_timeout_s=20s" in err, err
    assert "worker rank 0 of HangsOnRebuild in group 'hr' died" in err  # and the death it followed
    _until("the half-built workers killed", lambda: not _workers_of(label), 30)
    os.remove(marker)
    g.restart(timeout=WAIT_S)
    assert len(set(g.pid()())) == 2


@pytest.mark.slow
def test_restart_ends_a_hung_rebuild(runtime, tmp_path):
    marker = str(tmp_path / "hang")
    runtime.initialize(groups=[DeviceGroup("hr2", 2, "cpu")], start_timeout_s=600)
    g = HangsOnRebuild(marker, remote_group="hr2")
    open(marker, "w").close()
    _kill_rank(g, 1)
    _until("the rebuilt rank 1 hanging", lambda: os.path.exists(marker + ".hung"))
    assert g.topology()["rebuilding"]
    os.remove(marker)
    g.restart(timeout=60)  # ends the hung rebuild and builds afresh
    assert len(set(g.pid()())) == 2
    desc = g.topology()
    assert (desc["dead"], desc["rebuilding"]) == (None, False)


REPLICA_GROUP = DeviceGroup("replica/h", 2, "cpu")


@ray.remote(num_cpus=1)
class HangingReplica:
    def __init__(self, marker: str):
        from twinkle_ray.serve import ReplicaGang

        self.gang = ReplicaGang(REPLICA_GROUP, HangsOnRebuild, marker, max_rebuilds=1)

    async def health(self) -> str:
        try:
            await self.gang.check_health(timeout=2)
            return "ok"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def kill(self, rank: int) -> None:
        _kill_rank(self.gang.proxy, rank)

    def rebuilding(self) -> bool:
        return self.gang.rebuilding

    def shutdown(self) -> None:
        import twinkle_ray

        twinkle_ray.shutdown()


@pytest.mark.slow
def test_a_rebuilding_replica_is_not_healthy(ray_session, tmp_path):
    marker = str(tmp_path / "hang")
    pg = placement_group(replica_bundles(REPLICA_GROUP), strategy=REPLICA_GROUP.strategy)
    ray.get(pg.ready(), timeout=60)
    r = HangingReplica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0)).remote(marker)
    try:
        assert ray.get(r.health.remote()) == "ok"
        open(marker, "w").close()
        ray.get(r.kill.remote(1))
        _until("the rebuilt rank 1 hanging", lambda: os.path.exists(marker + ".hung"))
        health = ray.get(r.health.remote())
        assert ray.get(r.rebuilding.remote())
        assert health.startswith("GangUnavailable: replica not ready: its gang on group "
                                 "'replica/h' is being rebuilt"), health
    finally:
        ray.get(r.shutdown.remote())
        ray.kill(r)
        remove_placement_group(pg)


# ---------------------------------------------------------------------------- 5. proxy copies
@remote_class(max_restarts=1, distributed=False)  # no torch: its respawn starts sooner
class Served(_Ranks):
    pass


@remote_class(distributed=False)
class Holder:
    """A worker of another gang holding a pickled proxy of the Served gang."""

    def __init__(self, gang):
        self.gang = gang

    @remote_function(dispatch="all", collect="first")
    def ask(self):
        try:
            return self.gang.pid()()
        except Exception as e:  # returned, so the test sees type and text
            return f"{type(e).__name__}: {e}"


@pytest.mark.slow
def test_a_proxy_copy_finds_the_respawned_dispatcher(runtime):
    runtime.initialize(groups=[DeviceGroup("sv", 2, "cpu"), DeviceGroup("hd", 1, "cpu")])
    g = Served(remote_group="sv")
    holder = Holder(g, remote_group="hd")
    assert len(holder.ask()()) == 2
    label = g.topology()["label"]
    ray.kill(ray.get_actor(label, namespace=NAMESPACE), no_restart=True)

    def creator_sees_death():
        try:
            g.pid()()
        except WorkerDiedError as e:
            return e
        return None

    assert _until("the dispatcher's death", creator_sees_death).kind == "dispatcher"
    seen = holder.ask()()  # the copy's call meets the dead dispatcher
    assert seen.startswith("WorkerDiedError: the dispatcher of Served in group 'sv' died"), seen
    pids = g.pid()()  # the creator's proxy respawns the dispatcher and the gang
    assert len(pids) == 2
    assert holder.ask()() == pids  # the copy looked the gang up again by name
    assert g.pid()() == pids
