"""adopt_placement_group: a gang on bundles of a placement group someone else owns."""

from __future__ import annotations

import pytest

from twinkle_ray import DeviceGroup, remote_class, remote_function
from twinkle_ray.runtime.adopt import adopt_placement_group


@remote_class()
class Where:
    @remote_function(dispatch="all", collect="none")
    def gpus(self) -> str:
        import os

        return os.environ.get("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def foreign_pg(ray_session):
    """A 3-bundle placement group owned by the test (bundle 0 stands for a Serve replica)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}], name="foreign")
    assert pg.wait(30)
    yield pg
    remove_placement_group(pg)


@pytest.mark.slow
def test_gang_runs_on_adopted_bundles_and_shutdown_keeps_the_pg(runtime, foreign_pg):
    from ray.util.placement_group import placement_group_table

    runtime.initialize("ray")
    adopt_placement_group(DeviceGroup("adopted", 2, "cuda"), foreign_pg, [1, 2])
    gang = Where(remote_group="adopted")
    rows = gang.topology()["ranks"]
    assert [r["bundle"] for r in rows] == [1, 2]
    assert sorted(gang.gpus()()) == sorted(",".join(map(str, r["devices"])) for r in rows)
    assert "bundle 1" in runtime.get_device_placement()
    runtime.shutdown()
    assert placement_group_table(foreign_pg)["state"] == "CREATED"  # still the owner's


@pytest.mark.slow
def test_adopt_rejects_bad_bundles(runtime, foreign_pg):
    runtime.initialize("ray")
    with pytest.raises(ValueError, match="bundle_indices"):
        adopt_placement_group(DeviceGroup("a", 2, "cuda"), foreign_pg, [1])
    with pytest.raises(ValueError, match="bundle 0 .* cannot hold"):
        adopt_placement_group(DeviceGroup("b", 2, "cuda"), foreign_pg, [0, 1])
    with pytest.raises(ValueError, match="bundle_indices"):
        adopt_placement_group(DeviceGroup("c", 2, "cuda"), foreign_pg, [1, 3])


def test_adopt_needs_ray_mode():
    import twinkle_ray

    twinkle_ray.shutdown()
    with pytest.raises(RuntimeError, match="initialize"):
        adopt_placement_group(DeviceGroup("x", 1, "cpu"), object(), [0])
