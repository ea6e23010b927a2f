"""An abort() that arrives while restart() builds the gang never starts a second build.

One build at a time (issue 28, item 2): whatever asks for a teardown while a build is under way,
exactly one set of workers exists afterwards and nothing is left behind.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from conftest import live_actors
from twinkle_ray import DeviceGroup, remote_class, remote_function

WAIT_S = 60.0


@remote_class(max_restarts=1)
class SlowStart:
    """Its constructor sleeps while ``marker`` exists: a rebuild that takes a while."""

    def __init__(self, marker: str):
        if os.path.exists(marker):
            time.sleep(4.0)

    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()


def _workers(label: str) -> list[str]:
    return sorted(a["name"] for a in live_actors() if a.get("name", "").startswith(label + "/"))


@pytest.mark.slow
def test_abort_during_restart_leaves_one_set_of_workers(runtime, tmp_path):
    marker = str(tmp_path / "slow")
    runtime.initialize(groups=[DeviceGroup("ab", 2, "cpu")])
    g = SlowStart(marker, remote_group="ab")
    label = g.label
    first = g.pid()()
    open(marker, "w").close()  # from now on a build takes seconds
    done: dict = {}

    def restart():
        try:
            g.restart(timeout=WAIT_S)
            done["ok"] = True
        except Exception as e:  # noqa: BLE001 — the test looks at it
            done["error"] = e

    t = threading.Thread(target=restart)
    t.start()
    deadline = time.monotonic() + WAIT_S
    while True:  # the restart's workers exist and their constructors run
        names = [r["name"] for r in g.topology()["ranks"]]
        if all(n and "#" in n for n in names):
            break
        assert time.monotonic() < deadline, names
        time.sleep(0.1)
    g.abort("the other side of a collective failed")  # while restart() builds
    t.join(WAIT_S)
    assert not t.is_alive()
    os.remove(marker)
    pids = g.pid()()  # the gang answers, on one set of workers
    assert len(pids) == 2 and not set(pids) & set(first), (pids, first)
    desc = g.topology()
    assert not desc["rebuilding"] and desc["dead"] is None, desc
    # The restart was the one build: the abort found no collective to end (the gang was being
    # built), so no build of it failed and no automatic rebuild was spent.
    assert desc["rebuild_error"] is None and desc["restarts"] == 0, desc
    time.sleep(1.0)  # a second build, if any, would have made its actors by now
    names = _workers(label)
    assert names == sorted(r["name"] for r in desc["ranks"]), names
    assert "ok" in done, done
