"""execute='peer': every item of the caller runs exactly once (pure: no Ray).

A worker of one gang (rank r of W) calls another gang of n workers with ``execute='peer'``:
its peer workers (:func:`peer_workers`) run the call, and the dispatch mode cuts the caller's
arguments over those peers only (Twinkle's rule). The oracle: the caller slicing its items over
its peers itself -- ``'slice'`` contiguously over the peer workers, ``'slice_dp'`` over the
peers' distinct data ranks (ascending; tp/pp peers of a data rank get the same part), a
dispatch function called with the number of peers and the peer's index among them.
Generated over dispatch modes x caller worlds x target meshes (dp, dp x tp, fsdp x dp, pp x dp)
x batch sizes, and checked through the collect the caller would apply ('flatten').
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from twinkle_ray.core.dispatch import (
    call_targets,
    dispatch,
    peer_workers,
    runner_splits,
    span,
    worker_data_ranks,
    worker_splits,
)
from twinkle_ray.core.mesh import DeviceMesh

MESHES = {
    "none": lambda n: None,
    "dp": lambda n: DeviceMesh.from_sizes(dp_size=n),
    "dp_tp": lambda n: DeviceMesh.from_sizes(dp_size=n // 2, tp_size=2) if n % 2 == 0 else None,
    "fsdp_dp": lambda n: DeviceMesh.from_sizes(fsdp_size=2, dp_size=n // 2) if n % 2 == 0 else None,
    "pp_dp": lambda n: DeviceMesh.from_sizes(pp_size=2, dp_size=n // 2) if n % 2 == 0 else None,
    "tp_only": lambda n: DeviceMesh.from_sizes(dp_size=1, tp_size=n),
    "dp_tp4": lambda n: DeviceMesh.from_sizes(dp_size=n // 4, tp_size=4) if n % 4 == 0 else None,
    "pp_dp_tp": lambda n: (DeviceMesh.from_sizes(pp_size=2, dp_size=n // 4, tp_size=2)
                           if n % 4 == 0 else None),
}


def _strided(n, i, args, kwargs, mesh):
    return (args[0][i::n], *args[1:]), kwargs


@st.composite
def peer_calls(draw):
    n = draw(st.sampled_from([1, 2, 4, 6, 8]))
    mesh = MESHES[draw(st.sampled_from(sorted(MESHES)))](n)
    world = draw(st.integers(1, 8))
    rank = draw(st.integers(0, world - 1))
    mode = draw(st.sampled_from(["slice", "slice_dp", "all", "fn"]))
    runners = call_targets("peer", (rank, world), n, mesh)
    if mode == "slice_dp":
        _, data_ranks = worker_data_ranks(n, mesh)
        parts = len({data_ranks[r] for r in runners})
    else:
        parts = len(runners)
    size = draw(st.integers(parts, parts + 9))
    kind = draw(st.sampled_from(["list", "array"] if mode == "slice_dp" else ["list"]))
    items = list(range(100, 100 + size))
    batch = np.array(items) if kind == "array" else items
    return n, mesh, rank, world, mode, runners, batch


def _as_list(x):
    return x.tolist() if isinstance(x, np.ndarray) else list(x)


@given(peer_calls())
def test_a_peer_call_runs_every_item_of_its_caller_exactly_once(case):
    n, mesh, rank, world, mode, runners, batch = case
    disp = _strided if mode == "fn" else mode
    per_worker = dispatch(disp, n, (batch, "scalar"), {"k": 1}, device_mesh=mesh, runners=runners)
    assert len(per_worker) == n
    got = [per_worker[r] for r in runners]  # only the peers run
    for args, kwargs in got:
        assert args[1] == "scalar" and kwargs == {"k": 1}  # scalars go whole
    parts = [_as_list(a[0]) for a, _ in got]
    items = _as_list(batch)
    if mode == "all":
        assert all(p == items for p in parts)
        return
    if mode == "fn":  # the function sees the peers as the whole gang
        k = len(runners)
        assert parts == [items[j::k] for j in range(k)]
        assert sorted(x for p in parts for x in p) == items
        return
    if mode == "slice":  # oracle: the caller cuts its items contiguously over its peers
        k = len(runners)
        assert parts == [items[slice(*span(len(items), k, j))] for j in range(k)]
        assert [x for p in parts for x in p] == items
        return
    # slice_dp: the peers' distinct data ranks share the items; peers of a data rank agree
    _, data_ranks = worker_data_ranks(n, mesh)
    ours = sorted({data_ranks[r] for r in runners})
    by_dr = {}
    for r, p in zip(runners, parts, strict=True):
        assert by_dr.setdefault(data_ranks[r], p) == p
    assert [by_dr[d] for d in ours] == [items[slice(*span(len(items), len(ours), j))]
                                         for j in range(len(ours))]



@given(peer_calls())
def test_a_routed_value_is_cut_as_a_passed_one(case):
    """The splits a LazyResult argument of a peer call is cut by are the dispatch's own."""
    n, mesh, rank, world, mode, runners, batch = case
    if mode not in ("slice", "slice_dp"):
        return
    splits = worker_splits(mode, n, device_mesh=mesh, runners=runners)
    assert [splits[r] for r in runners] == runner_splits(mode, n, runners, device_mesh=mesh)


def test_two_callers_into_four_workers_split_over_their_own_peers():
    """The issue's case: 2 callers into a 4-worker gang; before the fix, half of each caller's
    items were cut for workers that never ran."""
    for rank in range(2):
        runners = peer_workers(rank, 2, 4)
        per_worker = dispatch("slice", 4, (list(range(6)),), {}, runners=runners)
        assert [per_worker[r][0][0] for r in runners] == [[0, 1, 2], [3, 4, 5]]


def _groups(n, mesh):
    """The target's data-parallel groups: data rank -> its workers (tp/pp peers)."""
    _, data_ranks = worker_data_ranks(n, mesh)
    out = {}
    for w, d in enumerate(data_ranks):
        out.setdefault(d, []).append(w)
    return out


@given(st.sampled_from([4, 6, 8]), st.sampled_from(["dp_tp", "pp_dp", "tp_only", "dp_tp4",
                                                    "pp_dp_tp"]), st.integers(1, 9),
       st.integers(0, 6), st.sampled_from(["slice", "slice_dp", "fn"]))
def test_peers_are_whole_data_parallel_groups(n, mesh_name, world, extra, mode):
    """Callers whose world does not align with the target's tp/pp groups: every group of the
    target runs all or none of each call (a tp group split over two callers hangs in its
    collective or mixes their batches), and every caller's items run exactly once."""
    mesh = MESHES[mesh_name](n)
    if mesh is None:
        return
    groups = _groups(n, mesh)
    used = set()
    for rank in range(world):
        runners = call_targets("peer", (rank, world), n, mesh)
        assert runners == sorted(runners) and runners
        for workers in groups.values():
            assert set(workers) <= set(runners) or not set(workers) & set(runners), \
                f"caller {rank}/{world}: group {workers} split, runners {runners}"
        used.update(runners)
        if mode == "slice_dp":
            size = len({d for d, ws in groups.items() if set(ws) <= set(runners)}) + extra
        else:
            size = len(runners) + extra
        items = list(range(size))
        disp = _strided if mode == "fn" else mode
        per_worker = dispatch(disp, n, (items,), {}, device_mesh=mesh, runners=runners)
        if mode == "slice_dp":  # each group's peers get one part; the parts cover the items once
            parts = []
            for workers in groups.values():
                if workers[0] in runners:
                    got = {tuple(per_worker[w][0][0]) for w in workers}
                    assert len(got) == 1
                    parts.extend(got.pop())
        else:
            parts = [x for r in runners for x in per_worker[r][0][0]]
        assert sorted(parts) == items
    if world >= len(groups):  # enough callers: every group answers one of them
        assert used == set(range(n))


def test_three_callers_into_a_tp2_gang_of_four():
    """The reviewer's case (caller dp=3 into dp2 x tp2): before the fix caller 1 ran on worker
    2 alone and caller 2 on worker 3 alone, one tp group serving two callers' calls."""
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    assert [call_targets("peer", (r, 3), 4, mesh) for r in range(3)] == [[0, 1], [0, 1], [2, 3]]
    assert [call_targets("peer", (r, 3), 4) for r in range(3)] == [[0, 1], [2], [3]]  # no mesh


def test_runners_outside_the_gang_are_refused():
    with pytest.raises(ValueError, match=r"distinct ranks of the 2 worker\(s\), got \[2\]"):
        dispatch("slice", 2, ([1, 2],), {}, runners=[2], method="m", group="g")
