"""Groups that name their device ids (issue 22 item 4) and gangs that re-probe their placement
on every (re)build (issue 20 item 5), on the session's embedded Ray with 8 virtual GPUs."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray

from twinkle_ray import (
    DeviceGroup,
    PlacementError,
    get_device_placement,
    remote_class,
    remote_function,
)
from twinkle_ray.runtime import session
from twinkle_ray.runtime.placement import BundleSlot, refresh_slots


@remote_class(distributed=False)
class Seen:
    @remote_function(dispatch="all", collect="none")
    def devices(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")


@ray.remote(num_cpus=0)
def free_gpu() -> list:
    return ray.get_runtime_context().get_accelerator_ids()["GPU"]


def gpus_free(expect: int | None = None) -> int:
    """Free GPUs; with ``expect``, waits (up to 15 s) for Ray to settle on that number (removed
    placement groups return their devices a moment later)."""
    deadline = time.monotonic() + 15
    while True:
        free = int(ray.available_resources().get("GPU", 0))
        if expect is None or free == expect or time.monotonic() > deadline:
            return free
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def settled(ray_session):
    """Every test starts with the session's 8 GPUs free (the last test's are returned)."""
    assert gpus_free(8) == 8


@pytest.mark.slow
def test_workers_see_exactly_the_named_devices(runtime):
    # the two cases of issue 22, a 2-GPU worker, and a group Ray places, side by side
    runtime.initialize(groups=[
        DeviceGroup("t", [2, 3], "cuda"),
        DeviceGroup("v", 1, "cuda", visible_devices="5"),
        DeviceGroup("w", [6, 7], "cuda", gpus_per_worker=2),
        DeviceGroup("c", 2, "cuda"),
    ])
    seen = {name: Seen(remote_group=name).devices()() for name in ("t", "v", "w", "c")}
    assert seen["t"] == ["2", "3"]
    assert seen["v"] == "5"  # one worker: its value, not a list
    assert seen["w"] == "6,7"  # one worker with both devices
    counted = [int(d) for d in seen["c"]]
    assert len(set(counted)) == 2 and not set(counted) & {2, 3, 5, 6, 7}
    # Ray's accounting agrees: 7 devices are ours, and the one left is the one nobody uses
    assert gpus_free(1) == 1
    [left] = {0, 1, 4} - set(counted)
    assert ray.get(free_gpu.options(num_gpus=1).remote()) == [str(left)]


def test_topology_shows_the_assigned_devices(runtime):
    runtime.initialize(groups=[DeviceGroup("t", [4, 5], "cuda"), DeviceGroup("c", 1, "cuda")])
    text = get_device_placement()
    lines = text.splitlines()
    t = lines.index(next(x for x in lines if x.startswith("group 't'")))
    assert "devices as named" in lines[t]
    assert "GPU [4]" in lines[t + 1] and lines[t + 1].lstrip().startswith("rank 0")
    assert "GPU [5]" in lines[t + 2] and lines[t + 2].lstrip().startswith("rank 1")
    c = lines.index(next(x for x in lines if x.startswith("group 'c'")))
    assert "GPU [4]" not in lines[c + 1] and "GPU [5]" not in lines[c + 1]


def test_ids_beyond_the_node(runtime):
    with pytest.raises(PlacementError, match=(
            r"group 'x': device ids \[8, 9\] are beyond the cluster's GPU devices: 1 node\(s\) "
            r"with 8 GPU \(device r is device r % 8 on node r // 8")):
        runtime.initialize(groups=[DeviceGroup("x", [8, 9], "cuda")])
    assert session.current() is None and gpus_free(8) == 8


def test_worker_split_across_nodes(runtime):
    with pytest.raises(PlacementError, match=r"worker 0 would own devices \[7, 8\] on nodes \[0, 1\]"):
        runtime.initialize(groups=[DeviceGroup("s", [7, 8], "cuda", gpus_per_worker=2)])
    assert gpus_free(8) == 8


def test_ids_held_by_another_group(runtime):
    runtime.initialize(groups=[DeviceGroup("a", [0, 1], "cuda"), DeviceGroup("c", 2, "cuda")])
    # 8 - 2 - 2: read once the single-device probes 'a' was pinned with have given theirs back
    # (Ray returns a removed placement group's devices a moment later; read at once it was 2)
    before = gpus_free(4)
    assert before == 4
    with pytest.raises(ValueError, match=r"DeviceGroups 'a' and 'b' both claim devices \[1\]"):
        runtime.initialize(groups=[DeviceGroup("b", [1, 4], "cuda")])  # checked before Ray
    counted = session.current().slots["c"][0].devices[0]
    with pytest.raises(PlacementError, match=(
            rf"group 'd': GPU devices \[{counted}\] on node 0 \(.*\) are already held by group 'c'")):
        runtime.initialize(groups=[DeviceGroup("d", [counted, 7], "cuda")])
    assert gpus_free(before) == before  # nothing left reserved by the failed declarations
    assert sorted(session.current().groups) == ["a", "c"]


def test_ids_held_outside_twinkle(runtime):
    from ray.util.placement_group import placement_group, remove_placement_group

    other = placement_group([{"GPU": 2}])  # Ray gives it devices 0 and 1
    ray.get(other.ready())
    try:
        with pytest.raises(PlacementError, match=(
                r"GPU devices \[1\] on node 0 .* named by group\(s\) 'b', are held by another "
                r"Ray task or placement group")):
            runtime.initialize(groups=[DeviceGroup("b", [1, 2], "cuda")])
        assert gpus_free(6) == 6
    finally:
        remove_placement_group(other)


def test_refresh_slots_reprobes_a_stale_placement(runtime):
    """What a rebuild does first: slots frozen with a node and devices that are gone are read
    afresh (node, address, devices), and named devices are checked again."""
    runtime.initialize(groups=[DeviceGroup("c", 2, "cuda"), DeviceGroup("t", [6], "cuda")])
    rt = session.current()
    for name in ("c", "t"):
        g, pg, real = rt.group(name), rt.pgs[name], rt.slots[name]
        stale = [BundleSlot(s.bundle_index, "0" * 56, "10.255.0.9", (99,), s.assigned) for s in real]
        if name == "c":  # Ray's devices: probed again
            fresh = asyncio.run(refresh_slots(g, pg, stale, timeout_s=30))
            assert sorted(fresh, key=lambda s: s.devices) == sorted(real, key=lambda s: s.devices)
        else:  # named devices are tied to their node: a gone node is an error naming it
            with pytest.raises(PlacementError, match=(
                    r"group 't' names devices on node\(s\) 10.255.0.9, which are gone; named "
                    r"devices do not move to another node")):
                asyncio.run(refresh_slots(g, pg, stale, timeout_s=30))
            assert asyncio.run(refresh_slots(g, pg, real, timeout_s=30)) == real


def test_cli_topology_plan_and_on_ray(runtime, tmp_path, capsys):
    """``twinkle-ray topology``: the plan shows the named ids, and on Ray what was assigned."""
    import json

    from twinkle_ray import cli

    path = tmp_path / "groups.json"
    path.write_text(json.dumps([{"name": "t", "ranks": [2, 3]},
                                {"name": "v", "ranks": 1, "visible_devices": "5"},
                                {"name": "c", "ranks": 2}]))
    assert cli.main(["topology", str(path)]) == 0
    plan = capsys.readouterr().out
    assert "worker 1   GPU [3] (as named)" in plan and "worker 0   GPU [5] (as named)" in plan
    assert "worker 1   GPU [1] (logical: Ray picks the devices)" in plan
    address = ray.get_runtime_context().gcs_address
    assert cli.main(["topology", str(path), "--address", address]) == 0
    real = capsys.readouterr().out.splitlines()
    v = real.index(next(x for x in real if x.startswith("group 'v'")))
    assert "devices as named" in real[v] and "GPU [5]" in real[v + 1]
    c = real.index(next(x for x in real if x.startswith("group 'c'")))
    counted = [real[c + 1].split("GPU [")[1][0], real[c + 2].split("GPU [")[1][0]]
    assert len(set(counted)) == 2 and not set(counted) & {"2", "3", "5"}
