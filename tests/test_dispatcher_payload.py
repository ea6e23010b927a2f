"""The dispatcher never unpickles the user's class or its constructor arguments.

They travel to the workers as one object-store ref that only the workers resolve: a dispatcher
that unpickled them imported what they import (torch, the user's module: ~2.4 s of CPU and
~180 MB per gang on a 2-core machine, on the critical path of every gang start and rebuild).
A caller that finds the gang by name still gets a proxy of the right class.
"""

from __future__ import annotations

import os
import uuid

import pytest
import ray
from ray.util import state

from twinkle_ray import DeviceGroup, remote_class, remote_function
from twinkle_ray.runtime.proxy import GangProxy


class Traced:
    """Writes ``<what>-<pid>-<uuid>`` into ``trace_dir`` whenever it is unpickled."""

    def __init__(self, trace_dir: str, what: str):
        self.trace_dir, self.what = trace_dir, what

    def __reduce__(self):
        return (_arrived, (self.trace_dir, self.what))


def _arrived(trace_dir: str, what: str) -> Traced:
    with open(os.path.join(trace_dir, f"{what}-{os.getpid()}-{uuid.uuid4().hex}"), "w"):
        pass
    return Traced(trace_dir, what)


def _unpickled_in(trace_dir, what: str) -> set[int]:
    return {int(name.split("-")[1]) for name in os.listdir(trace_dir) if name.startswith(what + "-")}


def _dispatcher_pid(label: str) -> int:
    address = ray.get_runtime_context().gcs_address
    [actor] = state.list_actors(address=address, filters=[("name", "=", label), ("state", "=", "ALIVE")])
    return int(actor["pid"])


def _traced_class(trace_dir: str):
    """A class defined here (cloudpickle ships it by value, its attributes with it) that carries
    a tracer: every process that unpickles the class leaves a 'class-' trace."""

    @remote_class()
    class Model:
        tag = Traced(trace_dir, "class")

        def __init__(self, arg: Traced, *, kwarg: Traced):
            self.arg, self.kwarg = arg, kwarg

        @remote_function(dispatch="all", collect="none")
        def pid(self) -> int:
            return os.getpid()

    return Model


def _check(trace: str, workers: set[int], dispatcher: int) -> None:
    assert len(workers) == 2 and dispatcher not in workers
    for what in ("class", "arg", "kwarg"):
        where = _unpickled_in(trace, what)
        assert workers <= where, (what, where, workers)  # the workers built the instance from them
        assert dispatcher not in where, f"the dispatcher (pid {dispatcher}) unpickled the {what}"


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_the_dispatcher_never_unpickles_the_class_or_its_arguments(runtime, tmp_path):
    trace = str(tmp_path)
    runtime.initialize(groups=[DeviceGroup("g", 2, "cpu")])
    model = _traced_class(trace)(Traced(trace, "arg"), kwarg=Traced(trace, "kwarg"), remote_group="g")
    _check(trace, set(model.pid()()), _dispatcher_pid(model.label))


@pytest.mark.slow
def test_a_rebuild_gives_the_new_workers_the_same_class_and_arguments(runtime, tmp_path):
    """restart(): the rebuilt ranks build their instances from the same ref, the dispatcher
    (the same one) still never unpickles it."""
    trace = str(tmp_path)
    runtime.initialize(groups=[DeviceGroup("g", 2, "cpu")])
    model = _traced_class(trace)(Traced(trace, "arg"), kwarg=Traced(trace, "kwarg"), remote_group="g")
    before = set(model.pid()())
    model.restart()
    after = set(model.pid()())
    assert not before & after  # new worker processes
    _check(trace, after, _dispatcher_pid(model.label))


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_a_gang_found_by_name_has_its_class(runtime, tmp_path):
    """GangProxy.lookup: the dispatcher hands out a proxy of the gang's class (it resolves the
    class only then, for that caller, and never the constructor's arguments); calls through it
    reach the same workers."""
    runtime.initialize(groups=[DeviceGroup("g", 2, "cpu")])
    Model = _traced_class(str(tmp_path))
    model = Model(Traced(str(tmp_path), "arg"), kwarg=Traced(str(tmp_path), "kwarg"), remote_group="g")
    found = GangProxy.lookup(model.label, namespace=ray.get_runtime_context().namespace)
    assert found.label == model.label and found.n_workers == 2
    assert sorted(found.pid()()) == sorted(model.pid()())
    dispatcher = _dispatcher_pid(model.label)  # it resolved the class for the lookup, never the arguments
    assert all(dispatcher not in _unpickled_in(str(tmp_path), what) for what in ("arg", "kwarg"))
    with pytest.raises(AttributeError, match=r"Model has no method 'nope' \(gang on group 'g'\)"):
        found.nope  # noqa: B018 (the proxy knows the class's methods)


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_a_class_the_workers_cannot_import_is_named_with_the_fix(runtime, tmp_path, monkeypatch):
    """A module only the driver can import: the start fails in the workers (they unpickle the
    class), naming the gang, the rank, the class, Python's error and the fix; nothing is left."""
    (tmp_path / "driver_only_mod.py").write_text(
        "from twinkle_ray import remote_class\n\n\n"
        "@remote_class()\n"
        "class DriverOnly:\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # here, not in the workers' PYTHONPATH
    import driver_only_mod

    runtime.initialize(groups=[DeviceGroup("g", 2, "cpu")])
    with pytest.raises(TypeError, match=r"gang g/DriverOnly failed to start \(rank \d\): TypeError: DriverOnly or "
                                           r"its constructor arguments cannot be unpickled in this Ray worker "
                                           r"\(ModuleNotFoundError: No module named 'driver_only_mod'\): a module "
                                           r"workers cannot import\? ship it with runtime_env working_dir/py_modules"):
        driver_only_mod.DriverOnly(remote_group="g")


@remote_class(distributed=False)
class Sink:
    @remote_function(dispatch="all", collect="first")
    def take(self, value) -> int:
        return len(value.blob)

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


class Payload:
    """A user's class holding 8 MB and a tracer; its size is not on its surface (no nbytes)."""

    def __init__(self, trace_dir: str):
        self.blob = b"x" * (8 << 20)
        self.tag = Traced(trace_dir, "payload")


@pytest.mark.slow  # seconds (measured in the quick tier: 5 s or more, or its module's shared gang)
def test_a_large_argument_of_a_users_class_never_reaches_the_dispatcher(runtime, tmp_path):
    """Guards against: an 8 MB dataclass argument was unpickled by the dispatcher (its size was
    guessed at 64 bytes: no ``nbytes``). The caller measures each argument's pickle: 8 MB goes
    to the object store, and only the ranks unpickle it."""
    trace = str(tmp_path)
    runtime.initialize(groups=[DeviceGroup("g", 2, "cpu")])
    sink = Sink(remote_group="g")
    assert sink.take(Payload(trace))() == 8 << 20
    workers, dispatcher = set(sink.pid()()), _dispatcher_pid(sink.label)
    where = _unpickled_in(trace, "payload")
    assert workers <= where and dispatcher not in where, (where, workers, dispatcher)
    small = Traced(trace, "small")  # a small one rides in the call's bytes: not unpickled there
    assert sink.take(type("P", (), {"blob": b"ab", "tag": small})())() == 2
    assert dispatcher not in _unpickled_in(trace, "small")
