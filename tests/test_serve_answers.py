"""A Serve replica's call gives each request the answer to its own input, on any mesh.

Pure part (no Ray): the rule :meth:`ReplicaGang.call` applies -- the method's own dispatch cuts
the padded batch, every worker answers its slice (the tp/pp peers of a data rank the same
slice; a pipeline's earlier stages something else), and the call is collected with
:func:`twinkle_ray.serve.per_item_spec`'s collect -- checked against the oracle (the answer to
each item, in input order) over meshes (dp, dp x tp, fsdp x dp, pp x dp, none) x batch sizes.
The Ray part is in test_replica_policy: a replica (a plain actor on a replica-shaped placement
group) on an fsdp=2 x dp=2 gang answers each request its own input, across a dispatcher kill.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from twinkle_ray.core.dispatch import collect, collect_sources, dispatch
from twinkle_ray.core.functions import RemoteFunction
from twinkle_ray.core.mesh import DeviceMesh
from twinkle_ray.serve import per_item_spec

MESHES = {
    "none": lambda: (4, None),
    "dp": lambda: (4, DeviceMesh.from_sizes(dp_size=4)),
    "dp_tp": lambda: (4, DeviceMesh.from_sizes(dp_size=2, tp_size=2)),
    "fsdp_dp": lambda: (4, DeviceMesh.from_sizes(fsdp_size=2, dp_size=2)),
    "pp_dp": lambda: (4, DeviceMesh.from_sizes(pp_size=2, dp_size=2)),
    "pp_dp_tp": lambda: (8, DeviceMesh.from_sizes(pp_size=2, dp_size=2, tp_size=2)),
    "fsdp_dp_tp": lambda: (8, DeviceMesh.from_sizes(fsdp_size=2, dp_size=2, tp_size=2)),
}


def _answer(prompt: str) -> str:
    return f"answer to {prompt}"


def _served(mesh_name: str, n_requests: int, pad=None) -> list:
    """What ReplicaGang.call answers, computed with the pure rules it runs by."""
    n_workers, mesh = MESHES[mesh_name]()
    spec = per_item_spec(RemoteFunction(None, dispatch="slice_dp", collect="flatten"), "generate")
    dp = mesh.data_world_size if mesh is not None else n_workers
    items = [f"p{i}" for i in range(n_requests)]
    padded = items + [pad] * max(0, dp - len(items))
    per_worker = dispatch(spec.dispatch, n_workers, (padded,), {}, device_mesh=mesh)
    last = set(mesh.get_pp_last_ranks()) if mesh is not None else set(range(n_workers))
    results = []
    for w, (args, _) in enumerate(per_worker):
        if w in last:
            results.append([None if p is None else _answer(p) for p in args[0]])
        else:  # an earlier pipeline stage: no answers of its own
            results.append(["stage output"] * len(args[0]))
    assert collect_sources(spec.collect, range(n_workers), device_mesh=mesh)  # reads some
    values = collect(spec.collect, results, device_mesh=mesh, worker_indices=range(n_workers))
    assert len(values) == len(padded)
    return values[:n_requests]


@given(st.sampled_from(sorted(MESHES)), st.integers(1, 13))
def test_each_request_gets_the_answer_to_its_own_input(mesh_name, n_requests):
    assert _served(mesh_name, n_requests) == [_answer(f"p{i}") for i in range(n_requests)]


@pytest.mark.parametrize("mesh_name", ["dp_tp", "fsdp_dp"])
def test_the_issues_meshes(mesh_name):
    """The issue's cases: dp=2 x tp=2 answered [p0, p1, p0, p1]; fsdp=2 x dp=2 [p0, p2, p1, p3]."""
    assert _served(mesh_name, 4) == [_answer(p) for p in ["p0", "p1", "p2", "p3"]]


def test_a_balanced_method_keeps_its_collect_and_others_are_refused():
    spec = per_item_spec(RemoteFunction(None, dispatch="balance", collect="flatten", sync=True))
    assert (spec.dispatch, spec.collect, spec.sync) == ("balance", "flatten", False)
    with pytest.raises(ValueError, match=r"generate\(\) has dispatch='all', collect='none'"):
        per_item_spec(RemoteFunction(None, dispatch="all", collect="none"), "generate")
