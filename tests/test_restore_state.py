"""A restored state equals the saved one, is the rank's own (writable, independent of the saved
copy), whichever documented way saved it: in memory, ``path=``, inside a ``CheckpointDir`` save.

Pure part: the places a saved file is looked for (``checkpoint.saved_places``), generated. Ray
part: one module gang of one worker, rebuilt by ``restart()``; its state holds every shape a
``state_dict()`` has (numpy arrays, a 0-d one, torch tensors, dicts, nested lists and tuples, a
large array, scalars). After each restore the rank checks, in place, that every array is
writable and equal to the saved one, then changes it in place; a second restore from the same
save gives the saved values again (the first restore did not write into the saved copy).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import leftovers
from twinkle_ray import (
    DeviceGroup,
    GangRestartedError,
    WorkerDiedError,
    remote_class,
    remote_function,
)
from twinkle_ray.checkpoint import CheckpointDir, find_saved, own_state, saved_places


def make_state(seed: int) -> dict:
    import torch

    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((3, 4)),
        "scalar_array": np.array(seed, dtype=np.int64),
        "ints": rng.integers(0, 100, size=7, dtype=np.int32),
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3) + seed,
        "nested": {"m": [rng.standard_normal(2), (np.ones(3) * seed, {"deep": np.zeros(2) + seed})]},
        "large": np.full(300_000, float(seed)),  # 2.4 MB: stored out of band by Ray
        "step": seed,
        "name": f"state-{seed}",
    }


def _arrays(value, path=""):
    """(path, leaf) for every numpy array and tensor in ``value``."""
    import torch

    if isinstance(value, dict):
        for k, v in value.items():
            yield from _arrays(v, f"{path}/{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _arrays(v, f"{path}[{i}]")
    elif isinstance(value, np.ndarray | torch.Tensor):
        yield path, value


def _same(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@remote_class()
class Keeper:
    def __init__(self):
        self.state = make_state(0)

    @remote_function(dispatch="all", collect="first")
    def set_seed(self, seed: int) -> None:
        self.state = make_state(seed)

    @remote_function(dispatch="all", collect="first")
    def check_and_touch(self, seed: int) -> list:
        """What is wrong with the restored state (expected: ``make_state(seed)``), then every
        array changed in place, as a training step would."""
        wrong = [] if _same(self.state, make_state(seed)) else ["values differ"]
        for where, leaf in _arrays(self.state):
            try:
                leaf += 1  # in place: a read-only array raises ValueError here
            except (ValueError, RuntimeError) as e:
                wrong.append(f"{where}: {type(e).__name__}: {e}")
        return wrong

    @remote_function(dispatch="all", collect="first")
    def slow(self, seconds: float, started: str | None = None) -> str:
        import time

        if started:  # tells the test the call is running on the rank
            open(started, "w").close()
        time.sleep(seconds)
        return "done"

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


@pytest.fixture(scope="module")
def keeper(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("keep", 1, "cpu")])
    yield Keeper(remote_group="keep")
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors and not pgs, (actors, pgs)


@pytest.mark.slow  # two restarts of a one-worker gang per way of saving
@pytest.mark.parametrize("way", ["memory", "path", "checkpoint_dir"])
def test_a_restored_state_equals_the_saved_one_and_is_the_ranks_own(keeper, way, tmp_path):
    seed = {"memory": 11, "path": 12, "checkpoint_dir": 13}[way]
    keeper.set_seed(seed)()
    if way == "memory":
        keeper.save_state()
    elif way == "path":
        keeper.save_state(path=str(tmp_path / "states"))
    else:  # the documented way (examples/checkpointing.py): inside a CheckpointDir save
        ckpt = CheckpointDir(str(tmp_path / "ckpt"))
        with ckpt.save(seed) as tmp:
            keeper.save_state(os.path.join(tmp, "keeper"))
        assert os.path.isfile(ckpt.latest().file("keeper", "rank0.pt"))  # renamed away
    keeper.set_seed(99)()  # lost by the restore
    for _ in range(2):  # the second restore reads the same save: the first did not change it
        keeper.restart()
        assert keeper.check_and_touch(seed)() == []


@pytest.mark.slow  # a restart of a one-worker gang
def test_a_call_in_flight_during_its_callers_restart_says_so(keeper, tmp_path):
    """Nothing died: not WorkerDiedError ("a worker died ... call .restart()"), but what
    happened, as close() gives GangClosedError; the gang is up again."""
    started = tmp_path / "started"
    pending = keeper.slow(60.0, str(started))
    keeper.slow(0.0)  # queued behind it
    deadline = time.monotonic() + 60
    while not started.exists():  # restart() only once the call runs on the rank (not before
        assert time.monotonic() < deadline, "slow() never started"  # it reached the worker)
        time.sleep(0.05)
    keeper.restart()
    with pytest.raises(GangRestartedError, match=r"gang keep/Keeper was restarted \(restart\(\)\) "
                                                 r"while Keeper.slow\(\) was in flight") as info:
        pending.get(timeout=60)
    assert not isinstance(info.value, WorkerDiedError)
    assert keeper.slow(0.0)() == "done"


@pytest.mark.slow  # three restarts of a one-worker gang
def test_a_save_aborted_or_pruned_falls_back_to_the_one_before_it_then_to_the_constructor(
        keeper, tmp_path):
    """Guards against: after a complete save(10), an aborted save(20) (its folder deleted) left
    the gang pointing at it: restart() failed with FileNotFoundError, every later call and
    restart() raised GangRebuildError, and the complete save was never tried. Now: the newest
    save still found is restored; with none left, the rebuild names the missing files and the
    next restart() rebuilds from the constructor."""
    from twinkle_ray.runtime.errors import GangRebuildError

    ckpt = CheckpointDir(str(tmp_path / "ckpt"), keep=2)
    keeper.save_state()  # in memory: the module's earlier saves to files are forgotten
    keeper.set_seed(21)()
    with ckpt.save(10) as tmp:
        keeper.save_state(os.path.join(tmp, "keeper"))
    keeper.set_seed(22)()
    with pytest.raises(RuntimeError, match="aborted"), ckpt.save(20) as tmp:
        keeper.save_state(os.path.join(tmp, "keeper"))
        raise RuntimeError("aborted")
    keeper.set_seed(99)()
    keeper.restart()
    assert keeper.check_and_touch(21)() == []  # step 10's state, the newest still found
    pruning = CheckpointDir(str(tmp_path / "ckpt"), keep=1)
    with pruning.save(30) as tmp:  # other data only: step 10 is pruned
        open(os.path.join(tmp, "other.txt"), "w").close()
    assert not os.path.exists(ckpt.path(10))
    with pytest.raises(GangRebuildError, match=r"no saved state of gang keep/Keeper is found any "
                                               r"more .*step-000010/keeper/rank0\.pt"):
        keeper.restart()
    keeper.restart()  # restartable: from the constructor
    assert keeper.check_and_touch(0)() == []


# ------------------------------------------------------------------------------- pure part
_names = st.text("abcxyz0123456789_", min_size=1, max_size=6)


@given(st.lists(_names, max_size=3), st.integers(0, 999_999), st.lists(_names, min_size=1, max_size=3))
def test_a_file_saved_inside_a_checkpoint_save_is_found_after_its_rename(before, step, after):
    root = os.sep + os.path.join("ck", *before)
    tmp = os.path.join(root, f".tmp-step-{step:06d}-123-ab12cd34")
    places = saved_places(os.path.join(tmp, *after))
    assert places == [os.path.join(tmp, *after),
                      os.path.join(root, f"step-{step:06d}", *after)]
    assert saved_places(os.path.join(root, *after)) == [os.path.join(root, *after)]


def test_find_saved_prefers_the_temporary_place_then_the_renamed_one(tmp_path):
    ckpt = CheckpointDir(str(tmp_path))
    with ckpt.save(4) as tmp:
        file = os.path.join(tmp, "g", "rank0.pt")
        os.makedirs(os.path.dirname(file))
        open(file, "w").close()
        assert find_saved(file) == file  # a rebuild inside the with block
    assert find_saved(file) == ckpt.path(4) + "/g/rank0.pt"
    ckpt.prune(1)
    with ckpt.save(5):
        pass
    ckpt.prune(1)  # step 4 removed: the error names both places
    with pytest.raises(FileNotFoundError, match=r"looked at .*\.tmp-step-000004.*, .*step-000004"):
        find_saved(file)


def _states():
    """State shapes: numpy arrays (dtypes, 0-d, empty, large), torch tensors, dicts, lists,
    tuples, nesting, scalars."""
    import torch
    from hypothesis.extra import numpy as hnp

    arrays = hnp.arrays(st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_]),
                        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    large = st.just(np.arange(300_000, dtype=np.float64))  # 2.4 MB: out of band in Ray
    tensors = st.lists(st.floats(-1e3, 1e3), max_size=6).map(
        lambda xs: torch.tensor(xs, dtype=torch.float64))
    leaves = arrays | large | tensors | st.integers() | st.text(max_size=4) | st.none()
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3)
                        | st.tuples(inner, inner)
                        | st.dictionaries(st.text("abc", min_size=1, max_size=3), inner, max_size=3),
                        max_leaves=8)


def _from_object_store(state):
    """What a worker gets from Ray's object store: pickle 5 with out-of-band buffers, read
    back zero-copy from read-only memory (as Ray's plasma store hands them)."""
    import pickle

    buffers = []
    data = pickle.dumps(state, protocol=5, buffer_callback=buffers.append)
    readonly = [memoryview(bytes(b.raw())) for b in buffers]  # bytes: immutable
    return pickle.loads(data, buffers=readonly)


@settings(max_examples=60)  # a few large arrays among them: kept cheap for the quick tier
@given(_states())
def test_a_state_from_the_object_store_is_made_the_ranks_own(state):
    import torch

    stored = _from_object_store(state)
    mine = own_state(stored)
    assert _same(mine, state)  # equal, dtypes and shapes kept
    for (_, leaf), (_, kept) in zip(_arrays(mine), _arrays(stored), strict=True):
        if isinstance(leaf, np.ndarray):
            assert leaf.flags.writeable and not np.shares_memory(leaf, kept)
            leaf[...] = 0 if leaf.dtype != np.bool_ else False  # in place: the save is untouched
        elif isinstance(leaf, torch.Tensor):
            assert leaf.data_ptr() != kept.data_ptr() or leaf.numel() == 0
            leaf.zero_()
    assert _same(stored, state)



class _Rank:
    """A worker stand-in for Builder's choice of the save to restore: finds the files in
    ``existing``."""

    def __init__(self, existing: set):
        self.existing = existing
        self.saved_found = self

    def remote(self, files):
        async def answer():
            return [f in self.existing for f in files]

        return answer()


def _builder(saves):
    from types import SimpleNamespace

    from twinkle_ray.runtime.build import Builder

    b = Builder.__new__(Builder)
    b.state = SimpleNamespace(spec=SimpleNamespace(label="g/K"))
    b.saves, b.saves_lost = [], None
    for save in saves:
        b.keep_save(save)
    return b


def test_a_rebuild_restores_the_newest_save_every_rank_finds_and_says_which(caplog):
    import asyncio
    import logging

    saves = [[f"/ck/step-{s}/rank0.pt", f"/ck/step-{s}/rank1.pt"] for s in (10, 20, 30)]
    ranks = [_Rank({saves[0][0], saves[1][0]}), _Rank({saves[0][1]})]  # step 20: rank 1 lacks it
    b = _builder(saves)
    with caplog.at_level(logging.INFO, logger="twinkle_ray.runtime.build"):
        assert asyncio.run(b._restorable(ranks)) == saves[0]
    assert "restoring an older state, saved in /ck/step-10: the 2 newer save(s) are gone " \
           "(/ck/step-30, /ck/step-20)" in caplog.text
    assert b.saves == [saves[0]]  # the ones gone are not looked for again
    caplog.clear()
    everything = _Rank({f for save in saves for f in save})
    b = _builder(saves)
    with caplog.at_level(logging.INFO, logger="twinkle_ray.runtime.build"):
        assert asyncio.run(b._restorable([everything, everything])) == saves[2]
    assert "restoring the state saved in /ck/step-30" in caplog.text
    ref = object()  # a save in memory: always there, nothing asked
    assert asyncio.run(_builder([*saves, [ref, ref]])._restorable([None, None])) == [ref, ref]


def test_a_rebuild_without_any_save_left_names_the_files_then_starts_from_the_constructor(caplog):
    import asyncio
    import logging

    saves = [[f"/ck/step-{s}/rank0.pt"] for s in (10, 20, 30, 40)]
    b = _builder(saves)
    assert b.saves == saves[1:]  # the last three
    with pytest.raises(FileNotFoundError, match=r"no saved state of gang g/K is found any more "
                                                r".*missing /ck/step-40/rank0.pt; "
                                                r"/ck/step-30/rank0.pt; /ck/step-20/rank0.pt\. "
                                                r"The next restart\(\) rebuilds it from its "
                                                r"constructor"):
        asyncio.run(b._restorable([_Rank(set())]))
    with caplog.at_level(logging.WARNING, logger="twinkle_ray.runtime.build"):
        assert asyncio.run(b._restorable([_Rank(set())])) is None
    assert "gang g/K: rebuilt from its constructor, without a saved state (none of its 3 last " \
           "save(s) to files is found any more" in caplog.text
    caplog.clear()
    assert asyncio.run(b._restorable([_Rank(set())])) is None  # said once
    assert not caplog.text
