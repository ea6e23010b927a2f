"""Gang health (issue 27, items 3-5): no stuck check where no rank can be stuck, a rebuild with a
deadline, and proxy copies that find a respawned dispatcher.

3. The stuck check only counts ranks running the *same* call, and never runs on a gang without
   torch.distributed (no collective can block there).
4. A rebuild (automatic or ``restart()``) is bounded by ``start_timeout_s``: a constructor that
   hangs on the rebuilt generation ends in GangRebuildError, what was half built is killed, and
   ``restart()`` ends a hung rebuild; a rebuilding Serve replica is not healthy.
5. A GangProxy pickled into another gang's worker looks its gang up again by name once its
   dispatcher was respawned by the creator's proxy.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conftest import NAMESPACE, live_actors
from twinkle_ray import DeviceGroup, WorkerDiedError, get_rank, remote_class, remote_function
from twinkle_ray.runtime.errors import GangRebuildError
from twinkle_ray.serve import replica_bundles

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
