"""Serve's error answers keep internals out of HTTP bodies (issue 27, item 10).

A gang whose worker died raises WorkerDiedError (node ip, node id, Ray's death
text with pids); the replica then raises GangUnavailable quoting it, to every
later request. ``error_response`` must answer those with a fixed text and a
request id, and log the details under that id.
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

from twinkle_ray import DeviceGroup, WorkerDiedError, get_rank, remote_class, remote_function
from twinkle_ray.serve import GangUnavailable, error_response


@remote_class()
class Doomed:
    @remote_function(dispatch="all", collect="none")
    def pid(self) -> int:
        return os.getpid()

    @remote_function(dispatch="all", collect="none")
    def exit_on(self, rank: int) -> int:
        if get_rank() == rank:
            os._exit(1)
        return get_rank()


def _body(response) -> dict:
    return json.loads(response.body)


def _dead_gang_error(runtime) -> tuple[WorkerDiedError, list[int]]:
    """A real death: rank 1 exits mid-call. Returns its WorkerDiedError and the workers' pids."""
    runtime.initialize(groups=[DeviceGroup("doomed", 2, "cpu")])
    g = Doomed(remote_group="doomed")
    pids = g.pid()()
    with pytest.raises(WorkerDiedError) as info:
        g.exit_on(1)()
    return info.value, pids


@pytest.mark.slow
def test_503_body_names_no_node_pid_or_exception_and_the_log_does(runtime, caplog):
    died, worker_pids = _dead_gang_error(runtime)
    assert died.node and died.node_id, (died.node, died.node_id)
    other = ValueError("secret detail of another request\nsecond line")
    unavailable = GangUnavailable(
        f"replica unavailable: its gang on group 'doomed' was not rebuilt after {died}: "
        f"{type(other).__name__}: {str(other).splitlines()[0]}", died)
    internals = [died.node, died.node_id[:8], died.cause.splitlines()[0],
                 "secret detail of another request"]
    pids = [str(p) for p in worker_pids]  # Ray's death text may quote them; the body never

    caplog.set_level(logging.WARNING, logger="twinkle_ray.serve")
    for error in (died, unavailable):
        caplog.clear()
        response = error_response(error)
        assert response.status_code == 503
        body = _body(response)
        text = response.body.decode()
        for secret in internals + pids:
            assert secret not in text, (secret, text)
        assert not re.search(r"\d+\.\d+\.\d+\.\d+", text), text
        assert set(body) == {"error", "request_id"}, body
        assert body["error"].startswith("replica unavailable"), body
        [record] = [r for r in caplog.records if body["request_id"] in r.getMessage()]
        assert record.levelno == logging.WARNING
        for secret in internals:
            if error is died and secret == "secret detail of another request":
                continue
            assert secret in record.getMessage(), (secret, record.getMessage())


def test_500_body_carries_a_request_id_found_in_the_log(caplog):
    caplog.set_level(logging.WARNING, logger="twinkle_ray.serve")
    response = error_response(KeyError("token 1234 of user alice"))
    body = _body(response)
    assert response.status_code == 500 and "alice" not in response.body.decode()
    assert body["request_id"] and "KeyError" in body["error"]
    [record] = [r for r in caplog.records if body["request_id"] in r.getMessage()]
    assert "alice" in str(record.exc_info[1])
