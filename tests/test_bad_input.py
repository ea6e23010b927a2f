"""Bad input and placement failures: a clear error naming the thing, before any worker runs."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import ray

from conftest import leftovers
from twinkle_ray import (
    DeviceGroup,
    DeviceMesh,
    PlacementError,
    initialize,
    remote_class,
    remote_function,
    shutdown,
)


@remote_class()
class Echo:
    @remote_function(dispatch="slice", collect="flatten")
    def pair(self, xs: list, ys: list) -> list:
        return list(zip(xs, ys, strict=True))

    @remote_function(dispatch="all")
    def take(self, obj) -> str:
        return type(obj).__name__


def test_unknown_modes_fail_at_decoration():
    with pytest.raises(ValueError, match="dispatch mode 'slice_tp'"):
        remote_function(dispatch="slice_tp")
    with pytest.raises(ValueError, match="collect mode 'avg'"):
        remote_function(collect="avg")
    with pytest.raises(ValueError, match="execute mode 'some'"):
        remote_function(execute="some")
    with pytest.raises(ValueError, match="execute mode 'rank0'"):
        remote_class(execute="rank0")


def test_compiled_graph_path_was_removed():
    for value in (True, False, None):
        with pytest.raises(TypeError, match=r"remote_class\(compiled=...\): the Compiled Graph call "
                                            r"path was removed.*maintenance mode.*busy-spin"):
            remote_class(compiled=value)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['colour'\]"):
        remote_class(colour="red")


def test_overlapping_explicit_ranks():
    with pytest.raises(ValueError, match=r"'a'.*'b'.*\[2, 3\]|'b'.*'a'.*\[2, 3\]"):
        initialize("local", groups=[DeviceGroup("a", [0, 1, 2, 3]), DeviceGroup("b", [2, 3, 4, 5])])


def test_errors_need_a_runtime():
    shutdown()
    with pytest.raises(RuntimeError, match=r"Echo\(remote_group='g'\): twinkle_ray.initialize\(\) has not been called"):
        Echo(remote_group="g")


@pytest.mark.slow
def test_bad_input_on_a_live_gang(runtime):
    runtime.initialize(groups=[DeviceGroup("g", 2, "cpu")])
    with pytest.raises(ValueError, match=r"unknown remote_group 'gg'; declared groups: 'g'"):
        Echo(remote_group="gg")
    with pytest.raises(ValueError, match=r"Echo on group 'g': its DeviceMesh has world size 4 but "
                                         r"the group has 2 worker\(s\)"):
        Echo(device_mesh=DeviceMesh.from_sizes(dp_size=4), remote_group="g")
    e = Echo(remote_group="g")
    with pytest.raises(ValueError, match=r"pair\(\) on group 'g'.*lengths|pair\(\) on group 'g'.*3.*4"):
        e.pair([1, 2, 3], [1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"pair\(\) on group 'g'.*1 items.*2"):
        e.pair([1], [2])
    with pytest.raises(TypeError, match=r"Echo.take\(\) on group 'g': argument 0 of type lock cannot be pickled"):
        e.take(threading.Lock())
    assert e.take(3)() == ["int", "int"]  # still healthy after rejected calls
    with pytest.raises(RuntimeError, match="group 'g' is already declared"):
        runtime.initialize(groups=[DeviceGroup("g", 3, "cpu")])
    runtime.initialize(groups=[DeviceGroup("g", 2, "cpu")])  # the same declaration again is fine
    with pytest.raises(RuntimeError, match="already initialised in 'ray' mode"):
        runtime.initialize("local")
    runtime.shutdown()
    with pytest.raises(RuntimeError, match=r"gang g/Echo is gone \(twinkle_ray.shutdown\(\) was called\)"):
        e.take(1)


@pytest.mark.slow
def test_group_the_cluster_can_never_hold(runtime):
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"can never hold group\(s\) 'huge'.*GPU: 16.*GPU: 8"):
        runtime.initialize(groups=[DeviceGroup("huge", 16, "cuda")])
    assert time.monotonic() - t0 < 15  # at once, not after a timeout
    assert not ray.util.placement_group_table() or leftovers(1)[1] == []


def test_only_cpus_short_names_cpus_per_worker(runtime):
    # 8 GPU workers asking 3 CPUs each on a cluster of 16 CPUs: the GPUs fit, the CPUs do not.
    with pytest.raises(PlacementError, match=r"requested \{CPU: 24, GPU: 8\}, cluster total "
                                             r"\{CPU: 16, GPU: 8\}.*Only CPUs are short.*"
                                             r"cpus_per_worker=2\b"):
        runtime.initialize(groups=[DeviceGroup("gpus", 8, "cuda", cpus_per_worker=3)])
    assert not ray.util.placement_group_table() or leftovers(1)[1] == []


def test_progress_after_setting(monkeypatch):
    from twinkle_ray.runtime import progress

    monkeypatch.delenv("TWINKLE_PROGRESS_AFTER_S", raising=False)
    assert progress.progress_after_s() == progress.PROGRESS_AFTER_S == 15.0
    monkeypatch.setenv("TWINKLE_PROGRESS_AFTER_S", "2.5")
    assert progress.progress_after_s() == 2.5
    monkeypatch.setenv("TWINKLE_PROGRESS_AFTER_S", "soon")  # not a number: the default
    assert progress.progress_after_s() == 15.0


@pytest.mark.slow
def test_busy_cluster_times_out_and_leaves_nothing(runtime, caplog, monkeypatch):
    from twinkle_ray.runtime import progress

    monkeypatch.setattr(progress, "PROGRESS_AFTER_S", 0.5)
    runtime.initialize(groups=[DeviceGroup("all8", 8, "cuda")], placement_timeout_s=2.0)
    caplog.set_level(logging.WARNING, logger="twinkle_ray")
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"'late' \(2 x \{CPU: 1, GPU: 1\}\) not ready after 2s.*busy.*nothing stays reserved"):
        runtime.initialize(groups=[DeviceGroup("late", 2, "cuda")])
    assert 1.5 < time.monotonic() - t0 < 20
    assert any("waiting for placement of 'late'" in r.getMessage() for r in caplog.records)
    names = [pg["name"] for pg in ray.util.placement_group_table().values()
             if pg["state"] != "REMOVED"]
    assert not any(n.endswith("/late") for n in names)
    assert runtime.get_device_placement().count("group '") == 1  # 'late' was not added


def test_a_second_initialize_cannot_change_the_settings(runtime):
    """Guards against: a second initialize() silently ignored lazy_collect, seed, the timeouts,
    namespace and address. It can add groups; asking for other settings raises, naming each."""
    runtime.initialize(groups=[DeviceGroup("s1", 1, "cpu")], seed=7)
    runtime.initialize(groups=[DeviceGroup("s2", 1, "cpu")])  # defaults: nothing asked
    runtime.initialize(seed=7)  # the runtime's own value: fine
    for asked, named in ((dict(seed=8), "seed=8 (the runtime has 7)"),
                         (dict(lazy_collect=False), "lazy_collect=False (the runtime has True)"),
                         (dict(placement_timeout_s=5.0), "placement_timeout_s=5.0"),
                         (dict(dist_timeout_s=9.0), "dist_timeout_s=9.0"),
                         (dict(start_timeout_s=None), "start_timeout_s=None"),
                         (dict(namespace="elsewhere"), "namespace='elsewhere'"),
                         (dict(address="127.0.0.1:1"), "address='127.0.0.1:1'"),
                         (dict(num_gpus=2), "Ray's num_gpus (Ray is running)")):
        with pytest.raises(RuntimeError, match="already initialised; a second call can add groups "
                                               "but not change") as info:
            runtime.initialize(**asked)
        assert named in str(info.value), (named, str(info.value))
    from twinkle_ray.runtime.session import current

    assert sorted(current().groups) == ["s1", "s2"]


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_get_after_shutdown_raises_and_starts_no_ray(runtime):
    """Guards against: get() of a result after shutdown() started a new Ray (ray.get's auto-init) and
    left it running. It raises instead, and Ray stays down."""
    import subprocess
    import sys

    code = (
        "import twinkle_ray as t\n"
        "from twinkle_ray import DeviceGroup, remote_class, remote_function\n"
        "@remote_class()\n"
        "class W:\n"
        "    @remote_function(dispatch='all', collect='first')\n"
        "    def f(self):\n"
        "        return 1\n"
        "t.initialize(groups=[DeviceGroup('g', 1, 'cpu')], num_cpus=1)\n"
        "out = W(remote_group='g').f()\n"
        "t.shutdown()\n"
        "import ray\n"
        "for use in (out.get, out.done, lambda: t.get([out], timeout=1)):\n"
        "    try:\n"
        "        use()\n"
        "    except RuntimeError as e:\n"
        "        assert 'shutdown() was called' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
        "assert not ray.is_initialized(), 'a Ray was started'\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
