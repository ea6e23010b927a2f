"""A Megatron-Core trainer group on twinkle_ray: the gang's torch.distributed world, split by Megatron.

    groups = [DeviceGroup("trainer", ranks=2, device_type="cpu")]          # or "cuda"
    mesh = DeviceMesh.from_sizes(tp_size=2, device_type="cpu")            # or pp_size=2, dp_size=..
    trainer = MegatronTrainer(hf_path, device_mesh=mesh, lr=2e-3, remote_group="trainer")
    metrics = trainer.train_step(rollouts, scores)()     # slice_dp: each data rank its share
    sync_weights(trainer, sampler)                       # HF-named full tensors -> vLLM reload_weights
    trainer.probe_logprobs(probe)()                      # per-token log-probs under the current weights
    trainer.save_hf("/tmp/ckpt")                         # LlamaForCausalLM.from_pretrained loads it

What runs, on Megatron-Core 0.16.1 (CPU with gloo in this repository's tests;
the same code on CUDA with NCCL):

- ``parallel_state.initialize_model_parallel(tp, pp)`` with the sizes of the
  twinkle :class:`DeviceMesh` (dims ``pp``, ``dp``, ``tp``); the TP / PP / DP
  rank lists Megatron built are compared with the mesh's and a mismatch raises
  ``ValueError`` naming the sizes.
- A ``GPTModel`` (local layer spec: plain PyTorch, no transformer-engine)
  filled from the HF checkpoint directory by this example's own Llama mapping
  (:mod:`hf_megatron`); each rank cuts its TP shard of its PP stage's layers.
- GRPO steps: PPO-clipped surrogate on log-probs from
  ``tensor_parallel.vocab_parallel_cross_entropy`` plus an entropy bonus
  (vocab-parallel too), run by Megatron's own schedule
  (``get_forward_backward_func``: no-pipelining or 1F1B over micro-batches),
  Megatron's ``DistributedDataParallel`` (grad buffers, DP all-reduce,
  ``finalize_model_grads``) and Megatron's optimizer (``get_megatron_optimizer``,
  fp32 Adam(W) with Megatron's gradient clipping). All of them run on CPU given
  the workarounds of :mod:`megatron_cpu`, which are active only on CPU.
- Weight sync, resharded: every rank sends its own TP/PP shard as HF-named
  slabs (``weight_sync_shards``: the fused QKV split per query group into q/k/v
  rows, fc1 into gate/up rows, row-parallel tensors by columns; nothing is
  gathered), each engine pulls from one data-parallel replica, and the engines
  assemble full HF tensors, what vLLM's layer-wise reload takes.
  ``sync_sources="rank0"`` keeps the old gathered path (stages sent to rank 0,
  which sends everything) for comparison. ``save_hf`` writes the gathered
  weights as an HF checkpoint.

Megatron is imported only when a trainer is built; without it the constructor
raises MissingDependency naming ``bash scripts/setup.sh rlhf``.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from typing import Any

from examples.vllm_megatron.common import require
from examples.vllm_megatron.hf_megatron import LlamaSpec, load_hf_state
from examples.vllm_megatron.megatron_cpu import cpu_megatron, seed_model_parallel
from twinkle_ray import DeviceMesh, get_rank, remote_class, remote_function
from twinkle_ray.weights import Slab, TensorSource, WeightSyncMixin, fused_slabs

INSTALL = "bash scripts/setup.sh rlhf (megatron-core==0.16.1)"
SUPPORTED_DIMS = ("pp", "dp", "tp")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def pad_batch(rollouts: list[dict], scores: dict, device: Any) -> dict:
    """Token ids, completion mask, sampler log-probs and advantages as padded tensors."""
    import torch

    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rollouts]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1)
    old = torch.zeros(len(seqs), width - 1)
    for i, (r, s) in enumerate(zip(rollouts, seqs, strict=True)):
        tokens[i, : len(s)] = torch.tensor(s)
        start = len(r["prompt_ids"]) - 1  # position t predicts token t + 1
        n = len(r["completion_ids"])
        mask[i, start:start + n] = 1.0
        lp = list(r.get("logprobs") or [])[:n]
        old[i, start:start + n] = torch.tensor(lp + [0.0] * (n - len(lp)))
    adv = torch.as_tensor(scores["advantage"], dtype=torch.float32)
    pos = torch.arange(width).expand(len(seqs), width)
    return {k: v.to(device) for k, v in
            dict(tokens=tokens, mask=mask, old=old, adv=adv, position_ids=pos).items()}


def check_mesh_groups(mesh: DeviceMesh, megatron: dict[str, list[int]], rank: int) -> None:
    """Raise ValueError when Megatron's TP/PP/DP rank lists for ``rank`` differ from the mesh's.

    >>> m = DeviceMesh.from_sizes(tp_size=2, device_type="cpu")
    >>> check_mesh_groups(m, {"tp": [0, 1], "pp": [0], "dp": [0]}, rank=0)
    >>> check_mesh_groups(m, {"tp": [0], "pp": [0], "dp": [0, 1]}, rank=0)
    Traceback (most recent call last):
    ...
    ValueError: MegatronTrainer: Megatron's tp group of rank 0 is [0] but the DeviceMesh's is [0, 1] ...
    """
    sizes = {d: (mesh.get_dim_size(d) if mesh.has_dim(d) else 1) for d in SUPPORTED_DIMS}
    for dim, got in megatron.items():
        want = mesh.get_group_ranks(dim, rank=rank) if mesh.has_dim(dim) else [rank]
        if list(got) != list(want):
            raise ValueError(
                f"MegatronTrainer: Megatron's {dim} group of rank {rank} is {list(got)} but the DeviceMesh's "
                f"is {list(want)} (mesh sizes tp={sizes['tp']}, pp={sizes['pp']}, dp={sizes['dp']}, "
                f"dims {list(mesh.mesh_dim_names)}); build the mesh with DeviceMesh.from_sizes(pp_size=.., "
                f"dp_size=.., tp_size=..), whose layout is Megatron's tp-dp-pp order")


def _check_knobs(lr: float, clip: float, ppo_epochs: int, entropy_coef: float, grad_clip: float,
                 micro_batch_size: int | None, weight_decay: float) -> None:
    def bad(knob: str, value: Any, want: str) -> ValueError:
        return ValueError(f"MegatronTrainer: {knob}={value!r} is invalid; {want}")

    if not (isinstance(lr, int | float) and lr > 0 and math.isfinite(lr)):
        raise bad("lr", lr, "expected a finite learning rate > 0 (e.g. 1e-6 for a 7B actor, 2e-3 here)")
    if not (isinstance(clip, int | float) and 0 < clip < 1):
        raise bad("clip", clip, "expected the PPO clip ratio in (0, 1), e.g. 0.2")
    if not (isinstance(ppo_epochs, int) and ppo_epochs >= 1):
        raise bad("ppo_epochs", ppo_epochs, "expected an int >= 1 (updates per rollout batch)")
    if not (isinstance(entropy_coef, int | float) and entropy_coef >= 0):
        raise bad("entropy_coef", entropy_coef, "expected a number >= 0")
    if not (isinstance(grad_clip, int | float) and grad_clip >= 0):
        raise bad("grad_clip", grad_clip, "expected a max grad norm >= 0 (0 disables clipping)")
    if not (isinstance(weight_decay, int | float) and weight_decay >= 0):
        raise bad("weight_decay", weight_decay, "expected a number >= 0")
    if micro_batch_size is not None and not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
        raise bad("micro_batch_size", micro_batch_size, "expected an int >= 1 or None (one per PP stage)")


@remote_class()
class MegatronTrainer(WeightSyncMixin):
    """A Megatron-Core GPTModel over the gang (TP x PP x DP from the mesh); GRPO steps; HF-named weight export.

    Knobs (veRL / OpenRLHF names in brackets): ``lr`` [actor lr], ``clip`` [clip_ratio],
    ``ppo_epochs``, ``entropy_coef`` [entropy_coeff], ``grad_clip`` [max grad norm],
    ``micro_batch_size`` [ppo_micro_batch_size per data rank; default: the data rank's batch
    split into ``pp`` micro-batches], ``weight_decay``, ``seed``. TP / PP / DP sizes come
    from ``device_mesh``.
    """

    def __init__(self, hf_path: str, *, device_mesh: DeviceMesh, lr: float = 1e-6, clip: float = 0.2,
                 ppo_epochs: int = 1, entropy_coef: float = 0.0, grad_clip: float = 1.0,
                 micro_batch_size: int | None = None, weight_decay: float = 0.0, seed: int = 0,
                 sync_sources: str = "stages"):
        _check_knobs(lr, clip, ppo_epochs, entropy_coef, grad_clip, micro_batch_size, weight_decay)
        if sync_sources not in ("stages", "rank0"):
            raise ValueError(f"MegatronTrainer: sync_sources={sync_sources!r} is invalid; expected 'stages' "
                             f"(every PP stage sends its own layers) or 'rank0' (all through rank 0)")
        self.sync_sources = sync_sources
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"MegatronTrainer: device_mesh must be a twinkle DeviceMesh, got {type(device_mesh)}")
        extra = [d for d in device_mesh.mesh_dim_names if d not in SUPPORTED_DIMS and device_mesh.get_dim_size(d) > 1]
        if extra:
            raise ValueError(f"MegatronTrainer: mesh dim(s) {extra} are not supported here (pp, dp, tp only; "
                             f"sizes {dict(zip(device_mesh.mesh_dim_names, device_mesh.shape, strict=True))})")
        require("megatron.core", INSTALL, "MegatronTrainer")
        import torch
        import torch.distributed as dist
        from transformers import AutoConfig

        t0 = time.perf_counter()
        self.mesh, self.hf_path = device_mesh, hf_path
        self.clip, self.ppo_epochs, self.entropy_coef = float(clip), ppo_epochs, float(entropy_coef)
        self.micro_batch_size = micro_batch_size
        size = {d: (device_mesh.get_dim_size(d) if device_mesh.has_dim(d) else 1) for d in SUPPORTED_DIMS}
        self.tp, self.pp, self.dp = size["tp"], size["pp"], size["dp"]
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != device_mesh.world_size:
            raise ValueError(f"MegatronTrainer: the gang has {world} worker(s) but the DeviceMesh has "
                             f"{device_mesh.world_size} (tp={self.tp} x pp={self.pp} x dp={self.dp})")
        self.cpu = device_mesh.device_type == "cpu" or not torch.cuda.is_available()
        self.device = torch.device("cpu") if self.cpu else torch.device("cuda", torch.cuda.current_device())
        self.hf_config = AutoConfig.from_pretrained(hf_path)
        self.spec = LlamaSpec.from_hf(self.hf_config)
        self.spec.check_parallel(self.tp, self.pp)

        with self._cpu_ctx():
            from megatron.core import parallel_state as ps
            from megatron.core.distributed import (
                DistributedDataParallel,
                DistributedDataParallelConfig,
                finalize_model_grads,
            )
            from megatron.core.models.gpt import GPTModel
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp)
            rank = dist.get_rank()
            check_mesh_groups(device_mesh, self.megatron_groups(), rank)
            seed_model_parallel(seed, cpu=self.cpu)
            self.config, gpt_kwargs = self.spec.megatron_config(tp=self.tp, pp=self.pp, cpu=self.cpu)
            self.tp_rank = ps.get_tensor_model_parallel_rank()
            self.pp_rank = ps.get_pipeline_model_parallel_rank()
            self.dp_rank = ps.get_data_parallel_rank()
            self.layer_offset = self.pp_rank * (self.spec.layers // self.pp)
            model = GPTModel(self.config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                             pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                             **gpt_kwargs)
            self.spec.load_into(model.named_parameters(), load_hf_state(hf_path), layer_offset=self.layer_offset,
                                tp_rank=self.tp_rank, tp=self.tp)
            model.to(self.device)
            self.model = [DistributedDataParallel(self.config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=False), model)]
            self.config.finalize_model_grads_func = finalize_model_grads
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=float(lr), min_lr=float(lr), weight_decay=float(weight_decay),
                clip_grad=float(grad_clip), bf16=False, fp16=False, params_dtype=torch.float32,
                use_distributed_optimizer=False), self.model)
        self.kept: dict[int, list] = {}  # version -> parameters (keep_version)
        self.build_s = time.perf_counter() - t0

    # ------------------------------------------------------------------------ set-up helpers
    def _cpu_ctx(self) -> Any:
        """The CPU workarounds (megatron_cpu) on CPU; a no-op context on CUDA."""
        return cpu_megatron(active=self.cpu)

    def megatron_groups(self) -> dict[str, list[int]]:
        """Megatron's TP / PP / DP rank lists for this rank (global ranks, group order)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        return {"tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
                "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
                "dp": dist.get_process_group_ranks(ps.get_data_parallel_group())}

    def _pp_broadcast(self, obj: Any) -> Any:
        """The last PP stage's ``obj``, on every rank of this rank's PP group."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    def _micro_batches(self, batch: dict, n_rows: int) -> tuple[list[dict], int]:
        mbs = self.micro_batch_size or (n_rows // self.pp if n_rows % self.pp == 0 and n_rows >= self.pp
                                        else n_rows)
        if n_rows % mbs:
            raise ValueError(f"MegatronTrainer: micro_batch_size={mbs} does not divide this data rank's "
                             f"{n_rows} rows (dp={self.dp}); choose a micro_batch_size that divides it")
        return [{k: v[i:i + mbs] for k, v in batch.items()} for i in range(0, n_rows, mbs)], mbs

    def _vocab_parallel_logp_entropy(self, logits: Any, target: Any) -> tuple[Any, Any]:
        """log p(target) and the entropy per position, from this TP rank's vocabulary shard."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        logits = logits.float()
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target)
        if not self.entropy_coef:
            return logp, torch.zeros_like(logp)
        m = logits.detach().max(-1, keepdim=True).values
        if self.tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        shifted = logits - m
        e = shifted.exp()
        z = tensor_parallel.reduce_from_tensor_model_parallel_region(e.sum(-1))  # sum over the full vocab
        pz = tensor_parallel.reduce_from_tensor_model_parallel_region((e * shifted).sum(-1))
        return logp, z.log() - pz / z  # H = log Z - E_p[z - m]

    # ------------------------------------------------------------------------ training
    @remote_function(dispatch="slice_dp", collect="mean")
    def train_step(self, rollouts: list[dict], scores: dict) -> dict:
        """``ppo_epochs`` clipped GRPO updates on this data rank's rollouts; metrics of the first epoch."""
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        start = time.perf_counter()
        batch = pad_batch(rollouts, scores, self.device)
        micro, mbs = self._micro_batches(batch, len(rollouts))
        width = batch["tokens"].shape[1]
        clip, coef = self.clip, self.entropy_coef

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            logits = model(b["tokens"], b["position_ids"], None)

            def loss_func(output):
                logp, ent = self._vocab_parallel_logp_entropy(output[:, :-1], b["tokens"][:, 1:].contiguous())
                ratio = torch.exp(logp - b["old"])
                adv = b["adv"][:, None]
                surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
                n = b["mask"].sum().clamp(min=1)
                entropy = (ent * b["mask"]).sum() / n
                loss = -(surrogate * b["mask"]).sum() / n - coef * entropy
                ratio_err = ((ratio.detach() - 1).abs() * b["mask"]).max()
                return loss, {"loss": loss.detach().clone(), "entropy": entropy.detach(), "ratio_err": ratio_err}

            return logits, loss_func

        first: dict = {}
        grad_norm = 0.0
        with self._cpu_ctx():
            for chunk in self.model:
                chunk.train()
            for epoch in range(self.ppo_epochs):
                for chunk in self.model:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                out = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(micro), model=self.model,
                    num_microbatches=len(micro), seq_length=width, micro_batch_size=mbs, forward_only=False)
                ok, norm, _ = self.optimizer.step()
                if epoch == 0:
                    grad_norm = float(norm or 0.0)
                    first = {"loss": float(torch.stack([o["loss"] for o in out]).mean()) if out else None,
                             "entropy": float(torch.stack([o["entropy"] for o in out]).mean()) if out else None,
                             "ratio_err": float(torch.stack([o["ratio_err"] for o in out]).max()) if out else None}
        first = self._pp_broadcast(first)
        return {**first, "grad_norm": grad_norm, "reward": float(sum(scores["reward"]) / max(1, len(scores["reward"]))),
                "step_s": time.perf_counter() - start}

    # ------------------------------------------------------------------------ inspection
    def _forward_only(self, rows: list[dict], per_micro_batch: Any) -> list:
        """Forward-only pass of Megatron's schedule over padded ``rows``; ``per_micro_batch(logits, batch)``'s
        results (last PP stage; [] elsewhere). Every rank takes part."""
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rows = [{"prompt_ids": list(r["prompt_ids"]), "completion_ids": list(r["completion_ids"]),
                 "logprobs": []} for r in rows]
        batch = pad_batch(rows, {"advantage": [0.0] * len(rows)}, self.device)
        micro, mbs = self._micro_batches(batch, len(rows))

        def forward_step(data_iterator, model):
            b = next(data_iterator)

            def loss_func(output):
                return output.sum() * 0.0, {"out": per_micro_batch(output, b)}

            return model(b["tokens"], b["position_ids"], None), loss_func

        with self._cpu_ctx(), torch.no_grad():
            for chunk in self.model:
                chunk.eval()
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro), model=self.model,
                num_microbatches=len(micro), seq_length=batch["tokens"].shape[1], micro_batch_size=mbs,
                forward_only=True)
        return [o["out"] for o in out]

    def _params(self) -> list:
        return [p for chunk in self.model for p in chunk.parameters()]

    @remote_function(dispatch="all", collect="first")
    def keep_version(self, version: int, keep: int = 2) -> None:
        """Remember this rank's weights as they are now as ``version`` (the newest ``keep`` are kept):
        :meth:`probe_logprobs` with ``version=`` computes under them. For checks of samples that
        engines generated a version or two before the trainer's (``grpo.py --stream``)."""
        import torch

        with torch.no_grad():
            self.kept[int(version)] = [p.detach().clone() for p in self._params()]
        for v in sorted(self.kept)[:-max(1, int(keep))]:
            del self.kept[v]

    @remote_function(dispatch="all", collect="first")
    def probe_logprobs(self, probe: list[dict], version: int | None = None) -> list[list[float]]:
        """For each row, log p(completion_ids[j] | prompt_ids + completion_ids[:j]), fp32, eval mode.

        Log-probs come from ``vocab_parallel_cross_entropy`` over the TP vocabulary shards. Every rank
        takes part (TP / PP collectives); every rank returns the same rows. ``version``: under the
        weights :meth:`keep_version` kept as it (KeyError naming the kept ones if none), the current
        weights restored after.
        """
        import torch

        if version is None:
            return self._probe(probe)
        if int(version) not in self.kept:
            raise KeyError(f"MegatronTrainer.probe_logprobs: version {version} is not kept (kept: {sorted(self.kept)})")
        params = self._params()
        with torch.no_grad():
            now = [p.detach().clone() for p in params]
            for p, k in zip(params, self.kept[int(version)], strict=True):
                p.data.copy_(k)
        try:
            return self._probe(probe)
        finally:
            with torch.no_grad():
                for p, k in zip(params, now, strict=True):
                    p.data.copy_(k)

    def _probe(self, probe: list[dict]) -> list[list[float]]:
        import torch
        from megatron.core import tensor_parallel

        def logp(output, b):
            return -tensor_parallel.vocab_parallel_cross_entropy(
                output[:, :-1].float().clone(), b["tokens"][:, 1:].contiguous())

        parts = self._forward_only(probe, logp)
        result = None
        if parts:
            lp = torch.cat(parts, 0)
            result = []
            for i, r in enumerate(probe):
                s, n = len(r["prompt_ids"]) - 1, len(r["completion_ids"])
                result.append([float(x) for x in lp[i, s:s + n]])
        return self._pp_broadcast(result)

    @remote_function(dispatch="all", collect="first")
    def full_logits(self, rows: list[dict]) -> Any:
        """Logits over the whole vocabulary ([rows, width, vocab], fp32 CPU; TP shards gathered) of
        ``prompt_ids + completion_ids`` (rows padded to one width). For checks against HF."""
        import torch
        from megatron.core import tensor_parallel

        def gather(output, b):
            return tensor_parallel.gather_from_tensor_model_parallel_region(output.float()).cpu()

        parts = self._forward_only(rows, gather)
        return self._pp_broadcast(torch.cat(parts, 0) if parts else None)

    @remote_function(dispatch="all", collect="flatten")
    def mesh_report(self) -> list[dict]:
        """Megatron's groups next to the mesh's, on every rank (what the constructor checked)."""
        import torch.distributed as dist

        rank = dist.get_rank()
        mesh = {d: (self.mesh.get_group_ranks(d, rank=rank) if self.mesh.has_dim(d) else [rank])
                for d in SUPPORTED_DIMS}
        return [{"rank": rank, "megatron": self.megatron_groups(), "mesh": mesh,
                 "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank,
                 "build_s": self.build_s, "peak_rss_mb": _peak_rss_mb()}]

    # ------------------------------------------------------------------------ export
    def _hf_source(self, bucket_mb: float = 32.0) -> TensorSource:
        """This rank's stage in HF names, lazily: metadata (names, full fp32 shapes) with nothing gathered,
        then one TP all-gather per bucket of whole parameters as iteration reaches it. Every TP rank of
        the stage must iterate it in step (the gathers are collectives); each yields the same tensors."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        params = [(n, p.detach()) for n, p in self.model[0].module.named_parameters()]
        specs = []
        for name, p in params:  # shapes only: the HF mapping run on meta tensors
            shards = [torch.empty(p.shape, dtype=torch.float32, device="meta")] * self.tp
            specs += [(n, torch.float32, tuple(t.shape)) for n, t in self.spec.hf_from_shards(name, shards, self.layer_offset)]
        limit = int(bucket_mb * 2**20)
        buckets: list[list] = []
        size = 0
        for name, p in params:  # buckets of whole parameters, one all_gather each
            if not buckets or size + p.numel() * 4 > limit:
                buckets.append([])
                size = 0
            buckets[-1].append((name, p))
            size += p.numel() * 4

        def produce():
            for chunk in buckets:
                flat = torch.cat([p.float().reshape(-1) for _, p in chunk])
                parts = [flat]
                if self.tp > 1:
                    parts = [torch.empty_like(flat) for _ in range(self.tp)]
                    dist.all_gather(parts, flat, group=ps.get_tensor_model_parallel_group())
                parts = [x.cpu() for x in parts]
                off = 0
                for name, p in chunk:
                    n = p.numel()
                    yield from self.spec.hf_from_shards(name, [x[off:off + n].view(p.shape) for x in parts],
                                                        self.layer_offset)
                    off += n

        return TensorSource(specs, produce)

    def _gather_hf(self, bucket_mb: float = 32.0) -> tuple[dict, dict]:
        """HF-named full tensors on rank 0 ({} elsewhere), and timing stats; every rank must call it."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        start = time.perf_counter()
        mine: list[tuple[str, Any]] = []
        if self.dp_rank == 0:  # DP replicas hold the same weights: only data rank 0 gathers
            mine = list(self._hf_source(bucket_mb))
            mine = mine if self.tp_rank == 0 else []
        full: dict = dict(mine) if get_rank() == 0 else {}
        if self.pp > 1 and self.dp_rank == 0 and self.tp_rank == 0:  # stages > 0 send theirs to rank 0
            pp_group = ps.get_pipeline_model_parallel_group()
            ranks = dist.get_process_group_ranks(pp_group)
            for src in ranks[1:]:  # on the backend's device (NCCL sends CUDA tensors only), kept on the CPU
                if get_rank() == src:
                    dist.send_object_list([[(n, tuple(t.shape)) for n, t in mine]], dst=ranks[0], group=pp_group)
                    for _, t in mine:
                        dist.send(t.to(self.device).contiguous(), dst=ranks[0], group=pp_group)
                elif get_rank() == ranks[0]:
                    box = [None]
                    dist.recv_object_list(box, src=src, group=pp_group)
                    for n, shape in box[0]:
                        t = torch.empty(shape, dtype=torch.float32, device=self.device)
                        dist.recv(t, src=src, group=pp_group)
                        full[n] = t.cpu()
        nbytes = sum(t.numel() * t.element_size() for t in full.values())
        self.last_gather = {"gather_s": time.perf_counter() - start, "gather_mb": nbytes / 2**20,
                            "tensors": len(full)}
        return full, self.last_gather

    def weight_sync_shards(self) -> list[Slab]:
        """This rank's own Megatron shards as HF-named slabs (no gather): fused QKV split per query
        group into q/k/v rows, fc1 into gate/up rows, row-parallel tensors by columns
        (``LlamaSpec.hf_blocks``). ``sync_sources='rank0'``: the old gathered path, for comparison."""
        if self.sync_sources == "rank0":
            return super().weight_sync_shards()
        out: list[Slab] = []
        for name, p in self.model[0].module.named_parameters():
            dim, blocks = self.spec.hf_blocks(name, tuple(p.shape), self.layer_offset, self.tp_rank, self.tp)
            if blocks:
                out += fused_slabs(p.detach().float(), blocks, dim)
        return out

    def weight_sync_replica(self) -> int:
        """Data-parallel replicas hold the same shards: receivers spread over them."""
        return self.dp_rank

    def weight_sync_lane(self) -> tuple[int | None, int]:
        """Every PP stage's first TP rank (data rank 0) sends its stage's layers, on lane = its stage
        (``sync_sources='rank0'``: rank 0 alone, after the stages were sent to it)."""
        if self.sync_sources == "rank0":
            return super().weight_sync_lane()
        return (self.pp_rank if self.tp_rank == 0 and self.dp_rank == 0 else None), self.pp

    def weight_sync_tensors(self) -> TensorSource | dict:
        """This stage's HF-named full fp32 tensors, gathered bucket by bucket as they are sent (every TP
        rank of data rank 0 iterates them in step; other data ranks: {}). ``sync_sources='rank0'``:
        the whole model on rank 0 ({} elsewhere)."""
        if self.sync_sources == "rank0":
            return self._gather_hf()[0]
        return self._hf_source() if self.dp_rank == 0 else {}

    @remote_function(dispatch="all", collect="first")
    def gather_stats(self) -> dict:
        """Seconds, MB (2**20 bytes) and tensor count of this gang's last gather, as rank 0 saw it."""
        return dict(getattr(self, "last_gather", {}))

    @remote_function(dispatch="all", collect="first")
    def save_hf(self, path: str) -> str:
        """Write the current weights as an HF checkpoint (config, safetensors, tokenizer files); returns path."""
        from safetensors.torch import save_file

        full, _ = self._gather_hf()
        if get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            self.hf_config.save_pretrained(path)
            save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(path, "model.safetensors"),
                      metadata={"format": "pt"})
            for f in TOKENIZER_FILES:
                src = os.path.join(self.hf_path, f)
                if os.path.exists(src):
                    shutil.copy(src, os.path.join(path, f))
        return path

    @remote_function(dispatch="all", collect="first")
    def hf_state(self) -> dict:
        """The HF-named full tensors (rank 0's), for tests and small models."""
        return self._gather_hf()[0]


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
