"""An FSDP2 trainer group for the vLLM sampler: any HF causal LM under torch ``fully_shard``.

    groups = [DeviceGroup("trainer", ranks=4, device_type="cuda")]
    mesh = create_fsdp2_mesh(world_size=4)                    # (pp, dp_replicate, dp_shard, cp, tp)
    trainer = FSDP2Trainer("Qwen/Qwen2.5-0.5B-Instruct", device_mesh=mesh, remote_group="trainer")
    metrics = trainer.train_step(rollouts, scores)()         # slice_dp: each data rank its part
    sync_weights(trainer, sampler)                            # HF-named full tensors -> vLLM load_weights

The same building blocks as ``examples/rlhf_fsdp_hf.py`` (which runs them on
CPU in CI): the FSDP2/HSDP mesh from ``twinkle_ray.mesh_factory``, its torch
twin from ``DeviceMesh.to_torch()``, ``fully_shard`` on every decoder layer
and the root (torch makes the process groups), and the default
``weight_sync_tensors`` of :class:`~twinkle_ray.weights.WeightSyncMixin`,
which gathers the DTensor shards once per sync (``full_tensor()`` on every
rank, rank 0 keeps them). The names are the HF state-dict names, which is
what vLLM's ``load_weights`` takes. The batch layout is the Megatron
adapter's :func:`pad_batch` (the vLLM sampler's rollouts: prompt ids,
completion ids, log-probs).

Runs on CUDA (bf16) or, without a GPU, on CPU (float32, gloo): that is how
``tests/test_rlhf_fsdp_hf.py`` checks it, with a tiny local checkpoint.
Tensor/context/pipeline parallelism are refused (FSDP only; HSDP via
``dp_replicate_size``).
"""

from __future__ import annotations

from typing import Any

from examples.vllm_megatron.megatron_trainer import pad_batch
from twinkle_ray import DeviceMesh, remote_class, remote_function
from twinkle_ray.weights import WeightSyncMixin


def _decoder_layers(model: Any) -> list:
    """The repeated blocks of an HF causal LM (``model.model.layers`` for Llama/Qwen/Mistral, GPT-2's ``h``)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return list(obj)
    return []


@remote_class()
class FSDP2Trainer(WeightSyncMixin):
    """An HF causal LM sharded with FSDP2 over the gang; GRPO steps; weights gathered for the sync."""

    def __init__(self, hf_model: str, *, device_mesh: DeviceMesh, lr: float = 1e-6, clip: float = 0.2):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        for dim in ("tp", "cp", "pp"):
            if device_mesh.has_dim(dim) and device_mesh.get_dim_size(dim) > 1:
                raise NotImplementedError(f"FSDP2Trainer (example adapter) is FSDP/HSDP only; {dim} > 1 is not")
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32).to(self.device)
        torch_mesh = device_mesh.to_torch()
        shard = "dp_shard" if device_mesh.get_dim_size("cp") == 1 else "dp_shard_cp"
        self.fsdp_mesh = (torch_mesh["dp_replicate", shard] if device_mesh.get_dim_size("dp_replicate") > 1
                          else torch_mesh[shard])
        # bf16 compute on GPU, fp32 master weights (what the optimizer and the weight sync see)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
        kw = {"mesh": self.fsdp_mesh, **({"mp_policy": mp} if mp else {})}
        for layer in _decoder_layers(self.model):
            fully_shard(layer, **kw)
        fully_shard(self.model, **kw)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.clip = clip

    @remote_function(dispatch="slice_dp", collect="mean")
    def train_step(self, rollouts: list[dict], scores: dict) -> dict:
        """One clipped policy-gradient step on this data rank's rollouts (FSDP2 reduce-scatters grads)."""
        import torch

        b = pad_batch(rollouts, scores, self.device)
        self.model.train()
        logits = self.model(input_ids=b["tokens"]).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, b["tokens"][:, 1:, None])[..., 0]
        ratio = torch.exp(logp - b["old"])
        adv = b["adv"][:, None]
        surrogate = torch.min(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
        loss = -(surrogate * b["mask"]).sum() / b["mask"].sum().clamp(min=1)
        self.opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        ratio_err = ((ratio.detach() - 1).abs() * b["mask"]).max().item()
        return {"loss": loss.item(), "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                                                        else grad_norm),
                "ratio_err": ratio_err,
                "reward": float(sum(scores["reward"]) / max(1, len(scores["reward"])))}
