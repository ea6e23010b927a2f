"""W1: weight sync from a pp=2 trainer gang to 2 receivers across 2 raylets, rank-0 path vs per-stage sources.

A ``ray.cluster_utils.Cluster`` of two raylets on this machine (node A: the trainer gang, 2 workers =
2 pipeline stages of plain torch tensors; node B: the 2 receivers, each holding the whole model, as a
TP=1 vLLM engine does). The same model (about 400 MB fp32; ``--quick``: 25 MB) is synced both ways in
one run, through the same receivers:

- rank-0 path: stage 1 sends its layers to rank 0, which broadcasts the whole model (one lane);
- per-stage: each stage sends its own layers on a lane of its own, both stages in parallel.

Printed: the sync seconds (median of the timed syncs, after a first one that sets the channel up) and
the bytes written by the busiest trainer process (``SyncStats.sent_bytes``: each process's
``/proc/self/io`` wchar delta over the sync: the wire bytes of the transfer and of the funnel).
Target: busiest per-stage <= 0.55x busiest rank-0 path (DESIGN section 10: 1/pp + 0.05).

Usage::

    python -m bench.weight_sync            # ~400 MB, 3 timed syncs per path
    python -m bench.weight_sync --quick    # ~25 MB, 2 timed syncs per path
    python -m bench.weight_sync --json
    python -m bench --only W1 [--quick]    # the same, as a row of the bench table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from twinkle_ray import DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import WeightSync, WeightSyncMixin

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 6


def layer_names(stage: int, stages: int = 2) -> list[str]:
    per = LAYERS // stages
    return [f"layers.{i}.weight" for i in range(stage * per, (stage + 1) * per)]


def layer_tensor(name: str, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(name.split(".")[1]) + 1)
    return torch.randn(width, width, generator=g)


@remote_class()
class StageSource(WeightSyncMixin):
    """A pp=2 trainer of plain tensors: each rank holds its stage's layers (``funnel``: the rank-0 path)."""

    def __init__(self, width: int, funnel: bool, device_mesh: DeviceMesh):
        self.width, self.funnel = width, funnel
        self.pp, self.stage = device_mesh.get_dim_size("pp"), device_mesh.get_local_rank("pp")
        self.tensors = {n: layer_tensor(n, width) for n in layer_names(self.stage, self.pp)}

    def weight_sync_lane(self):
        return super().weight_sync_lane() if self.funnel else (self.stage, self.pp)

    def weight_sync_tensors(self) -> dict:
        if not self.funnel:
            return self.tensors  # this stage's own layers, on its own lane
        import torch.distributed as dist

        if self.stage > 0:  # the funnel: stage k's layers go to rank 0 first
            for t in self.tensors.values():
                dist.send(t, dst=0)
            return {}
        out = dict(self.tensors)
        for stage in range(1, self.pp):
            for n in layer_names(stage, self.pp):
                out[n] = torch.empty(self.width, self.width)
                dist.recv(out[n], src=stage)
        return out


@remote_class()
class FullReceiver(WeightSyncMixin):
    """A receiver holding the whole model (as a TP=1 vLLM engine does)."""

    def __init__(self, width: int, device_mesh: DeviceMesh):
        self.width = width
        self.state = {n: torch.zeros(width, width) for s in range(2) for n in layer_names(s)}

    def weight_sync_targets(self) -> dict:
        return self.state

    @remote_function(dispatch="all", collect="none")
    def correct(self) -> bool:
        return all(torch.equal(t, layer_tensor(n, self.width)) for n, t in self.state.items())

    @remote_function(dispatch="all")
    def clear(self) -> None:
        for t in self.state.values():
            t.zero_()


def _path(funnel: bool, width: int, repeats: int, receivers) -> dict:
    """One path: its trainer gang, a first sync (channel set-up), then ``repeats`` timed syncs."""
    mesh = DeviceMesh.from_sizes(pp_size=2, device_type="cpu")
    trainer = StageSource(width, funnel, device_mesh=mesh, remote_group="w1_trainer")
    ws = WeightSync(trainer, receivers)
    try:
        nodes = {r["node_id"] for r in trainer.topology()["ranks"]}
        receivers.clear()()
        ws.sync()
        assert all(receivers.correct()()), "a receiver's weights differ from the trainer's"
        times, busiest, stats = [], [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            stats = ws.sync()
            times.append(time.perf_counter() - t0)
            busiest.append(stats.busiest_sent)
        return {"sync_s": statistics.median(times), "busiest_bytes": statistics.median(busiest),
                "sent_bytes": stats.sent_bytes, "lanes": stats.lanes, "payload_bytes": stats.bytes,
                "nodes": nodes}
    finally:
        ws.close()
        trainer.close()


def run(argv: list[str] | None = None) -> dict:
    """Build the cluster, sync both ways, tear it all down; return the W1 row."""
    p = argparse.ArgumentParser(prog="python -m bench.weight_sync", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="~25 MB instead of ~400 MB")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    width, repeats = (1024, 2) if args.quick else (4096, 3)  # 6 layers of width^2 fp32
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    import ray
    from ray.cluster_utils import Cluster

    import twinkle_ray as twinkle
    from twinkle_ray import DeviceGroup

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, namespace="twinkle-bench", log_to_driver=False,
                 logging_level="WARNING")
        twinkle.initialize("ray", namespace="twinkle-bench", groups=[
            DeviceGroup("w1_trainer", 2, "cpu", strategy="STRICT_PACK"),
            DeviceGroup("w1_receivers", 2, "cpu", strategy="STRICT_PACK")])
        receivers = FullReceiver(width, device_mesh=DeviceMesh.from_sizes(dp_size=2, device_type="cpu"),
                                 remote_group="w1_receivers")
        nodes = {r["node_id"] for r in receivers.topology()["ranks"]}
        rank0 = _path(True, width, repeats, receivers)
        stages = _path(False, width, repeats, receivers)
        assert len(nodes) == 1 and not nodes & (rank0["nodes"] | stages["nodes"]), "not across 2 raylets"
    finally:
        twinkle.shutdown()
        ray.shutdown()
        cluster.shutdown()
    model_mb = LAYERS * width * width * 4 / 1e6
    ratio = stages["busiest_bytes"] / rank0["busiest_bytes"]
    return {
        "name": f"W1 weight sync {model_mb:.0f} MB, pp=2 -> 2 receivers, 2 raylets (per-stage vs rank-0)",
        "unit": "s", "twinkle_s": stages["sync_s"], "raw_s": rank0["sync_s"],
        "ratio": stages["sync_s"] / rank0["sync_s"], "model_mb": model_mb,
        "busiest_stage_mb": stages["busiest_bytes"] / 1e6, "busiest_rank0_mb": rank0["busiest_bytes"] / 1e6,
        "bytes_ratio": ratio, "sent_bytes_stage": stages["sent_bytes"], "sent_bytes_rank0": rank0["sent_bytes"],
        "lanes": [rank0["lanes"], stages["lanes"]],
        "target": "busiest process <= 0.55x rank-0 path", "checks": [["bytes_ratio", "<=", 0.55]],
    }


def describe(row: dict) -> str:
    """The row in words (what ``python -m bench.weight_sync`` prints)."""
    return (f"{row['name']}\n"
            f"  sync seconds: rank-0 path {row['raw_s']:.2f} s, per-stage {row['twinkle_s']:.2f} s "
            f"({row['ratio']:.2f}x)\n"
            f"  busiest trainer process wrote: rank-0 path {row['busiest_rank0_mb']:.0f} MB, per-stage "
            f"{row['busiest_stage_mb']:.0f} MB ({row['bytes_ratio']:.2f}x; target <= 0.55x)\n"
            f"  per process, rank-0 path: {_mb(row['sent_bytes_rank0'])}; per-stage: {_mb(row['sent_bytes_stage'])}")


def _mb(sent: dict) -> str:
    return ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in sorted(sent.items()))


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    row = run(argv)
    if "--json" in (argv if argv is not None else sys.argv[1:]):
        print(describe(row), file=sys.stderr)
        print(json.dumps(row))
    else:
        print(describe(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
