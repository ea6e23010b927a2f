"""Shared fixtures: one Ray instance per test session, loopback only.

``ray_session`` starts Ray once with 8 virtual GPUs and 16 virtual CPUs (the
machine has 2 cores; virtual CPUs only let more actors be placed).
``runtime`` gives a test a fresh twinkle_ray runtime on that Ray and, after
the test, shuts it down and checks that nothing of ours is left: no live
actor in the test namespace and no placement group of ours.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import time

# Ray binds every service to loopback (read when ray is imported: before that, here). Ray 2.60 has
# no public ray.init argument for it; twinkle_ray.initialize() sets it for its embedded Ray the same way.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Every Ray process exports its metrics every 2 s (Ray: 10 s), so test_metrics sees a value soon
# after it is recorded; read by Ray at start-up, hence here.
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Generated cases (hypothesis): a fixed budget by default, so the suite's time is known; the
# 'long' profile for a deeper run: pytest --hypothesis-profile=long
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True,
                          print_blob=True)
settings.register_profile("long", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("TWINKLE_HYPOTHESIS_PROFILE", "ci"))

NAMESPACE = "twinkle-tests"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# the checkout the tests run from (a git worktree included): its twinkle_ray, not the one the
# venv's editable install points at, in the driver and in every Ray worker
REPO_ROOT = os.path.dirname(TESTS_DIR)
NUM_GPUS = 8
NUM_CPUS = 16


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # our own Ray, whatever a stale /tmp/ray/ray_current_cluster names
            num_cpus=NUM_CPUS,
            num_gpus=NUM_GPUS,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            namespace=NAMESPACE,
            log_to_driver=False,
            # Workers import classes defined in test modules by reference.
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO_ROOT])}},
        )
    yield ray
    ray.shutdown()


# ------------------------------------------------------------------ a worker that died by itself
# "The actor is dead because its worker process has died ... End of file" names no cause: the
# cause (a segfault, an abort, a failed thread start) is in that worker's own log files. When a
# test fails so, its report gets their tails, so a CI run that meets it can be read afterwards.
DIED = re.compile(r"worker process has died|Worker unexpectedly exits")
CRASH = re.compile(r"Fatal Python error|Check failed|\*\*\* SIG|Segmentation fault|"
                   r"Unhandled exception|Resource temporarily unavailable|terminate called|"
                   r"Stack trace|MemoryError")


def _tail(path: str, lines: int) -> list[str]:
    with open(path, errors="replace") as f:
        return list(collections.deque(f, maxlen=lines))


def dead_worker_logs(text: str, logs_dir: str, lines: int = 40) -> str:
    """The tails of the log files of every worker whose pid ``text`` names (the raylet's
    "Worker PID: N", Ray's "pid: N" or "pid=N", our "(actor pid N)"), the crash markers in
    the worker logs written in the last 10 minutes (the failed test's, and any other test's in
    that time), and the machine's free memory. Never raises: what cannot be read is said."""
    pids = {p for found in re.findall(r"Worker PID: (\d+)|\bpid[:= ] ?(\d+)", text)
            for p in found if p}
    out = []
    try:
        for pid in sorted(pids):
            for path in sorted(glob.glob(os.path.join(logs_dir, f"*[-_]{pid}.*"))):
                tail = _tail(path, lines)
                out.append(f"--- {path} (last {len(tail)} lines)\n{''.join(tail)}")
        now = time.time()
        recent = [p for p in glob.glob(os.path.join(logs_dir, "*worker*"))
                  if now - os.path.getmtime(p) < 600]
        for path in sorted(recent, key=os.path.getmtime)[-200:]:
            with open(path, errors="replace") as f:
                hits = [line for line in f if CRASH.search(line) and "common causes" not in line]
            if hits:
                out.append(f"--- crash markers in {path}\n{''.join(hits[-lines:])}")
    except Exception as e:  # a diagnosis, never a second failure
        out.append(f"--- could not read {logs_dir}: {type(e).__name__}: {e}")
    try:
        with open("/proc/meminfo") as f:
            out.append("--- " + ", ".join(" ".join(line.split()) for line in f
                                          if line.startswith(("MemTotal", "MemAvailable"))))
    except OSError:  # no /proc (macOS)
        pass
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if not report.failed:
        return
    text = "\n".join([str(report.longrepr)] + [body for _, body in report.sections])
    if not DIED.search(text):
        return
    try:
        import ray

        if not ray.is_initialized():
            return
        ctx = ray.get_runtime_context()
        logs = os.path.join(ctx.get_temp_dir(), ctx.get_session_name(), "logs")
        report.sections.append(("dead worker logs", dead_worker_logs(text, logs)))
    except Exception as e:  # a diagnosis, never a second failure (nor a pytest INTERNALERROR)
        report.sections.append(("dead worker logs", f"not available: {type(e).__name__}: {e}"))


def load_example(path, name: str):
    """Import an example script as module ``name``, picklable by value (workers cannot import
    examples/ by name). Its directory goes on sys.path, as when it runs as a script, so it can
    import its driver-side helpers (examples/reward_report.py)."""
    import importlib.util
    import sys

    import ray.cloudpickle

    where = os.path.dirname(os.path.abspath(path))
    if where not in sys.path:
        sys.path.append(where)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    ray.cloudpickle.register_pickle_by_value(mod)
    return mod


def live_actors() -> list[dict]:
    """Live actors of the test namespace (state API of *this* session's Ray)."""
    import ray
    from ray.util import state

    address = ray.get_runtime_context().gcs_address
    return [
        a for a in state.list_actors(address=address, filters=[("state", "!=", "DEAD")], limit=10_000)
        if a.get("ray_namespace") == NAMESPACE
    ]


def leftovers(timeout_s: float = 10.0) -> tuple[list, list]:
    """Our live actors and placement groups, waiting up to ``timeout_s`` for kills to land."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        actors = live_actors()
        pgs = [
            (pid, pg["name"]) for pid, pg in ray.util.placement_group_table().items()
            if pg["name"].startswith("twinkle/") and pg["state"] != "REMOVED"
        ]
        if (not actors and not pgs) or time.monotonic() > deadline:
            return actors, pgs
        time.sleep(0.2)


@pytest.fixture
def runtime(ray_session):
    """A clean twinkle_ray runtime per test; fails the test if it leaks actors or PGs."""
    import twinkle_ray

    twinkle_ray.shutdown()
    yield twinkle_ray
    twinkle_ray.shutdown()
    actors, pgs = leftovers()
    assert not actors, f"leaked actors: {[a.get('name') for a in actors]}"
    assert not pgs, f"leaked placement groups: {pgs}"


def concurrently(*fns, timeout_s: float = 60.0) -> list:
    """Run each function in a thread of its own; their results in order (an exception is
    returned in its place, for the test to inspect)."""
    import threading

    out: list = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # returned for the test to inspect
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return out
