"""twinkle_ray against twinkle-kit (ModelScope Twinkle's own infra), same workload, one Ray session.

Not part of ``python -m bench`` and not run by the tests: it needs twinkle-kit,
which lives in its own venv (commands in BENCHMARKS.md, "Against twinkle-kit
0.5.1")::

    cd /work/main && /tmp/tk-venv/bin/python -m bench.peer_twinkle_kit [--quick] [--json] [--workers 4,24]

Both frameworks run in one interpreter on one local Ray (loopback only;
twinkle-kit's CPU resource manager places all CPU groups on one node only if
``ncpu_proc_per_node`` covers all their ranks, and takes a node only if its
``CPU // 4 >= ncpu_proc_per_node``, so the virtual CPUs are 4x the ranks, at
least 64). Every figure is a median of interleaved runs (:mod:`bench.timing`);
ratio = twinkle_ray / twinkle-kit.

- **start-up**: constructor call until a first no-op call on all 4 workers has
  answered (twinkle-kit's constructor returns before its actors are up, so the
  first call is part of both sides' time). Placement groups are reserved
  beforehand on both sides (twinkle-kit reserves them in ``initialize``).
  Three variants: each framework's default on CPU (twinkle_ray: a gloo
  process group; twinkle-kit: none, it only sets RANK/WORLD_SIZE, no
  MASTER_ADDR on CPU), both without torch.distributed, and both with gloo
  (twinkle-kit: the class's ``__init__`` calls ``init_process_group`` with a
  port the driver picks, as a user of it would). A fourth, "pair": two gangs
  of 4 and 2 workers, each default (twinkle_ray builds them in one
  ``start_together()`` block; twinkle-kit's constructors do not wait anyway).
  Target <= 0.6x.
- **eager per call**, for each size N of ``--workers`` (default 4 and 24;
  ``--quick`` 4 and 8): a no-op (``dispatch='all'``, ``collect='none'``) on N
  workers, call + result: twinkle_ray ``gang.noop().get()``, twinkle-kit
  ``gang.noop()()``. Also the same twinkle-kit actors called with plain Ray
  (the driver submits to every actor and gets the values), and the *one-hop
  floor* (``bench.whatif.Hop``: a bare forwarding actor in front of those
  actors, refs back). Targets: <= 1.0x twinkle-kit at 24 workers; below 24,
  B1's <= 1.0x the one-hop floor.
- **driver CPU per lazy call**, same gangs (as ``bench.cases`` B10):
  ``time.process_time()`` of the driver process (all its threads, Ray's core
  worker threads included) around 100 back-to-back calls, divided by 100;
  their results are drained after the clock stops; median of rounds in
  balanced orders (``bench.timing.balanced_orders``). twinkle_ray: ``gang.noop()``, which returns its lazy result
  (one actor-task submission to the gang's dispatcher), drained with
  ``.get()``. twinkle-kit (lazy_collect on, its default): ``gang.noop()``,
  which runs its driver-side wrapper (caller capture, ``_dispatch_args``,
  ``RayHelper.execute_all_async``: one ``actor.noop.remote()`` per worker) and
  returns its ``LazyCollect`` without calling it; drained by calling it. Plain
  Ray: the driver's ``[a.noop.remote() for a in actors]``, drained with
  ``ray.get``. Targets: <= 0.1x twinkle-kit at 24 workers, and twinkle_ray's
  figure at the largest size <= 1.2x its figure at the smallest (flat).
- **flow**: a producer gang (4 workers, dp=4, ``collect='flatten'``) returns a
  list of 1 MB float32 chunks (dicts ``{'x': ndarray, 'tag': Tracer}``, the
  list-of-samples shape both frameworks slice by dp rank), 256 MB in all
  (``--quick``: 16 MB); its lazy result is passed to a consumer gang (2 workers,
  dp=2, ``dispatch='slice_dp'``) that returns the sum of its slice. Time from
  the producer call to the consumer's value; target <= 1.0x. A traced run per
  side then counts which processes unpickled how many payload bytes
  (:mod:`bench.payload`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import ray
import twinkle  # twinkle-kit
from twinkle import DeviceGroup as TkGroup
from twinkle import DeviceMesh as TkMesh
from twinkle import remote_class as tk_remote_class
from twinkle import remote_function as tk_remote_function

import twinkle_ray as tr
from bench import payload
from bench.timing import balanced_orders, compare, compare_many, driver_cpu_per_call, ratios
from bench.whatif import Hop
from twinkle_ray import DeviceGroup as TrGroup
from twinkle_ray import DeviceMesh as TrMesh
from twinkle_ray import remote_class as tr_remote_class
from twinkle_ray import remote_function as tr_remote_function

NAMESPACE = "twinkle-peer-bench"
CHUNK_ROWS, CHUNK_COLS = 1024, 256  # 1 MB float32 per chunk
EAGER_TARGET_WORKERS = 24  # the per-call targets against twinkle-kit are stated at 24 workers


def _chunks(n_mb: int, trace_dir: str) -> list[dict]:
    return [payload.make_batch(CHUNK_ROWS, CHUNK_COLS, trace_dir) for _ in range(n_mb)]


def _slice_sum(batch: list[dict]) -> float:
    return float(sum(float(d["x"].sum()) for d in batch))


def _init_dist(port: int) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


# ---------------------------------------------------------------------------- twinkle-kit classes
@tk_remote_class()
class TkWorker:
    def __init__(self, device_mesh: twinkle.DeviceMesh = None, master_port: int = 0, **kwargs):
        # **kwargs: Ray checks the signature against remote_group, which twinkle-kit pops only in the worker
        self.device_mesh = device_mesh  # twinkle-kit re-dispatches slice_dp in the worker with it
        self.cached = None
        if master_port:
            _init_dist(master_port)

    @tk_remote_function(dispatch="all", collect="none")
    def noop(self):
        return None

    @tk_remote_function(dispatch="all", collect="none")
    def pid(self):
        return os.getpid()

    @tk_remote_function(dispatch="all", collect="flatten")
    def produce(self, n_mb: int, trace_dir: str):
        if self.cached is None:
            self.cached = _chunks(n_mb, trace_dir)
        return self.cached

    @tk_remote_function(dispatch="slice_dp", collect="sum")
    def consume(self, batch):
        return _slice_sum(batch)


# ---------------------------------------------------------------------------- twinkle_ray classes
class _TrBase:
    def __init__(self, device_mesh=None, master_port: int = 0):
        self.device_mesh = device_mesh
        self.cached = None

    @tr_remote_function(dispatch="all", collect="none")
    def noop(self):
        return None

    @tr_remote_function(dispatch="all", collect="none")
    def pid(self):
        return os.getpid()

    @tr_remote_function(dispatch="all", collect="flatten")
    def produce(self, n_mb: int, trace_dir: str):
        if self.cached is None:
            self.cached = _chunks(n_mb, trace_dir)
        return self.cached

    @tr_remote_function(dispatch="slice_dp", collect="sum")
    def consume(self, batch):
        return _slice_sum(batch)


TrWorker = tr_remote_class()(type("TrWorker", (_TrBase,), {}))  # default: gloo when > 1 worker
TrPlain = tr_remote_class(distributed=False)(type("TrPlain", (_TrBase,), {}))


# ---------------------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive() -> int:
    """Live actor processes of our own Ray: the raylet's (a child of this driver) children titled
    ``ray::Class``, idle workers and zombies left out. (Not the state API: without a dashboard
    of our own it asks whatever listens on 127.0.0.1:8265, another session's Ray on a shared host.)"""
    n = 0
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name() != "raylet":
                continue
            workers = proc.children()
        except psutil.Error:  # exited meanwhile
            continue
        for w in workers:
            try:
                title = (w.cmdline() or [""])[0]
                if w.status() != psutil.STATUS_ZOMBIE and title.startswith("ray::") and title != "ray::IDLE":
                    n += 1
            except psutil.Error:
                pass
    return n


def _wait_alive(n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive() > n and time.monotonic() < deadline:
        time.sleep(0.1)


def _fmt(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


# ---------------------------------------------------------------------------- (a) start-up
def bench_startup(repeats: int, variants: list[str], warmup: int = 1) -> list[dict]:
    n = 4
    rows = []
    counter = iter(range(10**6))
    holder: dict = {}
    for variant in variants:
        # "pair": two gangs, of 4 and 2 workers, each side's default on CPU; twinkle_ray makes them in
        # one start_together() block (twinkle-kit's constructors return before their actors are up)
        sizes = [(n, ""), (2, "2")] if variant == "pair" else [(n, "")]

        def tk_start(variant=variant, sizes=sizes):
            port = _free_port() if variant == "gloo" else 0
            hs = [TkWorker(device_mesh=TkMesh.from_sizes(dp_size=k), master_port=port,
                           remote_group=f"tk_start{suffix}", instance_id=f"s{next(counter)}")
                  for k, suffix in sizes]
            for h in hs:
                h.noop()()
            holder["tk"] = hs

        def tr_start(variant=variant, sizes=sizes):
            cls = TrPlain if variant == "none" else TrWorker
            with tr.start_together():
                gs = [cls(device_mesh=TrMesh.from_sizes(dp_size=k), remote_group=f"tr_start{suffix}")
                      for k, suffix in sizes]
            for g in gs:
                g.noop().get()
            holder["tr"] = gs

        def tk_before():
            holder["tk_base"] = _alive()

        def tk_after():
            for h in holder.pop("tk"):
                for a in h._actors:
                    ray.kill(a, no_restart=True)
            _wait_alive(holder["tk_base"])

        def tr_before(sizes=sizes):
            holder["tr_base"] = _alive()
            tr.initialize("ray", groups=[TrGroup(f"tr_start{suffix}", k, "cpu") for k, suffix in sizes],
                          namespace=NAMESPACE)

        def tr_after():
            holder.pop("tr")
            tr.shutdown()  # as B5: kills the gang, removes its placement group (Ray stays: we started it)
            _wait_alive(holder["tr_base"])

        r = compare(tr_start, tk_start, repeats=repeats, warmup=warmup, before=(tr_before, tk_before),
                    after=(tr_after, tk_after))
        what = {"default": "4 workers, each default on CPU (twinkle_ray: gloo; twinkle-kit: none)",
                "none": "4 workers, no torch.distributed on both",
                "gloo": "4 workers, gloo process group on both",
                "pair": "gangs of 4 + 2 workers, each default on CPU (twinkle_ray: gloo, "
                        "start_together(); twinkle-kit: none)"}[variant]
        rows.append({"name": f"start-up, {what}", "twinkle_ray_s": r["twinkle_s"],
                     "twinkle_kit_s": r["raw_s"], "ratio": r["ratio"], "paired_ratio": r["paired_ratio"],
                     "target": "<= 0.6x", "ok": r["ratio"] <= 0.6,
                     "samples": {"twinkle_ray": r["twinkle_samples"], "twinkle_kit": r["raw_samples"]}})
    return rows


# ---------------------------------------------------------------------------- (b) per call


def bench_call(n: int, repeats: int, lazy_calls: int, lazy_rounds: int) -> list[dict]:
    """(a) eager no-op on ``n`` workers, call + result; (b) the driver's CPU per lazy call."""
    tk = TkWorker(device_mesh=TkMesh.from_sizes(dp_size=n), remote_group=f"tk_call_{n}", instance_id=f"call{n}")
    trg = TrPlain(device_mesh=TrMesh.from_sizes(dp_size=n), remote_group=f"tr_call_{n}")
    tk.noop()()
    hop = Hop.options(max_concurrency=1000).remote(tk._actors)
    actors = tk._actors
    sides = {
        "twinkle_ray": lambda: trg.noop().get(),
        "twinkle_kit": lambda: tk.noop()(),
        "raw": lambda: ray.get([a.noop.remote() for a in actors]),
        "floor": lambda: ray.get(ray.get(hop.refs.remote())),
    }
    s = compare_many(sides, repeats=repeats, warmup=10)
    med = {k: statistics.median(v) for k, v in s.items()}
    rows = []
    for key, label in (("twinkle_ray", f"eager per call: no-op on {n} workers, call + result"),
                       ("raw", "  plain Ray on twinkle-kit's actors (its floor)"),
                       ("floor", "  one-hop floor: bare forwarding actor in front of them, refs back")):
        ratio, paired = ratios(s[key], s["twinkle_kit"])
        row = {"name": label, "kind": "eager", "workers": n, "side": key, "twinkle_ray_s": med[key],
               "twinkle_kit_s": med["twinkle_kit"], "ratio": ratio, "paired_ratio": paired, "samples": s[key]}
        if key == "twinkle_ray":
            fr, fp = ratios(s[key], s["floor"])
            row.update(vs_floor=fr, vs_floor_paired=fp, twinkle_kit_samples=s["twinkle_kit"])
            if n >= EAGER_TARGET_WORKERS:  # the target is stated at 24 workers
                row.update(target="<= 1.0x twinkle-kit", ok=ratio <= 1.0)
            else:  # B1's: at 4 workers the target is the one-hop floor
                row.update(target="<= 1.0x one-hop floor", ok=fr <= 1.0)
        rows.append(row)

    # the driver's CPU per lazy call: twinkle_ray's lazy result vs twinkle-kit's LazyCollect (not called)
    lazy = {
        "twinkle_ray": (trg.noop, lambda out: out.get()),
        "twinkle_kit": (tk.noop, lambda out: out()),
        "raw": (lambda: [a.noop.remote() for a in actors], ray.get),
    }
    for submit, drain in lazy.values():  # warm-up
        driver_cpu_per_call(submit, max(lazy_calls // 5, 5), drain)
    cpu: dict[str, list[float]] = {k: [] for k in lazy}
    names = list(lazy)
    orders = balanced_orders(len(names))
    for i in range(lazy_rounds):  # balanced orders, as compare_many
        for name in (names[j] for j in orders[i % len(orders)]):
            cpu[name].append(driver_cpu_per_call(lazy[name][0], lazy_calls, lazy[name][1]))
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    for key, label in (("twinkle_ray", f"driver CPU per lazy call, {n} workers ({lazy_calls} calls back to back)"),
                       ("raw", "  plain Ray: the driver submits the no-op to every worker")):
        ratio, paired = ratios(cpu[key], cpu["twinkle_kit"])
        row = {"name": label, "kind": "lazy_cpu", "workers": n, "side": key, "unit": "us",
               "twinkle_ray_s": cmed[key], "twinkle_kit_s": cmed["twinkle_kit"], "ratio": ratio,
               "paired_ratio": paired, "samples": cpu[key]}
        if key == "twinkle_ray":
            row["twinkle_kit_samples"] = cpu["twinkle_kit"]
            if n >= EAGER_TARGET_WORKERS:
                row.update(target="<= 0.1x twinkle-kit", ok=ratio <= 0.1)
        rows.append(row)
    trg.close()
    for a in actors:
        ray.kill(a, no_restart=True)
    ray.kill(hop)
    return rows


def flatness(rows: list[dict]) -> None:
    """Adds to each twinkle_ray driver-CPU row its ratio to the smallest size's (target <= 1.2x)."""
    cpu = [r for r in rows if r.get("kind") == "lazy_cpu" and r["side"] == "twinkle_ray"]
    if len(cpu) < 2:
        return
    base = min(cpu, key=lambda r: r["workers"])
    for r in cpu:
        if r is base:
            continue
        r["vs_smallest"] = r["twinkle_ray_s"] / base["twinkle_ray_s"]
        r["smallest_workers"] = base["workers"]
        flat_ok = r["vs_smallest"] <= 1.2
        r["target"] = (r.get("target", "") + "; " if "target" in r else "") + \
            f"<= 1.2x its {base['workers']}-worker figure"
        r["ok"] = r.get("ok", True) and flat_ok


# ---------------------------------------------------------------------------- (c) flow
def bench_flow(total_mb: int, repeats: int) -> list[dict]:
    trace_dir = tempfile.mkdtemp(prefix="peer-trace-")
    per = total_mb // 4
    tk_p = TkWorker(device_mesh=TkMesh.from_sizes(dp_size=4), remote_group="tk_prod", instance_id="prod")
    tk_c = TkWorker(device_mesh=TkMesh.from_sizes(dp_size=2), remote_group="tk_cons", instance_id="cons")
    tr_p = TrPlain(device_mesh=TrMesh.from_sizes(dp_size=4), remote_group="tr_prod")
    tr_c = TrPlain(device_mesh=TrMesh.from_sizes(dp_size=2), remote_group="tr_cons")
    expected = float(total_mb * CHUNK_ROWS * CHUNK_COLS)

    def tk_flow():
        got = tk_c.consume(tk_p.produce(per, trace_dir))()
        assert got == expected, (got, expected)

    def tr_flow():
        got = tr_c.consume(tr_p.produce(per, trace_dir)).get()
        assert got == expected, (got, expected)

    r = compare(tr_flow, tk_flow, repeats=repeats, warmup=2)
    row = {"name": f"flow: dp=4 producer -> dp=2 consumer, {total_mb} MB, call to value",
           "twinkle_ray_s": r["twinkle_s"], "twinkle_kit_s": r["raw_s"], "ratio": r["ratio"],
           "paired_ratio": r["paired_ratio"], "target": "<= 1.0x", "ok": r["ratio"] <= 1.0, "kind": "flow",
           "samples": {"twinkle_ray": r["twinkle_samples"], "twinkle_kit": r["raw_samples"]}}

    # payload path: one traced run per side
    driver = os.getpid()
    paths = {}
    for side, fn, cons, prod in (("twinkle_ray", tr_flow, tr_c, tr_p), ("twinkle_kit", tk_flow, tk_c, tk_p)):
        cons_pids = set(cons.pid().get() if side == "twinkle_ray" else cons.pid()())
        prod_pids = set(prod.pid().get() if side == "twinkle_ray" else prod.pid()())
        payload.clear(trace_dir)
        fn()
        got = payload.bytes_by_pid(trace_dir)
        paths[side] = {
            "driver_mb": got.get(driver, 0) / 2**20,
            "consumers_mb": sum(v for p, v in got.items() if p in cons_pids) / 2**20,
            "producers_mb": sum(v for p, v in got.items() if p in prod_pids) / 2**20,
            "other_mb": sum(v for p, v in got.items() if p not in cons_pids | prod_pids | {driver}) / 2**20,
        }
    row["payload"] = paths
    tr_p.close()
    tr_c.close()
    for a in tk_p._actors + tk_c._actors:
        ray.kill(a, no_restart=True)
    return [row]


# ---------------------------------------------------------------------------- main
def _cell(r: dict, key: str) -> str:
    return f"{r[key] * 1e6:.0f} us" if r.get("unit") == "us" else _fmt(r[key])


def table(rows: list[dict]) -> str:
    out = ["| benchmark | twinkle_ray | twinkle-kit 0.5.1 | ratio | target | |", "|---|---:|---:|---:|---|---|"]
    for r in rows:
        target, ok = r.get("target", ""), ""
        if "ok" in r:
            ok = "ok" if r["ok"] else "miss"
        notes = []
        if "vs_floor" in r:
            notes.append(f"{r['vs_floor']:.2f}x the one-hop floor")
        if "vs_smallest" in r:
            notes.append(f"{r['vs_smallest']:.2f}x its {r['smallest_workers']}-worker figure")
        if notes:
            target = f"{target} (this row: {'; '.join(notes)})"
        out.append(f"| {r['name']} | {_cell(r, 'twinkle_ray_s')} | {_cell(r, 'twinkle_kit_s')} | {r['ratio']:.2f}x "
                   f"| {target} | {ok} |")
    for r in rows:
        if "payload" in r:
            for side, p in r["payload"].items():
                out.append(f"\npayload unpickled, {side}: driver {p['driver_mb']:.0f} MB, consumer workers "
                           f"{p['consumers_mb']:.0f} MB, producers {p['producers_mb']:.0f} MB, "
                           f"other processes {p['other_mb']:.0f} MB")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer repeats, workers 4,8, 16 MB flow (a few minutes)")
    ap.add_argument("--json", action="store_true",
                    help="one JSON line on stdout (Ray's raylet warnings may share stdout: take the line "
                         "starting with {), the table on stderr")
    ap.add_argument("--only", default="startup,call,flow", help="comma list of startup, call, flow")
    ap.add_argument("--workers", default=None,
                    help="comma list of gang sizes for the per-call rows (default 4,24; --quick: 4,8)")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    sizes = [int(x) for x in (args.workers or ("4,8" if args.quick else "4,24")).split(",")]
    load = os.getloadavg()
    t0 = time.monotonic()
    # twinkle-kit puts every CPU group on one node only if ncpu_proc_per_node >= all their ranks,
    # and it takes a node for CPU work only if its CPU // 4 >= ncpu_proc_per_node
    tk_groups = [TkGroup(name="tk_start", ranks=4, device_type="CPU"),
                 TkGroup(name="tk_start2", ranks=2, device_type="CPU"),
                 TkGroup(name="tk_prod", ranks=4, device_type="CPU"),
                 TkGroup(name="tk_cons", ranks=2, device_type="CPU")]
    tk_groups += [TkGroup(name=f"tk_call_{n}", ranks=n, device_type="CPU") for n in sizes]
    ncpu_proc = max(16, sum(g.ranks for g in tk_groups))
    ray.init(address="local", num_cpus=max(64, 4 * ncpu_proc), include_dashboard=False, namespace=NAMESPACE,
             log_to_driver=False, _node_ip_address="127.0.0.1")
    twinkle.initialize(mode="ray", ncpu_proc_per_node=ncpu_proc, groups=tk_groups)
    rows: list[dict] = []
    try:
        tr.initialize("ray", groups=[TrGroup("tr_prod", 4, "cpu"), TrGroup("tr_cons", 2, "cpu")]
                      + [TrGroup(f"tr_call_{n}", n, "cpu") for n in sizes], namespace=NAMESPACE)
        if "call" in only:
            for n in sizes:  # one size's gangs at a time: 2 x 24 worker processes are enough on a small VM
                rows += bench_call(n, 60 if args.quick else 200, 100, 3 if args.quick else 7)
                print(table(rows), file=sys.stderr, flush=True)  # partial results survive a long run
            flatness(rows)
        if "flow" in only:
            rows += bench_flow(16, 7) if args.quick else bench_flow(256, 15)
            print(table(rows), file=sys.stderr, flush=True)
        tr.shutdown()
        if "startup" in only:  # last (the slowest part): each twinkle_ray start-up starts and ends a runtime
            if args.quick:
                rows += bench_startup(2, ["default", "none", "pair"], warmup=0)
            else:
                rows += bench_startup(4, ["default", "none", "pair"]) + bench_startup(2, ["gloo"])
    finally:
        tr.shutdown()
        ray.shutdown()
    info = {"load_avg_start": load, "load_avg_end": os.getloadavg(), "wall_s": time.monotonic() - t0,
            "workers": sizes, "python": sys.version.split()[0], "ray": ray.__version__,
            "twinkle_ray_file": tr.__file__, "bench_file": payload.__file__,
            "twinkle_kit": subprocess.run([sys.executable, "-m", "pip", "show", "twinkle-kit"], capture_output=True,
                                          text=True).stdout.split("Version: ")[-1].split("\n")[0]}
    text = table(rows) + f"\n\nload average at start {load[0]:.1f}, at end {info['load_avg_end'][0]:.1f}; " \
                         f"{info['wall_s']:.0f} s; twinkle_ray from {os.path.dirname(tr.__file__)}, " \
                         f"bench from {os.path.dirname(payload.__file__)}"
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps({"info": info, "rows": rows}))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
