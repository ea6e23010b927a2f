"""A Megatron trainer group on twinkle_ray: a gang whose torch.distributed world Megatron splits.

    groups = [DeviceGroup("trainer", ranks=4, device_type="cuda")]
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)
    trainer = MegatronTrainer("Qwen/Qwen2.5-0.5B-Instruct", device_mesh=mesh, remote_group="trainer")
    metrics = trainer.train_step(rollouts, scores)()         # slice_dp: each dp rank its half
    sync_weights(trainer, sampler)                            # HF-named full tensors -> vLLM

The gang's NCCL world (one worker per GPU) is what Megatron-Core's
``initialize_model_parallel`` splits into TP/PP/DP groups; the model comes
from Megatron-Bridge (``AutoBridge``: HF checkpoint -> Megatron model, and
back to HF-named tensors for the weight sync). ``weight_sync_tensors``
runs on every trainer rank (the export gathers TP/PP shards, a collective)
and keeps the full tensors on rank 0, in CPU memory; rank 0 then
broadcasts them to the samplers bucket by bucket.

Scope, honestly: pipeline parallelism > 1 is refused (this adapter builds a
single model chunk and one micro-batch); the train step is Megatron-Core's
documented ``get_forward_backward_func`` loop with a GRPO loss on
vocab-parallel log-probs. Megatron is imported only when a trainer is
built; without it the constructor raises MissingDependency. Written
against the Megatron-Core / Megatron-Bridge documentation; **not run in
this repository** (no GPU, no Megatron) -- see README.md.
"""

from __future__ import annotations

from typing import Any

from examples.vllm_megatron.common import require
from twinkle_ray import DeviceMesh, get_rank, remote_class, remote_function
from twinkle_ray.weights import WeightSyncMixin


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
        old[i, start:start + n] = torch.tensor(r["logprobs"][:n] + [0.0] * (n - len(r["logprobs"])))
    adv = torch.as_tensor(scores["advantage"], dtype=torch.float32)
    pos = torch.arange(width).expand(len(seqs), width)
    return {k: v.to(device) for k, v in
            dict(tokens=tokens, mask=mask, old=old, adv=adv, position_ids=pos).items()}


@remote_class()
class MegatronTrainer(WeightSyncMixin):
    """Megatron-Core model (via Megatron-Bridge) on the gang; GRPO steps; HF-named weight export."""

    def __init__(self, hf_model: str, *, device_mesh: DeviceMesh, lr: float = 1e-6, clip: float = 0.2,
                 seed: int = 0):
        bridge_mod = require("megatron.bridge", "pip install megatron-bridge (brings megatron-core)",
                             "MegatronTrainer")
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.utils import get_model_config

        tp, pp = device_mesh.tp_world_size or 1, device_mesh.pp_world_size or 1
        if pp > 1:
            raise NotImplementedError(
                "MegatronTrainer (example adapter) builds one model chunk and one micro-batch; "
                "pipeline parallelism > 1 needs micro-batching and a pp-aware export, not written here"
            )
        self.mesh, self.clip = device_mesh, clip
        self.bridge = bridge_mod.AutoBridge.from_hf_pretrained(hf_model, trust_remote_code=True)
        provider = self.bridge.to_megatron_provider(load_weights=True)
        provider.tensor_model_parallel_size = tp
        provider.pipeline_model_parallel_size = pp
        provider.finalize()
        provider.initialize_model_parallel(seed=seed)  # splits the gang's world into TP/DP groups
        self.model = provider.provide_distributed_model(
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), wrap_with_ddp=True)
        get_model_config(self.model[0]).finalize_model_grads_func = finalize_model_grads
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, bf16=True, clip_grad=1.0), self.model)

    def weight_sync_tensors(self) -> dict:
        """Full HF-named tensors on rank 0 (every rank takes part in the gather)."""
        full = {}
        for name, tensor in self.bridge.export_hf_weights(self.model, cpu=True):
            if get_rank() == 0:
                full[name] = tensor
        return full

    @remote_function(dispatch="slice_dp", collect="mean")
    def train_step(self, rollouts: list[dict], scores: dict) -> dict:
        import torch
        from megatron.core import tensor_parallel
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch = pad_batch(rollouts, scores, torch.device("cuda", torch.cuda.current_device()))
        clip = self.clip

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            logits = model(b["tokens"], b["position_ids"], None)

            def loss_func(output):
                # log p(token t+1 | <= t) on this TP rank's vocabulary shard, reduced over TP
                logp = -tensor_parallel.vocab_parallel_cross_entropy(
                    output[:, :-1].float().contiguous(), b["tokens"][:, 1:].contiguous())
                ratio = torch.exp(logp - b["old"])
                adv = b["adv"][:, None]
                surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
                loss = -(surrogate * b["mask"]).sum() / b["mask"].sum().clamp(min=1)
                return loss, {"loss": loss.detach()}

            return logits, loss_func

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=self.model,
            num_microbatches=1, seq_length=batch["tokens"].shape[1],
            micro_batch_size=batch["tokens"].shape[0], forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        loss = float(torch.stack([x["loss"] for x in losses]).mean()) if losses else float("nan")
        return {"loss": loss, "grad_norm": float(grad_norm or 0.0), "update_ok": float(bool(ok)),
                "reward": float(sum(scores["reward"]) / max(1, len(scores["reward"])))}
