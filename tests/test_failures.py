"""Worker death, timeouts and user errors: clear errors within seconds, never a hang.

Each test provokes one fault on a 2-worker gloo gang and checks the error text,
the time from fault to error, and that ``restart()`` brings back a working
gang with a fresh torch.distributed world.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from conftest import NAMESPACE
from twinkle_ray import (
    CallTimeoutError,
    DeviceGroup,
    WorkerDiedError,
    get_rank,
    remote_class,
    remote_function,
)

FAULT_TO_ERROR_LIMIT_S = 15.0  # generous for a loaded 2-core machine; typical is well under 2 s


@remote_class()
class Fragile:
    @remote_function(dispatch="all", collect="none")
    def info(self) -> list:
        return [os.getpid(), os.environ["MASTER_PORT"]]

    @remote_function(dispatch="all", collect="first")
    def allreduce(self) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0])
        dist.all_reduce(t)
        return t.item()

    @remote_function(dispatch="all", collect="none")
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return get_rank()

    @remote_function(dispatch="all", collect="none")
    def exit_on(self, rank: int, delay: float = 0.0) -> int:
        if get_rank() == rank:
            time.sleep(delay)
            os._exit(1)
        return get_rank()

    @remote_function(dispatch="all", collect="first")
    def collective_then_exit(self, rank: int) -> float:
        import torch
        import torch.distributed as dist

        if get_rank() == rank:
            time.sleep(0.5)
            os._exit(1)
        t = torch.tensor([1.0])
        dist.all_reduce(t)  # blocks: the peer never joins
        return t.item()

    @remote_function(dispatch="all", collect="none", timeout=1.0)
    def slow_on(self, rank: int, seconds: float) -> int:
        if get_rank() == rank:
            time.sleep(seconds)
        return get_rank()

    @remote_function(dispatch="all", collect="none")
    def boom(self, rank: int) -> int:
        if get_rank() == rank:
            raise KeyError(f"boom from rank {rank}")
        return get_rank()

    @remote_function(dispatch="all", collect="none")
    def odd_error(self, rank: int) -> int:
        if get_rank() == rank:
            raise TwoArgError("disk", 7)
        return get_rank()

    @remote_function(dispatch="all", collect="first")
    def a_lock(self):
        import threading

        return threading.Lock()

    @remote_function(dispatch="all", collect="first", sync=True)
    def a_lock_eagerly(self):
        import threading

        return threading.Lock()


class TwoArgError(Exception):
    """An exception whose __init__ takes two arguments: pickle cannot rebuild it from its args."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what} failed with code {code}")
        self.what, self.code = what, code


@remote_class(max_restarts=1)
class SelfHealing(Fragile):
    pass


@remote_class()
class BadInit:
    def __init__(self, bad_rank: int):
        if get_rank() == bad_rank:
            raise RuntimeError("cannot load weights")


@pytest.fixture(scope="module")
def gang(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("f", 2, "cpu"), DeviceGroup("h", 2, "cpu")])
    g = Fragile(remote_group="f")
    yield g
    twinkle_ray.shutdown()


def _expect_death(call, rank: int, cause_part: str, t0: float) -> float:
    with pytest.raises(WorkerDiedError) as info:
        call()
    took = time.monotonic() - t0
    err = info.value
    assert (err.group, err.cls, err.rank) == ("f", "Fragile", rank)
    assert cause_part in err.cause.lower(), err.cause
    assert "group 'f'" in str(err) and f"rank {rank}" in str(err) and "restart()" in str(err)
    assert took < FAULT_TO_ERROR_LIMIT_S, took
    return took


def _restart_and_check(g, old_ports: set) -> None:
    g.restart()
    assert g.allreduce()() == 2.0
    ports = {p for _, p in g.info()()}
    assert ports and not (ports & old_ports)  # a fresh torch.distributed world


@pytest.mark.slow
def test_sigkill_idle_worker(gang):
    pids, ports = zip(*gang.info()(), strict=True)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    took = _expect_death(lambda: gang.allreduce()(), 1, "", t0)
    _expect_death(lambda: gang.info()(), 1, "", t0)  # the next call too
    print(f"\nfault-to-error sigkill-idle: {took:.2f}s")
    _restart_and_check(gang, set(ports))


@pytest.mark.slow
def test_os_exit_mid_call(gang):
    _, ports = zip(*gang.info()(), strict=True)
    t0 = time.monotonic()
    took = _expect_death(lambda: gang.exit_on(1)(), 1, "exit", t0)
    print(f"\nfault-to-error os._exit: {took:.2f}s")
    _restart_and_check(gang, set(ports))


@pytest.mark.slow
def test_ray_kill_with_call_pending(gang):
    _, ports = zip(*gang.info()(), strict=True)
    pending = gang.sleep(20)
    time.sleep(0.5)
    t0 = time.monotonic()
    name = gang.topology()["ranks"][0]["name"]  # 'f/Fragile/0', with '#n' after restarts
    assert name.startswith("f/Fragile/0")
    ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    took = _expect_death(lambda: pending.get(), 0, "ray.kill", t0)
    print(f"\nfault-to-error ray.kill pending: {took:.2f}s")
    _restart_and_check(gang, set(ports))


@pytest.mark.slow
def test_death_while_peer_blocked_in_collective(gang):
    _, ports = zip(*gang.info()(), strict=True)
    t0 = time.monotonic()
    # rank 1 dies; rank 0 is blocked in all_reduce waiting for it and must not hang
    took = _expect_death(lambda: gang.collective_then_exit(1)(), 1, "exit", t0)
    print(f"\nfault-to-error in-collective: {took:.2f}s")
    _restart_and_check(gang, set(ports))


def test_timeout_names_late_ranks(gang):
    t0 = time.monotonic()
    with pytest.raises(CallTimeoutError, match=r"slow_on\(\) on group 'f': rank\(s\) \[1\] did not answer within 1s") as info:
        gang.slow_on(1, 3.0)()
    assert info.value.ranks == [1]
    assert time.monotonic() - t0 < 10
    assert gang.sleep(0)() == [0, 1]  # the gang is still usable afterwards


def test_timeout_says_a_call_has_not_started(gang):
    # Rank 1 raises, rank 0 returns: the dispatcher's stuck check holds the next call for the
    # grace period (3 s), so that call is not on any rank when its 0.5 s timeout ends.
    with pytest.raises(KeyError):
        gang.boom(1)()
    queued = gang.sleep(0)
    with pytest.raises(CallTimeoutError, match=r"Fragile.sleep\(\) on group 'f': not started on "
                                               r"any rank within 0.5s") as info:
        queued.get(timeout=0.5)
    assert info.value.ranks == []
    assert queued.get() == [0, 1]  # it still runs, in its turn


def test_user_exception_keeps_its_type_and_names_rank(gang):
    with pytest.raises(KeyError, match="boom from rank 1") as info:
        gang.boom(1)()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "Fragile.boom() on rank 1 of group 'f'" in notes
    assert gang.sleep(0)() == [0, 1]  # not a death: the gang lives on


@pytest.mark.slow
def test_max_restarts_rebuilds_automatically(gang):
    healing = SelfHealing(remote_group="h")
    try:
        pids, _ = zip(*healing.info()(), strict=True)
        pending = healing.sleep(20)
        time.sleep(0.3)
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="rank 0 of SelfHealing in group 'h'"):
            pending.get()
        assert healing.allreduce()() == 2.0  # waits for the automatic rebuild
        new_pids = {p for p, _ in healing.info()()}
        assert not (new_pids & set(pids))
        assert healing.topology()["restarts"] == 1
    finally:
        healing.close()


@pytest.mark.slow
def test_failing_init_names_the_rank(ray_session):
    import twinkle_ray

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("i", 2, "cpu")])
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"gang i/BadInit failed to start \(rank 1\).*cannot load weights"):
            BadInit(1, remote_group="i")
        assert time.monotonic() - t0 < 60
    finally:
        twinkle_ray.shutdown()


def test_worker_died_error_reads_well_without_a_rank():
    from twinkle_ray import WorkerDiedError

    e = WorkerDiedError("g", "Model", None, None, "node lost")
    assert str(e).startswith("a worker of Model in group 'g' died (node ?): node lost.")
    assert str(WorkerDiedError("g", "Model", 1, "10.0.0.2", "x")).startswith(
        "worker rank 1 of Model in group 'g' died (node 10.0.0.2)")


def test_an_exception_pickle_cannot_rebuild_keeps_its_type_and_names_the_rank(gang):
    """Reported: an exception whose __init__ takes two arguments came back as Ray's
    UnserializableException, naming neither rank nor method. It comes back as itself."""
    with pytest.raises(TwoArgError, match="disk failed with code 7") as info:
        gang.odd_error(1)()
    assert (info.value.what, info.value.code) == ("disk", 7)
    assert "raised in Fragile.odd_error() on rank 1 of group 'f'" in "\n".join(info.value.__notes__)
    assert gang.info()()  # the gang goes on


def test_a_result_that_cannot_be_pickled_is_named_short(gang):
    """Reported: an eager call whose result cannot be pickled raised Ray's 17 KB 'put value'
    report with ANSI codes; lazily, 32 characters naming nothing. Both now name the method,
    the rank and the type, in a few lines."""
    with pytest.raises(TypeError) as lazy:
        gang.a_lock()()
    with pytest.raises(TypeError) as eager:
        gang.a_lock_eagerly()
    for info in (lazy, eager):
        text = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
        assert "Fragile.a_lock" in text and "rank 0 of group 'f'" in text, text
        assert "lock" in text and "pickle" in text, text
        assert "\x1b[" not in text and len(text) < 2500, text


def test_twinkle_get_timeout_bounds_the_whole_list(gang):
    """Reported: twinkle_ray.get([...], timeout=2) returned after 4.5 s: the timeout applied to
    each item. It bounds the whole wait."""
    import twinkle_ray

    outs = [gang.sleep(1.5) for _ in range(3)]  # 4.5 s in all, one after the other
    t0 = time.monotonic()
    with pytest.raises(CallTimeoutError):
        twinkle_ray.get(outs, timeout=2.0)
    assert time.monotonic() - t0 < 3.5  # not 4.5 (or more)
    assert twinkle_ray.get(outs) == [[0, 1]] * 3  # the values are still there


@pytest.mark.slow
def test_a_call_cut_short_by_close_says_so(ray_session):
    """Reported: a call interrupted by close() was reported as a dispatcher death with advice
    to restart(), which then refused. It says the gang was closed, and nothing died."""
    import threading

    import twinkle_ray
    from twinkle_ray import GangClosedError

    twinkle_ray.shutdown()
    twinkle_ray.initialize(groups=[DeviceGroup("f_close", 2, "cpu")])
    g = Fragile(remote_group="f_close")
    try:
        g.info()()  # the gang is up
        pending = g.sleep(30.0)
        threading.Timer(1.0, g.close, args=("closed by the test",)).start()
        with pytest.raises(GangClosedError, match=r"gang f_close/Fragile was closed \(closed by the "
                                                  r"test\) while Fragile.sleep\(\) was in flight"):
            pending.get(timeout=60)
    finally:
        twinkle_ray.shutdown()
