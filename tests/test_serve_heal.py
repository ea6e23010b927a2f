"""A Serve replica heals its gang's dead dispatcher and keeps answering: slower, not 503.

The replica is a plain actor on a replica-shaped placement group (bundle 0 the replica, 1..n
the workers), as in test_replica_policy, so no Serve is needed. Its gang runs on an fsdp=2 x
dp=2 mesh, where a data rank is not a worker index: each request must still get the answer to
its own input. The class has no ``max_restarts``: the replica's own limits arm the respawn.
"""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.serve import replica_bundles

GROUP = DeviceGroup("heal/s", 4, "cpu")
REQUESTS = 20


@remote_class()
class Answerer:
    def __init__(self, device_mesh=None):
        self.offset = 0

    @remote_function(dispatch="all", collect="first")
    def set_offset(self, offset: int) -> None:
        self.offset = offset

    @remote_function(dispatch="slice_dp", collect="flatten")
    def answer(self, prompts: list) -> list:
        return [None if p is None else f"{p}+{self.offset}" for p in prompts]

    def state_dict(self) -> dict:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.offset = state["offset"]


@ray.remote(num_cpus=1)
class Replica:
    def __init__(self):
        from twinkle_ray.serve import ReplicaGang

        self.gang = ReplicaGang(GROUP, Answerer,
                                device_mesh=DeviceMesh.from_sizes(fsdp_size=2, dp_size=2),
                                max_rebuilds=2, rebuild_timeout_s=120)

    async def call(self, prompts):
        try:
            return await self.gang.call(self.gang.proxy.answer, prompts)
        except Exception as e:  # returned, so the test sees type and text
            return f"{type(e).__name__}: {e}"

    def save(self, offset: int, path: str) -> None:
        self.gang.proxy.set_offset(offset)()
        self.gang.proxy.save_state(path=path)

    async def health(self):
        try:
            await self.gang.check_health()
            return "ok"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def where(self) -> tuple[str, str]:
        return self.gang.proxy.label, self.gang.namespace

    def shutdown(self) -> None:
        import twinkle_ray

        twinkle_ray.shutdown()


@pytest.fixture
def replica(ray_session):
    pg = placement_group(replica_bundles(GROUP), strategy=GROUP.strategy)
    ray.get(pg.ready(), timeout=60)
    r = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0)).remote()
    try:
        yield r
    finally:
        try:
            ray.get(r.shutdown.remote(), timeout=60)
        finally:
            ray.kill(r)
            remove_placement_group(pg)


@pytest.mark.slow  # a 4-worker gang started, then rebuilt with its dispatcher
def test_a_replica_heals_its_dead_dispatcher_without_failing_a_request(replica, tmp_path):
    prompts = [f"p{i}" for i in range(4)]
    # each request its own answer on fsdp x dp (before: [p0, p2, p1, p3])
    assert ray.get(replica.call.remote(prompts)) == [f"{p}+0" for p in prompts]
    assert ray.get(replica.call.remote(["lone"])) == ["lone+0"]  # padded to dp, trimmed
    ray.get(replica.save.remote(7, str(tmp_path / "state")))
    label, namespace = ray.get(replica.where.remote())
    ray.kill(ray.get_actor(label, namespace=namespace), no_restart=True)
    t0 = time.monotonic()
    answers = [ray.get(replica.call.remote([f"r{k}", f"s{k}", f"t{k}"])) for k in range(REQUESTS)]
    failed = [a for a in answers if not isinstance(a, list)]
    print(f"\nDISPATCHER-KILL: {len(failed)} failed of {REQUESTS} sequential requests; "
          f"{time.monotonic() - t0:.1f} s for all")
    assert failed == []
    # the respawned gang restored the state saved to files, and answers in order
    assert answers == [[f"r{k}+7", f"s{k}+7", f"t{k}+7"] for k in range(REQUESTS)]
    assert ray.get(replica.health.remote()) == "ok"
