"""Hand-written raw Ray equivalents: what a user would write without twinkle_ray.

A ``RawGang`` is ``n`` plain ``@ray.remote`` actors pinned one per bundle of
its own placement group (the same bundles twinkle_ray reserves for a
DeviceGroup), with the same environment variables, optionally joined in a
gloo torch.distributed world. Calls go straight from the driver to the
actors: ``ray.get([a.f.remote(...) for a in actors])``.

Example::

    gang = RawGang(4, distributed=False)
    ray.get([a.noop.remote() for a in gang.actors])
    gang.close()
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class RawWorker:
    """The raw-Ray worker: the same methods as the bench's twinkle_ray class."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str]):
        os.environ.update(env)
        self.rank, self.world_size = rank, world_size
        self.cached: dict = {}

    def endpoint(self) -> int:
        """A free TCP port for MASTER_PORT."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_dist(self, port: int) -> str:
        """Join a gloo world of ``world_size`` ranks."""
        import torch.distributed as dist

        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank,
            world_size=self.world_size, timeout=timedelta(seconds=120),
        )
        return "gloo"

    def noop(self) -> None:
        """Nothing: the cost of a call."""
        return None

    def step(self, xs: list) -> list:
        """One link of the B2 chain: pass the input on."""
        return xs

    def consume(self, batch: np.ndarray) -> int:
        """B3: touch the slice, return its length."""
        return int(batch.shape[0])

    def produce(self, rows: int, cols: int, trace_dir: str) -> dict:
        """B4 producer: a traced batch (cached so the timed part is the transfer)."""
        from bench.payload import Tracer, make_batch

        key = (rows, cols)
        if key not in self.cached:
            self.cached[key] = make_batch(rows, cols, trace_dir)["x"]
        x = self.cached[key]
        return {"x": x, "tag": Tracer(trace_dir, x.nbytes)}

    def join(self, *parts: dict) -> float:
        """B4 consumer: concatenate the producer parts (as a dp consumer needs), return a checksum."""
        x = np.concatenate([p["x"] for p in parts]) if len(parts) > 1 else parts[0]["x"]
        return float(x[0, 0] + x[-1, -1]) + x.shape[0]

    def fetch(self, refs: list) -> tuple[float, float]:
        """Flow floor: fetch ``refs`` in parallel (one ``ray.get``; passed in a list, so Ray does
        not resolve them before the call). Returns (start, end) on the machine's monotonic clock."""
        t0 = time.monotonic()
        ray.get(refs)
        return t0, time.monotonic()

    def stop(self) -> None:
        """Leave torch.distributed before being killed."""
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


_RemoteRawWorker = ray.remote(RawWorker)


class RawGang:
    """``n`` raw actors on their own placement group (``{'CPU': cpus}`` per bundle)."""

    def __init__(self, n: int, *, cpus: float = 1.0, pg=None):
        self.n = n
        self.own_pg = pg is None
        self.pg = pg if pg is not None else make_pg(n, cpus)
        self.cpus = cpus
        self.actors: list = []

    def start(self, distributed: bool = False) -> None:
        """Create the actors (env as twinkle_ray sets it) and, if asked, a gloo world."""
        self.actors = [
            _RemoteRawWorker.options(
                num_cpus=self.cpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=r
                ),
            ).remote(r, self.n, _env(r, self.n))
            for r in range(self.n)
        ]
        if distributed:
            port = ray.get(self.actors[0].endpoint.remote())
            ray.get([a.init_dist.remote(port) for a in self.actors])
        else:
            ray.get([a.__ray_ready__.remote() for a in self.actors])

    def kill(self) -> None:
        """Leave torch.distributed, kill the actors and wait until they are gone."""
        if not self.actors:
            return
        ray.get([a.stop.remote() for a in self.actors])
        for a in self.actors:
            ray.kill(a, no_restart=True)
        for a in self.actors:
            _wait_dead(a)
        self.actors = []

    def close(self) -> None:
        """Kill the actors and remove the placement group (if this gang made it)."""
        self.kill()
        if self.own_pg:
            remove_placement_group(self.pg)


def make_pg(n: int, cpus: float):
    """A ready PACK placement group of ``n`` bundles of ``cpus`` CPUs."""
    pg = placement_group([{"CPU": cpus}] * n, strategy="PACK")
    ray.get(pg.ready())
    return pg


def _env(rank: int, n: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(n), "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
    }


def _wait_dead(actor) -> None:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=30)
    except Exception:  # RayActorError: it is gone
        return
