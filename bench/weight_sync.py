"""W2: weight sync of a 64 MB model from a tp x pp x dp trainer gang to S samplers, resharded vs broadcast.

Both paths run in the same process, on the same gangs, the same model (Megatron-style fused layout:
:mod:`tests.weights_helpers`), one after the other:

- resharded (the library, :mod:`twinkle_ray.weights`): every trainer rank sends the rows it holds that
  each receiver keeps, over point-to-point pairs; samplers spread over the data-parallel replicas;
- broadcast (the path before it, bench-local: :mod:`bench.w2_broadcast`): per pipeline stage, its first
  TP rank of data rank 0 gathers the stage's TP shards and broadcasts full tensors to every sampler.

Printed per size: wall time of a sync (median of the timed ones, after a first that sets up) and its
ratio to broadcast, bytes sent by the busiest trainer process (payload) against the fair share
(total / trainer ranks), bytes received by the busiest sampler, total bytes; the broadcast's figures
beside. Then a projection for a 70B model (tp8 x pp4 x dp4 -> 32 engines, 25 GB/s per link).

Usage::

    python -m bench.weight_sync --w2            # 64 MB, sizes 1x1->1, tp2xpp2->2, tp2xpp2xdp2->4
    python -m bench.weight_sync --w2 --quick    # ~6.5 MB
    python -m bench.weight_sync --w2 --json
    python -m bench.weight_sync --soak 500      # 500 mixed syncs: fds, threads, RSS of every process

Each W2 row also gives the cost of ``only_changed``'s fingerprint (BLAKE2b over the raw bytes, seconds
per GB in this process) and the wall time of an ``only_changed`` sync that finds nothing changed,
beside the sync that sends everything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(ROOT / "bench"))

SIZES = [((1, 1, 1), 1), ((2, 2, 1), 2), ((2, 2, 2), 4)]
LINK_GBPS = 25.0


def _one(tp: int, pp: int, dp: int, samplers: int, scale: int, repeats: int) -> dict:
    from w2_broadcast import BcastSampler, BcastTrainer
    from weights_helpers import expected_digests, model_bytes

    import twinkle_ray
    from twinkle_ray import DeviceGroup
    from twinkle_ray.weights import WeightSync

    n = tp * pp * dp
    twinkle_ray.initialize(groups=[DeviceGroup("trainer", n, "cpu", cpus_per_worker=0.1),
                                   DeviceGroup("sampler", samplers, "cpu", cpus_per_worker=0.1)],
                           num_cpus=8, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                               [str(ROOT), str(TESTS), str(ROOT / "bench")])}})
    try:
        trainer = BcastTrainer(None, tp, pp, dp, version=1.0, scale=scale, remote_group="trainer")
        sampler = BcastSampler(None, 1, scale=scale, remote_group="sampler")
        size = model_bytes(hidden=64 * scale, ff=128 * scale, vocab=256 * scale)
        # resharded
        ws = WeightSync(trainer, sampler, timeout_s=300)
        ws.sync()
        times, stats = [], None
        for r in range(repeats):
            trainer.set_version(2.0 + r)()
            t0 = time.perf_counter()
            stats = ws.sync()
            times.append(time.perf_counter() - t0)
        ok = sampler.digests()() == [expected_digests(1.0 + repeats, 1, i, scale=scale) for i in range(samplers)] \
            if samplers > 1 else sampler.digests()() == expected_digests(1.0 + repeats, 1, 0, scale=scale)
        recv = ws.channels()
        ws.sync(only_changed=True)  # changes tracked from here: this one sends everything
        noop = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            assert ws.sync(only_changed=True).bytes == 0
            noop.append(time.perf_counter() - t0)
        ws.close()
        # broadcast (the old path), same gangs
        lanes = trainer.bcast_host()()
        twinkle_ray.get([trainer.bcast_join(samplers), sampler.bcast_join(lanes, samplers)])
        btimes, bsend, brecv = [], None, None
        for r in range(repeats + 1):
            trainer.set_version(10.0 + r)()
            t0 = time.perf_counter()
            s, rc = trainer.bcast_send(), sampler.bcast_recv(pp, 4)
            bsend, brecv = s(), rc()
            if r:
                btimes.append(time.perf_counter() - t0)
        bok = sampler.digests()() == ([expected_digests(10.0 + repeats, 1, i, scale=scale) for i in range(samplers)]
                                      if samplers > 1 else expected_digests(10.0 + repeats, 1, 0, scale=scale))
    finally:
        twinkle_ray.shutdown()
    payload = stats.payload_bytes
    total = stats.bytes
    fair = total / n
    busiest_recv = total // samplers  # every full sampler keeps the model: the plan sends it once each
    bb = max(x["payload"] for x in bsend)
    return {
        "size": f"tp{tp}xpp{pp}xdp{dp}->{samplers}", "model_mb": size / 2**20, "bit_exact": bool(ok and bok),
        "resharded_s": statistics.median(times), "broadcast_s": statistics.median(btimes),
        "ratio": statistics.median(times) / statistics.median(btimes),
        "only_changed_noop_s": statistics.median(noop), "fingerprint_s_per_gb": fingerprint_cost(),
        "busiest_trainer_mb": max(payload.values()) / 2**20, "fair_share_mb": fair / 2**20,
        "busiest_vs_fair": max(payload.values()) / fair, "senders": len(payload),
        "busiest_sampler_mb": busiest_recv / 2**20, "total_mb": total / 2**20,
        "kept_mb": size * samplers / 2**20,
        "broadcast_busiest_trainer_mb": bb / 2**20,
        "broadcast_busiest_trainer_written_mb": max(x["written"] for x in bsend) / 2**20,
        "broadcast_busiest_sampler_mb": max(x["received"] for x in brecv) / 2**20,
        "broadcast_total_mb": sum(x["payload"] for x in bsend) * samplers / 2**20,
        "resharded_written_mb": max(stats.sent_bytes.values()) / 2**20,
        "pairs": sum(c["pairs"] for r in recv["trainer"] for c in r["sources"].values()),
    }


def fingerprint_cost(mb: int = 64) -> float:
    """Seconds per GB (1e9 bytes) of the ``only_changed`` fingerprint in this process (best of 3)."""
    import torch

    from twinkle_ray.weights import fingerprint

    t = torch.randn(mb << 18)  # mb MB of float32
    best = min(_timed(fingerprint, t) for _ in range(3))
    return best / (t.numel() * 4 / 1e9)


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _proc(pid: int) -> dict:
    """Open fds, threads and RSS (MB) of process ``pid`` (this node's /proc)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    field = {line.split(":")[0]: line.split(":")[1].split() for line in status}
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(field["Threads"][0]),
            "rss_mb": int(field["VmRSS"][0]) / 1024}


def soak(syncs: int = 500, scale: int = 2) -> dict:
    """``syncs`` syncs in a row from a tp2 x dp2 trainer to two sampler gangs (one tensor-parallel),
    plain, ``names=`` subsets and ``only_changed`` mixed, the trainer's weights changing between them:
    every trainer and sampler process's open fds, threads and RSS after the first sync and at the end,
    and the weights checked bit-exact at the end."""
    import random

    from weights_helpers import LayoutSampler, LayoutTrainer, expected_digests

    import twinkle_ray
    from twinkle_ray import DeviceGroup
    from twinkle_ray.weights import WeightSync

    twinkle_ray.initialize(groups=[DeviceGroup("trainer", 4, "cpu", cpus_per_worker=0.1),
                                   DeviceGroup("full", 1, "cpu", cpus_per_worker=0.1),
                                   DeviceGroup("tp", 2, "cpu", cpus_per_worker=0.1)],
                           num_cpus=8, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                               [str(ROOT), str(TESTS), str(ROOT / "bench")])}})
    try:
        trainer = LayoutTrainer(None, 2, 1, 2, version=1.0, scale=scale, remote_group="trainer")
        full = LayoutSampler(None, 1, scale=scale, remote_group="full")
        tp = LayoutSampler(None, 2, scale=scale, remote_group="tp")
        ws = WeightSync(trainer, [full, tp], timeout_s=120)
        ws.sync()
        pids = {"trainer": trainer.pid()(), "full sampler": [full.pid()()], "tp sampler": tp.pid()()}
        pids["driver"] = [os.getpid()]

        def figures() -> dict:
            return {f"{who} {i}": _proc(pid) for who, ps in pids.items() for i, pid in enumerate(ps)}

        start = figures()
        names = sorted(expected_digests(1.0, 1, 0, scale=scale))
        rng = random.Random(46)
        version, t0, kinds = 1.0, time.perf_counter(), {"plain": 0, "names": 0, "only_changed": 0}
        middle: dict = {}
        for i in range(syncs):
            if i == syncs // 2:
                middle = figures()
            kind = rng.choice(list(kinds))
            kinds[kind] += 1
            if rng.random() < 0.5:
                version += 1
                trainer.set_version(version)()
            if kind == "plain":
                ws.sync()
            elif kind == "names":
                ws.sync(names=rng.sample(names, 3))
            else:
                ws.sync(only_changed=True)
        took = time.perf_counter() - t0
        ws.sync(only_changed=True)  # everything the syncs above left behind: now exact
        exact = full.digests()() == expected_digests(version, 1, 0, scale=scale) and \
            tp.digests()() == [expected_digests(version, 2, r, scale=scale) for r in range(2)]
        end = figures()
        ws.close()
    finally:
        twinkle_ray.shutdown()
    return {"syncs": syncs, "kinds": kinds, "seconds": took, "exact": exact, "start": start, "middle": middle,
            "end": end}


def projection(params: float = 70e9, bytes_per: int = 2, tp: int = 8, pp: int = 4, dp: int = 4,
               engines: int = 32, link_gbps: float = LINK_GBPS) -> dict:
    """The busiest process's bytes per sync and its time at ``link_gbps`` per link, resharded vs the
    rank-0 path (one rank gathers and sends every engine a full copy) and the per-stage broadcast."""
    model = params * bytes_per
    ranks = tp * pp * dp
    resharded = model * engines / ranks  # every rank sends its 1/(tp*pp) to engines/dp engines
    rank0 = model * engines  # rank 0 sends a full copy to every engine (after gathering the model)
    per_stage = model / pp * engines  # each stage's source sends its stage to every engine
    ring = model  # rank 0 with a pipelined ring broadcast: one copy out of the source, engines forward
    gb = 1e9
    return {"model_gb": model / gb, "ranks": ranks, "engines": engines,
            "rank0_ring_busiest_gb": ring / gb, "rank0_ring_s": ring / gb / link_gbps,
            "receiver_gb": model / gb, "receiver_s": model / gb / link_gbps,
            "resharded_busiest_gb": resharded / gb, "resharded_s": resharded / gb / link_gbps,
            "rank0_busiest_gb": rank0 / gb, "rank0_s": rank0 / gb / link_gbps,
            "per_stage_busiest_gb": per_stage / gb, "per_stage_s": per_stage / gb / link_gbps,
            "gain_vs_rank0": rank0 / resharded, "gain_vs_per_stage": per_stage / resharded}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--w2", action="store_true", help="the W2 rows (the default)")
    p.add_argument("--quick", action="store_true", help="~6.5 MB instead of 64 MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--soak", type=int, default=0, metavar="N", help="N mixed syncs: every process's fds, "
                                                                     "threads, RSS at start and end")
    args = p.parse_args(argv)
    if args.soak:
        out = soak(args.soak)
        if args.json:
            print(json.dumps(out))
            return 0
        print(f"{out['syncs']} syncs ({out['kinds']}) in {out['seconds']:.1f}s, exact at the end: {out['exact']}")
        print(f"{'process':<16}{'fds (start, half-way, end)':>28}{'threads':>16}{'RSS MB':>26}")
        for who, a in out["start"].items():
            m, b = out["middle"][who], out["end"][who]
            print(f"{who:<16}{a['fds']:>12}{m['fds']:>8}{b['fds']:>8}{a['threads']:>8}{m['threads']:>4}"
                  f"{b['threads']:>4}{a['rss_mb']:>10.1f}{m['rss_mb']:>8.1f}{b['rss_mb']:>8.1f}")
        return 0
    scale = 3 if args.quick else 10
    rows = [_one(*layout, samplers, scale, args.repeats) for layout, samplers in SIZES]
    proj = projection()
    if args.json:
        print(json.dumps({"W2": rows, "projection": proj}))
        return 0
    print(f"W2: {rows[0]['model_mb']:.1f} MB model; resharded (pairs) vs broadcast (per-stage gather + bcast)")
    print(f"{'size':<18}{'wall s':>9}{'bcast s':>9}{'ratio':>7}{'busiest tr MB':>15}{'fair MB':>9}"
          f"{'x fair':>7}{'busiest smp MB':>16}{'total MB':>10}{'kept MB':>9}{'bcast busiest tr':>18}{'exact':>7}")
    for r in rows:
        print(f"{r['size']:<18}{r['resharded_s']:>9.3f}{r['broadcast_s']:>9.3f}{r['ratio']:>7.2f}"
              f"{r['busiest_trainer_mb']:>15.1f}{r['fair_share_mb']:>9.1f}{r['busiest_vs_fair']:>7.2f}"
              f"{r['busiest_sampler_mb']:>16.1f}{r['total_mb']:>10.1f}{r['kept_mb']:>9.1f}"
              f"{r['broadcast_busiest_trainer_mb']:>18.1f}{str(r['bit_exact']):>7}")
        print(f"{'':<18}only_changed with nothing changed {r['only_changed_noop_s']:.3f}s wall (a full sync "
              f"{r['resharded_s']:.3f}s); its fingerprint costs {r['fingerprint_s_per_gb']:.2f}s per GB here")
    print(f"projection, 70B bf16 tp8xpp4xdp4 -> 32 engines at {LINK_GBPS:g} GB/s per link: busiest process "
          f"{proj['resharded_busiest_gb']:.1f} GB ({proj['resharded_s']:.2f}s) resharded vs "
          f"{proj['rank0_busiest_gb']:.0f} GB ({proj['rank0_s']:.1f}s) rank-0 path, "
          f"{proj['per_stage_busiest_gb']:.0f} GB ({proj['per_stage_s']:.1f}s) per-stage source sending copies, "
          f"{proj['rank0_ring_busiest_gb']:.0f} GB ({proj['rank0_ring_s']:.1f}s) rank 0 with a ring broadcast")
    return 0


if __name__ == "__main__":
    sys.exit(main())
