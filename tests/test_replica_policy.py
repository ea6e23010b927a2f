"""ReplicaGang keeps no restart policy of its own: the gang's dispatcher rebuilds it under the
replica's limits; a replica heals its gang's dead dispatcher and keeps answering (slower, not
503); close() closes only the replica's gang.

The replica is a plain actor on a placement group shaped by ``replica_bundles`` (bundle 0 the
replica, bundles 1..n the workers), as ``deployment_options`` asks Serve for, so no Serve is
needed here. Each test starts one replica (its gang is what the test breaks): the heal test's
gang runs on an fsdp=2 x dp=2 mesh, where a data rank is not a worker index, so each request
must still get the answer to its own input; its class has no ``max_restarts``, so the
replica's own limits arm the respawn. The same replica, healed, then checks close().
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.serve import replica_bundles

POLICY_GROUP = DeviceGroup("replica/s", 2, "cpu")
HEAL_GROUP = DeviceGroup("heal/s", 4, "cpu")
REQUESTS = 20


@remote_class()
class Answerer:
    def __init__(self, device_mesh=None):
        self.offset = 0

    @remote_function(dispatch="all", collect="first")
    def set_offset(self, offset: int) -> None:
        self.offset = offset

    @remote_function(dispatch="slice_dp", collect="flatten")
    def echo(self, items: list) -> list:
        return list(items)

    @remote_function(dispatch="slice_dp", collect="flatten")
    def answer(self, prompts: list) -> list:
        return [None if p is None else f"{p}+{self.offset}" for p in prompts]

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    def state_dict(self) -> dict:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.offset = state["offset"]


@ray.remote(num_cpus=1)
class Replica:
    """A Serve replica's part, without Serve: a ReplicaGang built in the actor's own
    placement group. Errors are returned as text, so the test sees type and message."""

    def __init__(self, group: DeviceGroup, mesh: DeviceMesh, max_rebuilds: int):
        from twinkle_ray.serve import ReplicaGang

        self.gang = ReplicaGang(group, Answerer, device_mesh=mesh, max_rebuilds=max_rebuilds,
                                rebuild_timeout_s=120)

    async def call(self, items, method: str = "echo"):
        try:
            return await self.gang.call(getattr(self.gang.proxy, method), items)
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    async def health(self):
        try:
            await self.gang.check_health()
            return "ok"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def kill(self, rank: int) -> int:
        pid = self.gang.proxy.pid()()[rank]
        os.kill(pid, signal.SIGKILL)
        return pid

    def info(self) -> dict:
        return {"policy": self.gang.policy, **self.gang.topology()}

    def save(self, offset: int, path: str) -> None:
        self.gang.proxy.set_offset(offset)()
        self.gang.proxy.save_state(path=path)

    def where(self) -> tuple[str, str]:
        return self.gang.proxy.label, self.gang.namespace

    def close_keeps_others(self) -> dict:
        import twinkle_ray

        twinkle_ray.initialize(groups=[DeviceGroup("side", 1, "cpu")])
        side = Answerer(remote_group="side")
        label = self.gang.topology()["label"]
        namespace = self.gang.namespace
        self.gang.close()
        gone = False
        try:
            ray.get_actor(label, namespace=namespace)
        except ValueError:
            gone = True
        out = {"side": side.pid()(), "gone": gone,
               "placement": twinkle_ray.get_device_placement()}
        twinkle_ray.shutdown()
        return out

    def shutdown(self) -> None:
        import twinkle_ray

        twinkle_ray.shutdown()


@contextmanager
def replica(group: DeviceGroup, mesh: DeviceMesh, max_rebuilds: int):
    """One replica on its own replica-shaped placement group; shut down, killed and its
    placement group removed afterwards, whatever the test did to it."""
    pg = placement_group(replica_bundles(group), strategy=group.strategy)
    ray.get(pg.ready(), timeout=60)
    r = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0)).remote(group, mesh, max_rebuilds)
    try:
        yield r
    finally:
        try:
            ray.get(r.shutdown.remote(), timeout=60)
        finally:
            ray.kill(r)
            remove_placement_group(pg)


def _our_named_actors() -> list:
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"].startswith("twinkle-serve-")]


@pytest.mark.slow
def test_replica_heals_by_the_dispatchers_policy_and_gives_up_when_it_is_spent(ray_session):
    with replica(POLICY_GROUP, DeviceMesh.from_sizes(dp_size=2), max_rebuilds=1) as r:
        assert ray.get(r.call.remote([1, 2, 3])) == [1, 2, 3]
        info = ray.get(r.info.remote())
        assert info["policy"] == info["restart_policy"] == "max_restarts=1 within 600s"
        ray.get(r.kill.remote(1))
        assert ray.get(r.call.remote([4, 5])) == [4, 5]  # re-run on the gang the dispatcher rebuilt
        assert ray.get(r.info.remote())["restarts"] == 1  # one count: the dispatcher's
        assert ray.get(r.health.remote()) == "ok"
        ray.get(r.kill.remote(0))
        out = ray.get(r.call.remote([6]))
        assert out.startswith("GangUnavailable: replica unavailable"), out
        assert "restart budget is spent (1 automatic rebuild(s); max_restarts=1 within 600s)" in out
        assert ray.get(r.health.remote()).startswith("GangUnavailable")
    deadline = time.monotonic() + 15
    while _our_named_actors() and time.monotonic() < deadline:  # kills land
        time.sleep(0.2)
    assert _our_named_actors() == []  # the replica's gang died with it


@pytest.mark.slow  # a 4-worker gang started, then rebuilt with its dispatcher
def test_a_replica_heals_its_dead_dispatcher_then_close_stops_only_its_gang(ray_session, tmp_path):
    mesh = DeviceMesh.from_sizes(fsdp_size=2, dp_size=2)
    with replica(HEAL_GROUP, mesh, max_rebuilds=2) as r:
        prompts = [f"p{i}" for i in range(4)]
        # each request its own answer on fsdp x dp (before: [p0, p2, p1, p3])
        assert ray.get(r.call.remote(prompts, "answer")) == [f"{p}+0" for p in prompts]
        assert ray.get(r.call.remote(["lone"], "answer")) == ["lone+0"]  # padded to dp, trimmed
        ray.get(r.save.remote(7, str(tmp_path / "state")))
        label, namespace = ray.get(r.where.remote())
        ray.kill(ray.get_actor(label, namespace=namespace), no_restart=True)
        t0 = time.monotonic()
        answers = [ray.get(r.call.remote([f"r{k}", f"s{k}", f"t{k}"], "answer"))
                   for k in range(REQUESTS)]
        failed = [a for a in answers if not isinstance(a, list)]
        print(f"\nDISPATCHER-KILL: {len(failed)} failed of {REQUESTS} sequential requests; "
              f"{time.monotonic() - t0:.1f} s for all")
        assert failed == []
        # the respawned gang restored the state saved to files, and answers in order
        assert answers == [[f"r{k}+7", f"s{k}+7", f"t{k}+7"] for k in range(REQUESTS)]
        assert ray.get(r.health.remote()) == "ok"

        # close() on the healed replica: its gang goes, another gang of the process stays
        out = ray.get(r.close_keeps_others.remote())
    assert out["gone"] and isinstance(out["side"], int), out  # the other gang still answered
    assert "heal/s" not in out["placement"] and "group 'side'" in out["placement"]
