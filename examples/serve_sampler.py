"""A sampler gang behind an HTTP endpoint (Ray Serve), batching requests across dp ranks.

Each Serve replica owns one gang of sampler workers (a DeviceGroup mapped to
the replica's placement-group bundles). Concurrent HTTP requests are
batched with ``@serve.batch`` and one batch is split across the gang's
data-parallel ranks (``slice_dp``); each answer says which rank made it. A
dead worker (or the gang's dispatcher) is healed inside the replica: it rebuilds its gang while
requests wait, and re-runs the batch the death interrupted (sampling is
seeded, so a re-run gives the same answer). Only a gang that cannot be
rebuilt fails the health check, and Serve replaces the replica. Every bad
request gets a 4xx with a JSON error (405 for a method other than POST).

Requests and responses are JSON::

    curl -s -X POST http://127.0.0.1:8000/sample \\
        -d '{"prompt": "hello", "max_tokens": 16, "temperature": 0.8, "seed": 1}'
    {"text": "...", "rank": 1, "replica": "...", "batch_size": 3}

Run it three ways:

    python examples/serve_sampler.py                 # local: start, send requests, stop
    ray job submit --working-dir . -- python examples/serve_sampler.py
    serve run deploy/serve.yaml                      # serve until Ctrl-C

The sampler is a toy byte-level bigram model (torch, CPU) standing in for a
vLLM engine; the same deployment serves a real one with
``device_type='cuda'`` in ``build_app``'s arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

import twinkle_ray as twinkle
from twinkle_ray import DeviceGroup, DeviceMesh, remote_class, remote_function
from twinkle_ray.serve import (
    BadRequest,
    ReplicaGang,
    check_cluster_fits,
    deployment_options,
    error_response,
    json_response,
    read_json,
)

FIRST, LAST = 32, 127  # printable ASCII is the whole vocabulary
MAX_TOKENS = 256
MAX_PROMPT_CHARS = 2000


@remote_class(max_restarts=5)  # the dispatcher starts a rebuild the moment a worker dies
class TinySampler:
    """A byte-level bigram language model; every rank holds the same weights."""

    def __init__(self, device_mesh: DeviceMesh, dim: int = 32, weights_seed: int = 0):
        import torch

        self.mesh = device_mesh
        gen = torch.Generator().manual_seed(weights_seed)
        vocab = LAST - FIRST
        self.emb = torch.randn(vocab, dim, generator=gen)
        self.out = torch.randn(dim, vocab, generator=gen) / dim**0.5

    @remote_function(dispatch="slice_dp", collect="flatten")
    def generate(self, requests: list[dict | None]) -> list[dict | None]:
        """Sample a completion per request; ``None`` entries (batch padding) stay ``None``."""
        import torch

        rank = twinkle.get_rank()
        results: list[dict | None] = []
        for req in requests:
            if req is None:
                results.append(None)
                continue
            gen = torch.Generator().manual_seed(int(req["seed"]))
            ids = [ord(c) - FIRST for c in req["prompt"] if FIRST <= ord(c) < LAST] or [0]
            new: list[int] = []
            for _ in range(req["max_tokens"]):
                logits = self.emb[ids[-1]] @ self.out
                if req["temperature"] == 0:
                    nxt = int(logits.argmax())
                else:
                    probs = torch.softmax(logits / req["temperature"], dim=-1)
                    nxt = int(torch.multinomial(probs, 1, generator=gen))
                ids.append(nxt)
                new.append(nxt)
            results.append({"text": "".join(chr(FIRST + i) for i in new), "rank": rank})
        return results


def parse_request(body: dict) -> dict:
    """Validate one JSON request; BadRequest names the field that is wrong."""
    known = {"prompt", "max_tokens", "temperature", "seed"}
    extra = sorted(set(body) - known)
    if extra:
        raise BadRequest(f"unknown field(s) {extra}; expected {sorted(known)}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT_CHARS:
        raise BadRequest(f"'prompt' must be a string of at most {MAX_PROMPT_CHARS} characters")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= MAX_TOKENS:
        raise BadRequest(f"'max_tokens' must be an integer in 1..{MAX_TOKENS}")
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) or not 0 <= temperature <= 10:
        raise BadRequest("'temperature' must be a number in 0..10")
    seed = body.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise BadRequest("'seed' must be a non-negative integer")
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": float(temperature), "seed": seed}


@serve.deployment
class SamplerServer:
    """One replica = one sampler gang; batches concurrent requests across its dp ranks."""

    def __init__(self, group: dict, max_batch_size: int = 8, batch_wait_timeout_s: float = 0.05):
        group = DeviceGroup(**group)
        self.gang = ReplicaGang(
            group, TinySampler, device_mesh=DeviceMesh.from_sizes(dp_size=group.num_workers)
        )
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.generate.set_max_batch_size(max_batch_size)
        self.generate.set_batch_wait_timeout_s(batch_wait_timeout_s)

    async def __call__(self, request: Any) -> Any:
        try:
            req = parse_request(await read_json(request))
            return json_response(await self.generate(req))
        except Exception as e:  # 4xx: a bad request; 503: the gang is gone for good; else 500
            return error_response(e)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def generate(self, requests: list[dict]) -> list[dict]:
        outs = await self.gang.call(self.gang.proxy.generate, requests)
        return [{**o, "replica": self.replica, "batch_size": len(requests)} for o in outs]

    async def check_health(self) -> None:
        await self.gang.check_health()

    def topology(self) -> dict:
        return self.gang.topology()

    def __del__(self) -> None:
        gang = getattr(self, "gang", None)
        if gang is not None:
            gang.close()


def build_app(args: dict | None = None) -> serve.Application:
    """Serve application builder (``import_path: examples.serve_sampler:build_app``).

    args: ``ranks`` (sampler workers, default 2), ``device_type`` ('cpu'; 'cuda'
    for GPUs), ``gpus_per_worker``, ``num_replicas`` (1), ``max_batch_size``
    (8), ``batch_wait_timeout_s`` (0.05), ``health_check_period_s`` (2).
    """
    args = dict(args or {})
    group = {
        "name": "sampler",
        "ranks": int(args.pop("ranks", 2)),
        "device_type": str(args.pop("device_type", "cpu")),
        "gpus_per_worker": int(args.pop("gpus_per_worker", 1)),
    }
    options = deployment_options(
        DeviceGroup(**group),
        num_replicas=int(args.pop("num_replicas", 1)),
        health_check_period_s=float(args.pop("health_check_period_s", 2.0)),
        max_ongoing_requests=int(args.pop("max_ongoing_requests", 32)),
    )
    batching = {
        "max_batch_size": int(args.pop("max_batch_size", 8)),
        "batch_wait_timeout_s": float(args.pop("batch_wait_timeout_s", 0.05)),
    }
    if args:
        raise ValueError(f"build_app: unknown argument(s) {sorted(args)}")
    return SamplerServer.options(**options).bind(group, **batching)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 30.0) -> tuple[int, dict]:
    """POST JSON, return (status, JSON body) — also for error statuses; status 0: no answer."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"error": text.decode(errors="replace")}
    except (urllib.error.URLError, OSError) as e:  # no answer at all (not up yet, or gone)
        return 0, {"error": str(e)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="sampler workers (dp size)")
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests to send")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    parser.add_argument("--keep", action="store_true", help="keep serving until Ctrl-C")
    args = parser.parse_args(argv)

    import ray

    own_ray = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):  # under ray job submit: attach to the cluster
            ray.init()
        else:
            # a laptop: declare enough (virtual) CPUs for replica + workers, as quickstart does
            ray.init(num_cpus=max(8, os.cpu_count() or 1), dashboard_host="127.0.0.1")
            own_ray = True
    check_cluster_fits(DeviceGroup("sampler", args.ranks, "cpu"))  # fail fast, never wait forever
    port = args.port or _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"ranks": args.ranks}), name="sampler", route_prefix="/sample")
        url = f"http://127.0.0.1:{port}/sample"
        bodies = [{"prompt": f"prompt {i}", "max_tokens": 12, "temperature": 0.8, "seed": i}
                  for i in range(args.requests)]
        start = time.monotonic()
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(url, b), bodies))
        took = time.monotonic() - start
        for body, (status, out) in zip(bodies, answers, strict=True):
            print(f"{status} {body['prompt']!r:>12} -> rank {out.get('rank')} "
                  f"(batch of {out.get('batch_size')}): {out.get('text', out.get('error'))!r}")
        ranks = sorted({out.get("rank") for _, out in answers})
        print(f"{len(answers)} requests in {took:.2f}s, served by dp ranks {ranks}")
        if any(status != 200 for status, _ in answers):
            sys.exit(1)
        if args.keep:
            print(f"serving on {url}; Ctrl-C to stop")
            while True:
                time.sleep(3600)
        return [out for _, out in answers]
    finally:
        # Only our application goes: on a shared cluster Serve may hold other people's apps.
        # (serve.shutdown() would also stop Serve itself, and Ray then logs a harmless
        # "Task ServeController.graceful_shutdown failed ... infinite retries" line.)
        serve.delete("sampler")
        if own_ray:
            ray.shutdown()  # the Ray this script started, with Serve's controller and proxy


if __name__ == "__main__":
    main()
