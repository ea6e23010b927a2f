"""B9: generation overlapping training, through ``sync_weights(..., wait=False)``.

A sampler gang whose ``generate`` sleeps G and a trainer gang whose ``train``
sleeps T (G = T = ``seconds``: 1 s, 0.5 s in the quick run; two workers each, tiny real torch models, real weight syncs). The
same steps run two ways in one session:

- sequential: generate k, train k on it, sync (``wait=True``): about G + T + sync;
- overlapped (``--async 1``): generation of step k+1 is submitted before
  training step k, and the sync of step k's weights after both
  (``wait=False``): the ideal is max(G, T) + sync.

Every sample says which policy version made it: sequential steps train on
samples of their own version, overlapped ones on samples one version old
(the first on its own).

Example::

    rows = bench_overlap(steps=6, seconds=1.0)   # [{'name': 'B9 ...', 'twinkle_s': ..., 'raw_s': ideal, 'ratio': ...}, ...]
"""

from __future__ import annotations

import statistics
import time

import torch

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import WeightSyncMixin, sync_weights

NAMESPACE = "twinkle-bench"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    m.register_buffer("version", torch.zeros((), dtype=torch.long))
    return m


@remote_class()
class SleepySampler(WeightSyncMixin):
    """Generates for G seconds; each sample carries the policy version it was made with."""

    def __init__(self, device_mesh=None):
        self.model = _model()

    @remote_function(dispatch="slice_dp", collect="flatten")
    def generate(self, prompts: list, seconds: float) -> list[int]:
        time.sleep(seconds)
        return [int(self.model.version)] * len(prompts)


@remote_class()
class SleepyTrainer(WeightSyncMixin):
    """Trains for T seconds on samples; returns (the samples' versions, its own before the step)."""

    def __init__(self, device_mesh=None):
        self.model = _model()

    @remote_function(dispatch="slice_dp", collect="first")
    def train(self, samples: list, seconds: float) -> dict:
        time.sleep(seconds)
        before = int(self.model.version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01)
            self.model.version += 1
        return {"sample_version": min(samples), "trainer_version": before}


def _sequential(sampler, trainer, prompts: list, steps: int, seconds: float) -> tuple[float, list[int]]:
    stale = []
    t0 = time.perf_counter()
    for _ in range(steps):
        out = trainer.train(sampler.generate(prompts, seconds), seconds)()
        sync_weights(trainer, sampler)
        stale.append(out["trainer_version"] - out["sample_version"])
    return (time.perf_counter() - t0) / steps, stale


def _overlapped(sampler, trainer, prompts: list, steps: int, seconds: float) -> tuple[float, list[int]]:
    stale = []
    ahead = sampler.generate(prompts, seconds)  # step 1's samples
    handle = None
    t0 = time.perf_counter()
    for k in range(steps):
        samples, ahead = ahead, (sampler.generate(prompts, seconds) if k + 1 < steps else None)
        out = trainer.train(samples, seconds)
        handle = sync_weights(trainer, sampler, wait=False)  # after both, in both gangs' order
        out = out()
        stale.append(out["trainer_version"] - out["sample_version"])
    twinkle.get(handle)
    return (time.perf_counter() - t0) / steps, stale


def bench_overlap(steps: int = 6, seconds: float = 1.0) -> list[dict]:
    """B9 rows: overlapped and sequential seconds per step against their ideals (G = T = ``seconds``)."""
    twinkle.initialize("ray", groups=[DeviceGroup("b9s", 2, "cpu"), DeviceGroup("b9t", 2, "cpu")],
                       namespace=NAMESPACE)
    mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    sampler = SleepySampler(device_mesh=mesh, remote_group="b9s")
    trainer = SleepyTrainer(device_mesh=mesh, remote_group="b9t")
    prompts = list(range(8))
    try:
        sync_weights(trainer, sampler)  # set up once
        walls = []
        for _ in range(5):  # the sync alone, gangs idle
            t0 = time.perf_counter()
            sync_weights(trainer, sampler)
            walls.append(time.perf_counter() - t0)
        sync_s = statistics.median(walls)
        _overlapped(sampler, trainer, prompts, 2, seconds)  # warm-up: every call path used once
        seq_s, seq_stale = _sequential(sampler, trainer, prompts, steps, seconds)
        ovl_s, ovl_stale = _overlapped(sampler, trainer, prompts, steps, seconds)
    finally:
        twinkle.shutdown()
    ideal_ovl, ideal_seq = seconds + sync_s, 2 * seconds + sync_s  # max(G, T) + sync, G + T + sync
    common = {"unit": "s", "sync_s": sync_s, "steps": steps}
    return [
        {"name": f"B9 overlapped step (--async 1), G=T={seconds:g}s; vs max(G,T)+sync", "twinkle_s": ovl_s,
         "raw_s": ideal_ovl, "ratio": ovl_s / ideal_ovl, "staleness": ovl_stale,
         "speedup_vs_sequential": seq_s / ovl_s, "target": "overlapped <= 1.15x ideal",
         "checks": [("ratio", "<=", 1.15)], **common},
        {"name": f"B9 sequential step, G=T={seconds:g}s; vs G+T+sync", "twinkle_s": seq_s, "raw_s": ideal_seq,
         "ratio": seq_s / ideal_seq, "staleness": seq_stale, **common},
    ]


__all__ = ["bench_overlap"]
