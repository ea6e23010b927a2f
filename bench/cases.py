"""The benchmarks B1-B6: the same work through twinkle_ray and through raw Ray.

Each ``bench_*`` function sets up both sides (a twinkle_ray gang and a
:class:`bench.raw.RawGang` of the same size and bundles), times them
alternately with :func:`bench.timing.compare`, tears both down and returns a
result dict (seconds, ratio, and the figures the table shows). The quick run
(``Config.shared_gangs``) instead runs B1-B4, B6, B7 and B10 with
:func:`bench_shared` on one :class:`GangPool`: one gang and raw twin per size.

Example::

    cfg = Config.quick()
    rows = bench_gang4(cfg)     # [{'name': 'B1 ...', 'twinkle_s': ..., 'raw_s': ..., 'ratio': ...}, ...]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import ray

import twinkle_ray as twinkle
from bench import payload, whatif
from bench.raw import RawGang, make_pg
from bench.timing import compare, compare_many, driver_cpu_per_call, ratios, slope
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.runtime.metrics import metrics_enabled

NAMESPACE = "twinkle-bench"
METRICS_REPEATS = 5  # B1 metrics on/off: this many times B1's repeats (a small difference is sought)


@dataclass
class Config:
    """Sizes and repeat counts of one run."""

    repeats: int = 60  # timed repetitions of each fast benchmark (B1, B6), per side
    chain: int = 200  # B2: chained calls
    chain_repeats: int = 9
    b3_mb: int = 64  # B3: batch size
    b3_repeats: int = 31
    b4_mb: int = 256  # B4: total payload
    b4_repeats: int = 25
    b5_repeats: int = 7  # B5: gang start-ups per side
    b5_warmup: int = 1
    b5_workers: int = 4
    b6_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    b10_sizes: tuple[int, ...] = (4, 16, 32)  # B10: driver CPU per lazy call
    b10_calls: int = 400
    b9_steps: int = 8  # B9: steps per mode
    b9_seconds: float = 1.0  # B9: G = T, the sleep of a generate and of a train call
    warmup: int = 3
    # One gang (and raw twin) per size for B1-B4, B6, B7 and B10 (GangPool), not one per benchmark:
    # a gang start-up is most of a quick benchmark's time on 2 cores.
    shared_gangs: bool = False

    @classmethod
    def quick(cls) -> Config:
        """Scaled down to finish in about a minute and a half on 2 cores."""
        return cls(repeats=12, chain=50, chain_repeats=2, b3_mb=16, b3_repeats=5, b4_mb=32,
                   b4_repeats=3, b5_repeats=1, b5_warmup=0, b5_workers=2, b6_sizes=(1, 2, 4, 8),
                   b10_sizes=(4, 8), b10_calls=40, b9_steps=2, b9_seconds=0.5, warmup=2,
                   shared_gangs=True)


# ---------------------------------------------------------------------------- the gang's class
@remote_class(distributed=False)
class BenchWorker:
    """The twinkle_ray side of B1-B4 and B6 (RawWorker has the same methods)."""

    def __init__(self, device_mesh=None):
        self.cached: dict = {}

    @remote_function(dispatch="all", collect="none")
    def noop(self) -> None:
        """Nothing: the cost of a call (lazy: returns a LazyResult)."""
        return None

    @remote_function(dispatch="all", collect="none", sync=True)
    def noop_eager(self) -> None:
        """Nothing, returned as a value (``sync=True``)."""
        return None

    @remote_function(dispatch="slice_dp", collect="flatten")
    def step(self, xs: list) -> list:
        """One link of the B2 chain: this worker's slice, passed on."""
        return xs

    @remote_function(dispatch="slice_dp", collect="none")
    def consume(self, batch: np.ndarray) -> int:
        """B3: touch the slice, return its length."""
        return int(batch.shape[0])

    @remote_function(dispatch="all", collect="flatten")
    def produce(self, rows: int, cols: int, trace_dir: str) -> dict:
        """B4 producer: a traced batch of ``rows`` rows per worker."""
        key = (rows, cols)
        if key not in self.cached:
            self.cached[key] = payload.make_batch(rows, cols, trace_dir)["x"]
        x = self.cached[key]
        return {"x": x, "tag": payload.Tracer(trace_dir, x.nbytes)}

    @remote_function(dispatch="slice_dp", collect="none")
    def join(self, batch: dict) -> float:
        """B4 consumer: its dp slice arrives whole and contiguous; return a checksum."""
        x = batch["x"]
        return float(x[0, 0] + x[-1, -1]) + x.shape[0]


@remote_class()
class DistMember:
    """B5: a gang member with torch.distributed (gloo) up; nothing else."""

    def __init__(self, device_mesh=None):
        self.mesh = device_mesh


# ---------------------------------------------------------------------------- helpers
def _init(*groups: DeviceGroup) -> None:
    twinkle.initialize("ray", groups=list(groups), namespace=NAMESPACE)


def _gang(n: int, name: str):
    _init(DeviceGroup(name, n, "cpu"))
    return BenchWorker(device_mesh=DeviceMesh.from_sizes(dp_size=n), remote_group=name)


def _row(name: str, r: dict, **extra) -> dict:
    """A result row. ``target`` is the target as text; ``checks`` (and ``stretch``) the same as
    ``(key, '<=' or '>=', bound)`` triples that :func:`bench.run.table` evaluates."""
    return {"name": name, **r, **extra}


def _gcs() -> str:
    """This bench's own cluster (other Ray clusters may run on the machine)."""
    return ray.get_runtime_context().gcs_address


def _dispatcher_pid(proxy) -> int | None:
    from ray.util.state import list_actors

    label = proxy.topology()["label"]
    rows = list_actors(address=_gcs(), filters=[("name", "=", label), ("state", "=", "ALIVE")])
    return rows[0]["pid"] if rows else None


# ---------------------------------------------------------------------------- B1, B2, B3
def bench_gang4(cfg: Config, only: frozenset = frozenset({"B1", "B2", "B3"})) -> list[dict]:
    """B1 (eager and lazy no-op), B2 (chained lazy calls), B3 (a numpy batch, slice_dp) on 4 workers."""
    gang = _gang(4, "b1")
    raw = RawGang(4)
    raw.start()
    try:
        return _gang4_rows(cfg, only, gang, "b1", raw.actors)
    finally:
        raw.close()
        twinkle.shutdown()


def _gang4_rows(cfg: Config, only: frozenset, gang, group: str, actors: list) -> list[dict]:
    """B1-B3 (those in ``only``) on a 4-worker gang of DeviceGroup ``group`` and 4 raw actors."""
    n = 4
    rows = []
    if "B1" in only:
        rows += _b1(cfg, gang, actors)
        rows += _b1_metrics(cfg, gang, n, group)

    start = [[i] for i in range(n)]

    def chain_twinkle():
        x = gang.step([i for xs in start for i in xs])
        for _ in range(cfg.chain - 1):
            x = gang.step(x)
        assert x.get() == list(range(n))

    def chain_raw():
        refs = [a.step.remote(xs) for a, xs in zip(actors, start, strict=True)]
        for _ in range(cfg.chain - 1):
            refs = [a.step.remote(ref) for a, ref in zip(actors, refs, strict=True)]
        assert [i for xs in ray.get(refs) for i in xs] == list(range(n))

    if "B2" in only:
        r = compare(chain_twinkle, chain_raw, repeats=cfg.chain_repeats, warmup=1)
        r["twinkle_calls_per_s"] = cfg.chain / r["twinkle_s"]
        r["raw_calls_per_s"] = cfg.chain / r["raw_s"]
        r["throughput_ratio"] = r["twinkle_calls_per_s"] / r["raw_calls_per_s"]
        rows.append(_row(f"B2 {cfg.chain} chained lazy calls, 4 workers", r, unit="s",
                         target="throughput >= 1.0x raw",
                         checks=[("throughput_ratio", ">=", 1.0)]))
        hop = whatif.Hop.options(max_concurrency=1000).remote(actors)

        def chain_floor():
            link = hop.step.remote(start)
            for _ in range(cfg.chain - 1):
                link = hop.step.remote(link)  # Ray hands the hop the previous link's refs
            assert [i for xs in ray.get(ray.get(link)) for i in xs] == list(range(n))

        r = compare(chain_twinkle, chain_floor, repeats=cfg.chain_repeats, warmup=1)
        r["floor_s"] = r["raw_s"]  # the raw column of this row is the floor's chain
        r["twinkle_calls_per_s"] = cfg.chain / r["twinkle_s"]
        r["floor_calls_per_s"] = cfg.chain / r["floor_s"]
        r["floor_ratio"] = r["twinkle_calls_per_s"] / r["floor_calls_per_s"]
        rows.append(_row(f"B2 {cfg.chain} chained lazy calls vs the one-hop floor's chain", r,
                         unit="s", target="throughput >= 1.0x the one-hop floor's chain",
                         checks=[("floor_ratio", ">=", 1.0)]))
        ray.kill(hop)
        workers = whatif.gang_workers(gang, NAMESPACE)

        def chain_direct():
            assert whatif.direct_chain(workers, start, cfg.chain) == list(range(n))

        r = compare(chain_direct, chain_raw, repeats=cfg.chain_repeats, warmup=1)
        r["throughput_ratio"] = r["raw_s"] / r["twinkle_s"]
        rows.append(_row("B2 what-if: the gang's workers called from the driver", r, unit="s",
                         whatif=True))

    batch = np.ones((cfg.b3_mb * 1024 * 1024 // (256 * 4), 256), dtype=np.float32)
    bounds = [(i * len(batch) // n, (i + 1) * len(batch) // n) for i in range(n)]
    expected = [hi - lo for lo, hi in bounds]

    def b3_twinkle():
        assert gang.consume(batch).get() == expected

    def b3_raw():
        refs = [ray.put(batch[lo:hi]) for lo, hi in bounds]
        assert ray.get([a.consume.remote(ref) for a, ref in zip(actors, refs, strict=True)]) == expected

    if "B3" in only:
        r = compare(b3_twinkle, b3_raw, repeats=cfg.b3_repeats, warmup=cfg.warmup)
        rows.append(_row(f"B3 {cfg.b3_mb} MB numpy batch, slice_dp to 4 workers", r, unit="ms",
                         target="<= 1.1x raw", checks=[("ratio", "<=", 1.1)]))
    return rows


B1_FLOOR = "B1 one-hop floor (bare forwarding actor, refs back)"


def _b1(cfg: Config, gang, actors: list) -> list[dict]:
    """B1 eager and lazy, the one-hop floor and raw in one compare_many; then B1's what-if rows.

    The one-hop floor (:class:`bench.whatif.Hop` ``refs``: a bare async actor
    fans the no-op out to the raw actors and hands the output refs back, the
    caller fetches them) is what any design with one actor on the call path
    pays at least. Each B1 row has its ratio to raw (``ratio``) and to the
    floor (``floor_ratio``), all four sides timed in the same rounds.
    """
    hop = whatif.Hop.options(max_concurrency=1000).remote(actors)
    raw = lambda: ray.get([a.noop.remote() for a in actors])  # noqa: E731
    rows = []
    try:
        samples = compare_many({
            "eager": lambda: gang.noop_eager(),
            "lazy": lambda: gang.noop().get(),
            "floor": lambda: ray.get(ray.get(hop.refs.remote())),
            "raw": raw,
        }, repeats=cfg.repeats, warmup=cfg.warmup)
        med = {k: statistics.median(v) for k, v in samples.items()}
        for side, name in (
            ("eager", "B1 no-op call, 4 workers, eager (value back)"),
            ("lazy", "B1 no-op call, 4 workers, lazy (LazyResult, then get)"),
        ):
            ratio, paired = ratios(samples[side], samples["raw"])
            floor_ratio, floor_paired = ratios(samples[side], samples["floor"])
            rows.append(_row(
                name, {"twinkle_s": med[side], "raw_s": med["raw"], "ratio": ratio, "paired_ratio": paired,
                       "floor_s": med["floor"], "floor_ratio": floor_ratio,
                       "floor_paired_ratio": floor_paired, "twinkle_samples": samples[side],
                       "raw_samples": samples["raw"], "floor_samples": samples["floor"]},
                unit="ms", target="<= 1.0x the one-hop floor", checks=[("floor_ratio", "<=", 1.0)],
            ))
        ratio, paired = ratios(samples["floor"], samples["raw"])
        rows.append(_row(B1_FLOOR, {"floor_s": med["floor"], "raw_s": med["raw"], "ratio": ratio,
                                    "paired_ratio": paired, "floor_samples": samples["floor"],
                                    "raw_samples": samples["raw"]}, unit="ms", floor=True))
        workers = whatif.gang_workers(gang, NAMESPACE)
        for name, fn in (
            ("B1 what-if: raw + one forwarding actor, values back", lambda: ray.get(hop.values.remote())),
            ("B1 what-if: the gang's workers called from the driver", lambda: whatif.direct_noop(workers)),
        ):
            rows.append(_row(name, compare(fn, raw, repeats=cfg.repeats, warmup=cfg.warmup), unit="ms",
                             whatif=True))
    finally:
        ray.kill(hop)
    return rows


def _b1_metrics(cfg: Config, gang, n: int, group: str) -> list[dict]:
    """B1 with metrics on (the B1 gang) vs off (a second gang on the same workers' bundles of
    DeviceGroup ``group``, made with ``TWINKLE_METRICS=0``: no metrics), in one compare_many.

    ``ratio`` = on / off: what the gang metrics cost a no-op call (worker tasks are named
    either way: 'group/Class.method' on, 'Class.method' off).
    """
    on = metrics_enabled()  # how the B1 gang was made (TWINKLE_METRICS of this run)
    before = os.environ.get("TWINKLE_METRICS")
    os.environ["TWINKLE_METRICS"] = "0"  # read where a gang is created
    try:
        off = BenchWorker(device_mesh=DeviceMesh.from_sizes(dp_size=n), remote_group=group)
    finally:
        if before is None:
            del os.environ["TWINKLE_METRICS"]
        else:
            os.environ["TWINKLE_METRICS"] = before
    rows = []
    try:
        samples = compare_many({
            "on eager": lambda: gang.noop_eager(),
            "off eager": lambda: off.noop_eager(),
            "on lazy": lambda: gang.noop().get(),
            "off lazy": lambda: off.noop().get(),
        }, repeats=cfg.repeats * METRICS_REPEATS, warmup=cfg.warmup)
        for kind in ("eager", "lazy"):
            ratio, paired = ratios(samples[f"on {kind}"], samples[f"off {kind}"])
            rows.append(_row(
                f"B1 metrics on vs off, 4 workers, {kind}",
                {"on_s": statistics.median(samples[f"on {kind}"]),
                 "off_s": statistics.median(samples[f"off {kind}"]), "ratio": ratio,
                 "paired_ratio": paired, "on_samples": samples[f"on {kind}"],
                 "off_samples": samples[f"off {kind}"]},
                unit="ms", metrics_cost=True, metrics_on=on, target="<= 1.05x off",
                checks=[("ratio", "<=", 1.05)]))
    finally:
        off.close()
    return rows


# ---------------------------------------------------------------------------- B4
def bench_routing(cfg: Config) -> dict:
    """B4: a dp=4 group's output -> a dp=2 group via LazyResult; counts payload bytes per process."""
    _init(DeviceGroup("b4_producer", 4, "cpu"), DeviceGroup("b4_consumer", 2, "cpu"))
    producer = BenchWorker(device_mesh=DeviceMesh.from_sizes(dp_size=4), remote_group="b4_producer")
    consumer = BenchWorker(device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="b4_consumer")
    raw_p, raw_c = RawGang(4), RawGang(2)
    raw_p.start()
    raw_c.start()
    try:
        return _b4_row(cfg, producer, consumer, raw_p.actors, raw_c.actors)
    finally:
        raw_p.close()
        raw_c.close()
        twinkle.shutdown()


def _b4_row(cfg: Config, producer, consumer, raw_p: list, raw_c: list) -> dict:
    """B4 on a dp=4 producer gang, a dp=2 consumer gang and their raw twins (4 and 2 actors)."""
    trace_dir = tempfile.mkdtemp(prefix="twinkle-bench-trace-")
    cols = 256
    rows_per_producer = cfg.b4_mb * 1024 * 1024 // 4 // (cols * 4)
    half = 2 * rows_per_producer
    expected = [float(2 + half)] * 2
    try:
        def b4_twinkle():
            out = producer.produce(rows_per_producer, cols, trace_dir)
            assert consumer.join(out).get() == expected

        def b4_raw():
            refs = [a.produce.remote(rows_per_producer, cols, trace_dir) for a in raw_p]
            got = ray.get([raw_c[0].join.remote(refs[0], refs[1]), raw_c[1].join.remote(refs[2], refs[3])])
            assert got == expected

        payload.clear(trace_dir)
        counts = {}
        for side, fn in (("twinkle", b4_twinkle), ("raw", b4_raw)):
            fn()  # one traced run per side, on its own: whose process unpickled the payload?
            counts[side] = payload.bytes_by_pid(trace_dir)
            payload.clear(trace_dir)
        driver = os.getpid()
        # Self-check of the tracer: a deliberate fetch in the driver must be seen.
        ray.get(raw_p[0].produce.remote(rows_per_producer, cols, trace_dir))
        self_check = payload.bytes_by_pid(trace_dir).get(driver, 0)
        payload.clear(trace_dir)
        dispatchers = {_dispatcher_pid(producer), _dispatcher_pid(consumer)} - {None}
        tw, rw = counts["twinkle"], counts["raw"]
        traffic = {
            "payload_bytes_total": cfg.b4_mb * 1024 * 1024,
            "twinkle_bytes_via_driver": tw.get(driver, 0),
            "twinkle_bytes_via_dispatcher": sum(tw.get(p, 0) for p in dispatchers),
            "twinkle_bytes_to_consumers": sum(v for p, v in tw.items() if p != driver and p not in dispatchers),
            "raw_bytes_via_driver": rw.get(driver, 0),
            "raw_bytes_to_consumers": sum(v for p, v in rw.items() if p != driver),
            "dispatcher_pids": sorted(dispatchers),
            "tracer_self_check_bytes": self_check,  # one producer output fetched by the driver on purpose
        }
        r = compare(b4_twinkle, b4_raw, repeats=cfg.b4_repeats, warmup=1)
    finally:
        payload.clear(trace_dir)
        os.rmdir(trace_dir)
    return _row(f"B4 dp=4 -> dp=2 via LazyResult, {cfg.b4_mb} MB", r, unit="ms",
                target="<= 1.1x raw, 0 bytes via driver/dispatchers",
                checks=[("ratio", "<=", 1.1), ("twinkle_bytes_via_driver", "<=", 0),
                        ("twinkle_bytes_via_dispatcher", "<=", 0)], **traffic)


# ---------------------------------------------------------------------------- B5
def bench_startup(cfg: Config) -> dict:
    """B5: a gang of ``cfg.b5_workers`` (4; quick: 2) with torch.distributed (gloo) up, from
    constructor call to ready."""
    n = cfg.b5_workers
    holder: dict = {}
    group = DeviceGroup("b5", n, "cpu")

    def tw_before():
        _init(group)

    def tw_start():
        holder["gang"] = DistMember(device_mesh=DeviceMesh.from_sizes(dp_size=n), remote_group="b5")

    def tw_after():
        twinkle.shutdown()  # closes the gang: its workers and dispatcher are killed, PG removed
        _wait_gone()

    def raw_before():
        holder["raw"] = RawGang(n, pg=make_pg(n, 1.0))
        holder["raw"].own_pg = True

    def raw_start():
        holder["raw"].start(distributed=True)

    def raw_after():
        holder["raw"].close()

    r = compare(tw_start, raw_start, repeats=cfg.b5_repeats, warmup=cfg.b5_warmup,
                before=(tw_before, raw_before), after=(tw_after, raw_after))
    return _row(f"B5 gang start-up, {n} workers, torch.distributed gloo", r, unit="s", target="<= 1.2x raw",
                checks=[("ratio", "<=", 1.2)])


def _wait_gone(timeout_s: float = 30.0) -> None:
    """Wait until no actor of the bench namespace is alive (kills land asynchronously)."""

    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [a for a in list_actors(address=_gcs(), filters=[("state", "!=", "DEAD")], limit=10_000)
                 if a.get("ray_namespace") == NAMESPACE]
        if not alive:
            return
        time.sleep(0.1)


# ---------------------------------------------------------------------------- B6
def bench_scaling(cfg: Config) -> list[dict]:
    """B6: no-op call + collect (lazy, then get) on gangs of 1..32 workers (quick: 1..8)."""
    rows = []
    for n in cfg.b6_sizes:
        gang = _gang(n, f"b6_{n}")
        raw = RawGang(n)
        raw.start()
        try:
            rows.append(_b6_row(cfg, n, gang, raw.actors))
        finally:
            raw.close()
            twinkle.shutdown()
    return [*rows, scaling_slope(rows)]


def _b6_row(cfg: Config, n: int, gang, actors: list) -> dict:
    r = compare(lambda: gang.noop().get(), lambda: ray.get([w.noop.remote() for w in actors]),
                repeats=cfg.repeats, warmup=cfg.warmup)
    return _row(f"B6 no-op call + collect, {n} worker(s)", r, unit="ms", workers=n)


# ---------------------------------------------------------------------------- B10
def _drain(out) -> None:
    """Wait for a B10 submission: raw Ray's list of refs, or a LazyResult."""
    if isinstance(out, list):
        ray.get(out)
    else:
        out.get()


def bench_driver_cpu(cfg: Config) -> list[dict]:
    """B10: the driver's CPU per lazy call (submission only) at several gang sizes, beside raw
    Ray submitting the same no-op to every worker from the driver. docs/design.md#one-calls-route: the caller's cost of
    a lazy call is one actor-task submission whatever the gang's size (flat), while raw Ray's
    fan-out grows with it."""
    rows = []
    for n in cfg.b10_sizes:
        gang = _gang(n, f"b10_{n}")
        raw = RawGang(n)
        raw.start()
        try:
            rows.append(_b10_row(cfg, n, gang, raw.actors))
        finally:
            raw.close()
            twinkle.shutdown()
    return _b10_flat(rows)


def _b10_row(cfg: Config, n: int, gang, actors: list) -> dict:
    def fan_out():
        return [w.noop.remote() for w in actors]

    driver_cpu_per_call(gang.noop, cfg.warmup * 10, _drain)  # warm-up
    driver_cpu_per_call(fan_out, cfg.warmup * 10, _drain)
    tw = statistics.median(driver_cpu_per_call(gang.noop, cfg.b10_calls, _drain) for _ in range(3))
    rw = statistics.median(driver_cpu_per_call(fan_out, cfg.b10_calls, _drain) for _ in range(3))
    return _row(f"B10 driver CPU per lazy call, {n} workers", {
        "twinkle_s": tw, "raw_s": rw, "ratio": tw / rw}, unit="us", gang_size=n)


def _b10_flat(rows: list[dict]) -> list[dict]:
    """B10's rows with each one's figure against the smallest gang's (the flatness check)."""
    base = rows[0]
    for r in rows:  # cheaper than the driver's own fan-out, and flat in the gang's size
        r["vs_smallest"] = r["twinkle_s"] / base["twinkle_s"]
        r["target"] = f"<= 1.0x raw, <= 1.2x the {base['gang_size']}-worker figure (flat)"
        r["checks"] = [("ratio", "<=", 1.0), ("vs_smallest", "<=", 1.2)]
    return rows


# ---------------------------------------------------------------------------- B7
@remote_class(execute="first", distributed=False)
class FirstWorker(BenchWorker):
    """B7: a one-worker gang (``execute='first'``, e.g. a data loader)."""


def bench_first(cfg: Config) -> list[dict]:
    """B7: no-op call + collect on a 1-worker ``execute='first'`` gang, and raw."""
    _init(DeviceGroup("b7", 1, "cpu"))
    gang = FirstWorker(device_mesh=DeviceMesh.from_sizes(dp_size=1), remote_group="b7")
    raw = RawGang(1)
    raw.start()
    try:
        return [_b7_row(cfg, gang, raw.actors[0])]
    finally:
        raw.close()
        twinkle.shutdown()


def _b7_row(cfg: Config, gang, actor) -> dict:
    r = compare(lambda: gang.noop().get(), lambda: ray.get(actor.noop.remote()),
                repeats=cfg.repeats, warmup=cfg.warmup)
    return _row("B7 no-op call + collect, 1 worker, execute='first'", r, unit="ms")


def scaling_slope(rows: list[dict]) -> dict:
    """B6's per-extra-worker cost: least-squares slopes (ms per worker) of both sides, and their gap.

    ``extra_ms_per_worker`` = twinkle's slope - raw's slope: what each additional
    worker costs twinkle_ray beyond what it costs raw Ray.
    """
    xs = [float(r["workers"]) for r in rows]
    tw = slope(xs, [r["twinkle_s"] * 1000 for r in rows])
    rw = slope(xs, [r["raw_s"] * 1000 for r in rows])
    return {"name": "B6 slope: ms per additional worker (least squares)", "slope": True,
            "workers_fitted": [r["workers"] for r in rows], "twinkle_ms_per_worker": tw,
            "raw_ms_per_worker": rw, "extra_ms_per_worker": tw - rw,
            "target": "extra <= 0.1 ms/worker", "checks": [("extra_ms_per_worker", "<=", 0.1)]}


# ---------------------------------------------------------------------------- the quick run's shared gangs
class GangPool:
    """One BenchWorker gang and its raw twin per size, started on first use, kept until :meth:`close`.

    The quick run's B1-B4, B6, B7 (raw side) and B10 take their gangs from one pool
    (:func:`bench_shared`) instead of each starting (and stopping) its own: a start-up
    is most of a quick benchmark's time on 2 cores, the timed calls a small part.

    Example::

        pool = GangPool()
        gang, group, actors = pool.get(4)   # a 4-worker gang of DeviceGroup 'pool_4', 4 raw actors
        pool.close()                        # raw gangs closed, twinkle.shutdown()
    """

    def __init__(self):
        self._pairs: dict[int, tuple] = {}
        self._raws: list[RawGang] = []

    def get(self, n: int) -> tuple:
        """``(gang, group name, raw actors)`` of size ``n``."""
        if n not in self._pairs:
            group = f"pool_{n}"
            gang = _gang(n, group)
            raw = RawGang(n)
            self._raws.append(raw)
            raw.start()
            self._pairs[n] = (gang, group, raw.actors)
        return self._pairs[n]

    def close(self) -> None:
        """Close every gang, and wait until their actors are gone (B5, timed next, wants none)."""
        try:
            for raw in self._raws:
                raw.close()
        finally:
            self._raws.clear()
            self._pairs.clear()
            twinkle.shutdown()
            _wait_gone()


def bench_shared(cfg: Config, only: frozenset) -> dict[str, list[dict]]:
    """B1-B3 (key ``'B1'``), B4, B6, B7 and B10, those in ``only``, on one :class:`GangPool`:
    the same measurements as their ``bench_*`` functions, on shared gangs. Returns their rows
    by key. B7's twinkle side is an ``execute='first'`` gang made on the pooled 1-worker
    group's bundle (and closed after it)."""
    pool = GangPool()
    out: dict[str, list[dict]] = {}
    try:
        if only & {"B1", "B2", "B3"}:
            gang, group, actors = pool.get(4)
            out["B1"] = _gang4_rows(cfg, only, gang, group, actors)
        if "B4" in only:
            (producer, _, raw_p), (consumer, _, raw_c) = pool.get(4), pool.get(2)
            out["B4"] = [_b4_row(cfg, producer, consumer, raw_p, raw_c)]
        if "B6" in only:
            rows = []
            for n in cfg.b6_sizes:
                gang, _, actors = pool.get(n)
                rows.append(_b6_row(cfg, n, gang, actors))
            out["B6"] = [*rows, scaling_slope(rows)]
        if "B7" in only:
            _, group, actors = pool.get(1)
            first = FirstWorker(device_mesh=DeviceMesh.from_sizes(dp_size=1), remote_group=group)
            try:
                out["B7"] = [_b7_row(cfg, first, actors[0])]
            finally:
                first.close()
        if "B10" in only:
            rows = []
            for n in cfg.b10_sizes:
                gang, _, actors = pool.get(n)
                rows.append(_b10_row(cfg, n, gang, actors))
            out["B10"] = _b10_flat(rows)
    finally:
        pool.close()
    return out


__all__ = ["Config", "GangPool", "bench_driver_cpu", "bench_first", "bench_gang4", "bench_routing",
           "bench_shared", "bench_startup", "bench_scaling", "scaling_slope"]
