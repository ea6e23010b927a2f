"""A Twinkle-style script (tests/twinkle_style_script.py) run on Ray with ``twinkle`` aliased
to twinkle_ray; checks what each rank saw. Also: closed gangs leave the runtime's table,
and initialize's start/dist timeouts reach the runtime.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

import twinkle_ray

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def twinkle_alias():
    saved = {k: v for k, v in sys.modules.items() if k == "twinkle" or k.startswith("twinkle.")}
    sys.modules["twinkle"] = twinkle_ray
    sys.modules["twinkle.infra"] = twinkle_ray.infra
    yield
    for k in [k for k in sys.modules if k == "twinkle" or k.startswith("twinkle.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def _load_script():
    """Import the script as a module whose classes travel by value (workers have no
    ``twinkle`` alias; what the classes use of it are twinkle_ray objects, pickled by name)."""
    import ray.cloudpickle

    spec = importlib.util.spec_from_file_location("twinkle_style_script",
                                                  os.path.join(HERE, "twinkle_style_script.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    ray.cloudpickle.register_pickle_by_value(mod)
    return mod


@pytest.mark.slow
def test_twinkle_style_script_on_ray(runtime, twinkle_alias):
    import ray.cloudpickle

    script = _load_script()
    try:
        out = script.main()
    finally:
        ray.cloudpickle.unregister_pickle_by_value(script)
        sys.modules.pop("twinkle_style_script", None)

    # who(): from_sizes(fsdp=2, dp=2) -> mesh (fsdp, dp); rank r: fsdp r // 2, dp r % 2;
    # Twinkle's data rank dp * 2 + fsdp; slice_dp gives data rank d items [2d, 2d + 2).
    by_rank: dict[int, list] = {}
    for row in out["seen"]:
        by_rank.setdefault(row["rank"], []).append(row)
    assert sorted(by_rank) == [0, 1, 2, 3]
    for r, rows in by_rank.items():
        fsdp, dp = r // 2, r % 2
        data = dp * 2 + fsdp
        assert [row["item"] for row in rows] == [2 * data, 2 * data + 1], r
        for row in rows:
            assert (row["fsdp_rank"], row["dp_rank"], row["data_rank"]) == (fsdp, dp, data)
            assert (row["pp_rank"], row["tp_rank"]) == (None, None)
            assert (row["world_size"], row["local_rank"], row["is_master"]) == (4, r, r == 0)
    # flatten joins the workers' results in worker order (as Twinkle's does)
    assert [row["item"] for row in out["seen"]] == [0, 1, 4, 5, 2, 3, 6, 7]

    # last_pp_first on from_sizes(pp=2, dp=2): the last stage is ranks 2, 3 -> rank 2's result
    assert out["metric"] == {"rank": 2, "pp_rank": 1}
    # ... and routed lazily into another gang: each reader worker gets that one result
    assert out["routed"] == [{"rank": 0, "value": {"rank": 2, "pp_rank": 1}},
                             {"rank": 1, "value": {"rank": 2, "pp_rank": 1}}]
    # a custom dispatch function and a custom collect
    assert out["picked"] == [10, 21, 32, 43]
    # get_device_placement takes Twinkle's list of DeviceGroup objects
    assert "group 'actor': 4 worker(s)" in out["placement"]
    assert "group 'reader': 2 worker(s)" in out["placement"]


@pytest.mark.slow
def test_closed_gangs_leave_the_table_and_timeouts_reach_the_runtime(runtime):
    from twinkle_ray import DeviceGroup, remote_class
    from twinkle_ray.runtime import session

    @remote_class()
    class Echo:
        def ping(self):
            return twinkle_ray.get_rank()

    runtime.initialize("ray", groups=[DeviceGroup("g", 2, "cuda")], start_timeout_s=90.0,
                       dist_timeout_s=45.0)
    rt = session.current()
    assert (rt.start_timeout_s, rt.dist_timeout_s) == (90.0, 45.0)
    first = Echo(remote_group="g")
    assert first.ping()() == [0, 1]
    assert rt.gangs == [first] and rt.claimed["g"] == {0, 1}
    first.close()
    assert rt.gangs == [] and rt.claimed["g"] == set() and rt.owned == {}
    assert "gang g/Echo" not in runtime.get_device_placement()
    second = Echo(remote_group="g")  # takes the devices again (it owns its bundles)
    assert rt.gangs == [second] and rt.claimed["g"] == {0, 1}
    assert second.ping()() == [0, 1]
