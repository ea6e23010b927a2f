"""A vLLM sampler group on twinkle_ray: one gang worker per engine, ``gpus_per_worker`` = TP size.

    groups = [DeviceGroup("sampler", ranks=4, device_type="cuda", gpus_per_worker=2)]  # 2 engines, TP=2
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)       # worker i is global rank 2*i
    sampler = VLLMSampler("Qwen/Qwen2.5-0.5B-Instruct", n=8, device_mesh=mesh, remote_group="sampler")
    rollouts = sampler.generate(prompts)                     # slice_dp: each engine gets its half

Each gang worker owns one ``vllm.LLM`` whose TP workers are vLLM's own
processes on the worker's pinned GPUs (``CUDA_VISIBLE_DEVICES``). The gang
does not start torch.distributed (``distributed=False``): vLLM sets up its
own. Weight sync: every vLLM TP worker joins the trainer's weight-sync group
(:mod:`twinkle_ray.weights`) through :class:`TwinkleWorkerExtension`, receives
the full HF-named tensors and loads them with the model's ``load_weights``
(which shards them for its TP rank).

vLLM is imported only when a sampler is built; without it the constructor
raises MissingDependency. Written against vLLM's documented ``LLM``,
``SamplingParams``, ``worker_extension_cls`` and ``collective_rpc`` APIs;
**not run in this repository** (no GPU, no vLLM) -- see README.md.
"""

from __future__ import annotations

import os
from typing import Any

import twinkle_ray
from examples.vllm_megatron.common import require
from twinkle_ray import DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import SyncStats, WeightSyncMixin

EXTENSION = "examples.vllm_megatron.vllm_sampler.TwinkleWorkerExtension"


class TwinkleWorkerExtension:
    """Mixed into vLLM's GPU workers (``worker_extension_cls``): their end of the weight sync."""

    def twinkle_join(self, channel: str, addr: str, port: int, base_rank: int, world_size: int,
                     backend: str, timeout_s: float) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        from twinkle_ray.weights import WeightChannel

        rank = base_rank + get_tensor_model_parallel_rank()
        chans = self.__dict__.setdefault("_twinkle_channels", {})
        old = chans.pop(channel, None)
        if old is not None:
            old.close()
        ch = WeightChannel.connect(addr, port, rank, world_size, timeout_s)
        chans[channel] = ch.join(backend, prefix=f"twinkle-weights/{channel}")
        return rank

    def twinkle_ready(self, channel: str) -> bool:
        ch = self.__dict__.get("_twinkle_channels", {}).get(channel)
        return ch is not None and ch.pg is not None

    def twinkle_recv(self, channel: str) -> dict:
        model = self.model_runner.model
        stats = self._twinkle_channels[channel].recv(lambda items: model.load_weights(weights=items))
        return {"tensors": stats.tensors, "bytes": stats.bytes, "buckets": stats.buckets,
                "seconds": stats.seconds}

    def twinkle_close(self, channel: str) -> None:
        ch = self.__dict__.get("_twinkle_channels", {}).pop(channel, None)
        if ch is not None:
            ch.close()


@remote_class(distributed=False)
class VLLMSampler(WeightSyncMixin):
    """One vLLM engine per gang worker; ``generate`` takes [{'prompt': str, ...}] rows."""

    def __init__(self, model: str, *, device_mesh: DeviceMesh, n: int = 8, temperature: float = 1.0,
                 max_tokens: int = 256, gpu_memory_utilization: float = 0.6, seed: int = 0):
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        vllm = require("vllm", "pip install vllm", "VLLMSampler")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.tp = max(1, len([d for d in visible.split(",") if d]))
        self.mesh = device_mesh
        self.llm = vllm.LLM(
            model=model,
            tensor_parallel_size=self.tp,
            distributed_executor_backend="mp" if self.tp > 1 else None,
            worker_extension_cls=EXTENSION,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed + twinkle_ray.get_rank(),
        )
        self.params = vllm.SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0)

    @remote_function(dispatch="slice_dp", collect="flatten")
    def generate(self, rows: list[dict]) -> list[dict]:
        """n completions per prompt, grouped by prompt: token ids and the sampler's log-probs."""
        outs = self.llm.generate([r["prompt"] for r in rows], self.params, use_tqdm=False)
        rollouts = []
        for row, out in zip(rows, outs, strict=True):
            for c in out.outputs:
                logp = [float(lp[tok].logprob) for lp, tok in zip(c.logprobs or [], c.token_ids, strict=False)]
                rollouts.append({**row, "prompt_ids": list(out.prompt_token_ids),
                                 "completion_ids": list(c.token_ids), "text": c.text, "logprobs": logp})
        return rollouts

    # -- weight sync: every vLLM TP worker is a receiver ---------------------------------------
    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_probe(self) -> list[dict]:
        return [{"cuda": True, "rank": twinkle_ray.get_rank()}] * self.tp

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_join(self, channel: str, addr: str, port: int, role: str, world_size: int,
                         backend: str, timeout_s: float, rank_offset: int = 1) -> list[int]:
        base = rank_offset + twinkle_ray.get_rank() * self.tp
        return list(self.llm.collective_rpc(
            "twinkle_join", args=(channel, addr, port, base, world_size, backend, timeout_s)))

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_ready(self, channel: str, role: str) -> list[bool]:
        return list(self.llm.collective_rpc("twinkle_ready", args=(channel,)))

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_recv(self, channel: str) -> list[Any]:
        got = self.llm.collective_rpc("twinkle_recv", args=(channel,))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        return [SyncStats(tensors=g["tensors"], bytes=g["bytes"], buckets=g["buckets"],
                          seconds=g["seconds"]) for g in got]

    @remote_function(dispatch="all")
    def weight_sync_close(self, channel: str) -> None:
        self.llm.collective_rpc("twinkle_close", args=(channel,))
