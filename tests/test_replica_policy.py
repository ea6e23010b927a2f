"""ReplicaGang keeps no restart policy of its own: the gang's dispatcher rebuilds it under the
replica's limits; close() closes only the replica's gang.

The replica is a plain actor on a placement group shaped by ``deployment_options`` (bundle 0
the replica, bundles 1..n the workers), so no Serve is needed here.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.serve import replica_bundles

GROUP = DeviceGroup("replica/s", 2, "cpu")


@remote_class()
class Echo:
    def __init__(self, device_mesh=None):
        pass

    @remote_function(dispatch="slice_dp", collect="flatten")
    def echo(self, items: list) -> list:
        return list(items)

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=1)
class Replica:
    def __init__(self, max_rebuilds: int):
        from twinkle_ray.serve import ReplicaGang

        self.gang = ReplicaGang(GROUP, Echo, device_mesh=DeviceMesh.from_sizes(dp_size=2),
                                max_rebuilds=max_rebuilds, rebuild_timeout_s=120)

    async def call(self, items):
        try:
            return await self.gang.call(self.gang.proxy.echo, items)
        except Exception as e:  # returned, so the test sees type and text
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

    def close_keeps_others(self) -> dict:
        import twinkle_ray

        twinkle_ray.initialize(groups=[DeviceGroup("side", 1, "cpu")])
        side = Echo(remote_group="side")
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


@pytest.fixture
def replica_pg(ray_session):
    pg = placement_group(replica_bundles(GROUP), strategy=GROUP.strategy)
    ray.get(pg.ready(), timeout=60)
    yield pg
    remove_placement_group(pg)


def _replica(pg, max_rebuilds: int):
    return Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0)).remote(max_rebuilds)


def _our_named_actors() -> list:
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"].startswith("twinkle-serve-")]


@pytest.mark.slow
def test_replica_heals_by_the_dispatchers_policy_and_gives_up_when_it_is_spent(replica_pg):
    r = _replica(replica_pg, max_rebuilds=1)
    try:
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
    finally:
        ray.get(r.shutdown.remote())
        ray.kill(r)
    deadline = time.monotonic() + 15
    while _our_named_actors() and time.monotonic() < deadline:  # kills land
        time.sleep(0.2)
    assert _our_named_actors() == []  # the replica's gang died with it


@pytest.mark.slow
def test_close_stops_only_the_replicas_gang(replica_pg):
    r = _replica(replica_pg, max_rebuilds=0)
    try:
        out = ray.get(r.close_keeps_others.remote())
    finally:
        ray.kill(r)
    assert out["gone"] and isinstance(out["side"], int), out  # the other gang still answered
    assert "replica/s" not in out["placement"] and "group 'side'" in out["placement"]
