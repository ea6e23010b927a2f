"""A gang's metrics in Ray's metrics system: calls, errors, latency and argument bytes.

Recorded through ``ray.util.metrics``, so they appear wherever Ray's own
metrics do: the Ray dashboard's Metrics view (with Prometheus and Grafana set
up) and every node's Prometheus endpoint (``http://<node>:<MetricsExportPort>/metrics``,
the port is in ``ray.nodes()``), each name prefixed with ``ray_``. Every
series carries the tags ``gang`` (the gang's label, ``group/Class``) and
``method``.

- ``twinkle_calls_total``: calls the gang's dispatcher submitted, one per
  call whatever the number of ranks it runs on (a call refused because the
  gang is dead or stopped is not submitted and not counted).
- ``twinkle_call_errors_total``: ranks on which the call failed in the worker:
  the method raised, or a routed input could not be fetched (a call that
  fails on 4 ranks counts 4).
- ``twinkle_call_seconds``: histogram of the time a worker spent inside the
  method, its arguments already resolved (routed inputs fetched); one
  observation per rank and call.
- ``twinkle_routed_bytes_total``: bytes of the arguments the workers received,
  counted for arrays, tensors and ``bytes`` (also inside lists, tuples and
  dicts, two levels deep, long ones estimated from their first items); other
  values count 0 and nothing is pickled to measure them.

``TWINKLE_METRICS=0`` where a gang is created turns its metrics off, and its
worker tasks are then named ``Class.method`` rather than ``group/Class.method``
(a name per class, not per gang: Ray keeps a ``ray_tasks`` metric series per
task name). Nothing is made at import: each
dispatcher and worker makes its gang's metric objects when it starts.

A call only notes its figures (a dict or list entry); one daemon thread (per
gang, in its dispatcher and in each worker) hands them to Ray within ``FLUSH_S`` (Ray itself exports every 10 s
by default), so recording a metric is never on a call's path: Ray's
``Counter.inc``/``Histogram.observe`` cost a no-op call on 4 workers several
per cent (the B1 metrics on/off rows of `python -m bench --only B1`).

Example::

    m = GangMetrics.create("trainer/Model", on=metrics_enabled())  # None when TWINKLE_METRICS=0
    if m is not None:
        m.called("forward")                                  # the dispatcher, per call
        m.ran("forward", seconds=0.012, nbytes=4096, failed=False)   # a worker, per rank
        m.flush()                                            # now, not within FLUSH_S
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

ENV = "TWINKLE_METRICS"
# Seconds: from a no-op (~0.1 ms) to a long training step.
LATENCY_BOUNDARIES = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0]
TAG_KEYS = ("gang", "method")
_SAMPLE = 8  # items of a list/tuple/dict looked at when counting bytes; the rest estimated
_NO_BYTES = frozenset({int, float, bool, str, type(None), complex})
# Figures noted by calls reach Ray's metrics at most this many seconds later.
FLUSH_S = 0.5


def metrics_enabled() -> bool:
    """Whether gangs created now record metrics: ``TWINKLE_METRICS`` is not ``0``/``false``/``off``."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


class GangMetrics:
    """One gang's metric series in this process (held by its dispatcher or worker)."""

    def __init__(self, gang: str):
        from ray.util import metrics

        self.gang = gang
        self._tags: dict[str, dict[str, str]] = {}
        self.calls = metrics.Counter(
            "twinkle_calls_total", description="Calls submitted to a twinkle_ray gang (one per call).",
            tag_keys=TAG_KEYS)
        self.errors = metrics.Counter(
            "twinkle_call_errors_total", description="Ranks on which a twinkle_ray gang method raised.",
            tag_keys=TAG_KEYS)
        self.seconds = metrics.Histogram(
            "twinkle_call_seconds", description="Seconds a worker spent in the method (per rank and call).",
            boundaries=LATENCY_BOUNDARIES, tag_keys=TAG_KEYS)
        self.routed_bytes = metrics.Counter(
            "twinkle_routed_bytes_total",
            description="Bytes of arrays, tensors and bytes in the arguments the workers received.",
            tag_keys=TAG_KEYS)
        # Noted by calls, recorded by the flusher thread (idle until a call notes something).
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._runs: list[tuple[str, float | None, int, bool]] = []
        self._wake = threading.Event()
        threading.Thread(target=self._flush_loop, name="twinkle-metrics", daemon=True).start()

    @classmethod
    def create(cls, gang: str, on: bool = True) -> GangMetrics | None:
        """The gang's metrics, or None when ``on`` is false or Ray cannot make them."""
        if not on:
            return None
        try:
            return cls(gang)
        except Exception:  # metrics must never break a gang
            logger.warning("twinkle_ray metrics are off for gang %s", gang, exc_info=True)
            return None

    def tags(self, method: str) -> dict[str, str]:
        t = self._tags.get(method)
        if t is None:
            t = self._tags[method] = {"gang": self.gang, "method": method}
        return t

    def called(self, method: str) -> None:
        """One call submitted (the dispatcher)."""
        with self._lock:
            self._calls[method] = self._calls.get(method, 0) + 1
        self._soon()

    def ran(self, method: str, seconds: float | None, nbytes: int, failed: bool) -> None:
        """One rank ran ``method`` (the worker): seconds in the method (None: it never started,
        e.g. a routed input failed), argument bytes, and whether it raised."""
        with self._lock:
            self._runs.append((method, seconds, nbytes, failed))
        self._soon()

    def _soon(self) -> None:
        """Have the noted figures recorded within FLUSH_S."""
        if not self._wake.is_set():
            self._wake.set()

    def _flush_loop(self) -> None:
        while True:
            self._wake.wait()  # idle until a call notes something: no polling
            time.sleep(FLUSH_S)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Record every figure noted so far in Ray's metrics (the flusher thread calls it)."""
        with self._lock:
            calls, self._calls = self._calls, {}
            runs, self._runs = self._runs, []
        nbytes: dict[str, int] = {}
        errors: dict[str, int] = {}
        for method, n in calls.items():
            self._record(self.calls.inc, n, method)
        for method, seconds, size, failed in runs:
            if seconds is not None:
                self._record(self.seconds.observe, seconds, method)
            if size > 0:
                nbytes[method] = nbytes.get(method, 0) + size
            if failed:
                errors[method] = errors.get(method, 0) + 1
        for method, size in nbytes.items():
            self._record(self.routed_bytes.inc, size, method)
        for method, n in errors.items():
            self._record(self.errors.inc, n, method)

    def _record(self, record: Any, value: float, method: str) -> None:
        try:
            record(value, self.tags(method))
        except Exception:  # a metric must never fail a call, nor keep the others from Ray
            logger.debug("twinkle metric not recorded", exc_info=True)


def payload_nbytes(value: Any, depth: int = 2) -> int:
    """Bytes of the arrays, tensors and bytes in ``value``, without pickling anything.

    Looks into lists, tuples and dicts ``depth`` levels deep; of a long one
    only the first ``_SAMPLE`` items are looked at and the rest estimated from
    them. Other values count 0.

    >>> import numpy as np
    >>> payload_nbytes([np.zeros(4, dtype=np.float32), b"abc", {"k": np.zeros(2)}, 7])
    35
    >>> payload_nbytes([np.zeros(1, dtype=np.uint8)] * 1000)
    1000
    """
    t = type(value)
    if t in _NO_BYTES:
        return 0
    if t is bytes or t is bytearray:
        return len(value)
    if hasattr(t, "nbytes"):  # numpy, torch, memoryview, pyarrow (never an instance's __getattr__)
        try:
            nbytes = value.nbytes
        except Exception:  # e.g. a sparse tensor
            return 0
        return nbytes if isinstance(nbytes, int) else 0
    if depth <= 0 or not isinstance(value, (list, tuple, dict)):
        return 0
    n = len(value)
    items = value.values() if isinstance(value, dict) else value
    total = 0
    for seen, item in enumerate(items):
        if seen == _SAMPLE:
            return total * n // seen
        total += payload_nbytes(item, depth - 1)
    return total


def args_nbytes(args: tuple, kwargs: dict) -> int:
    """:func:`payload_nbytes` of a call's positional and keyword arguments."""
    return sum(payload_nbytes(a) for a in args) + sum(payload_nbytes(v) for v in kwargs.values())
