"""HF Llama <-> Megatron-Core GPTModel (local layer spec): config, names, and the TP shard layouts.

    spec = LlamaSpec.from_hf(hf_config)                    # sizes checked, with errors naming the field
    tc, gpt_kwargs = spec.megatron_config(tp=2, pp=1, cpu=True)
    local = spec.shard_from_hf(hf_state, "decoder.layers.0.mlp.linear_fc1.weight", layer_offset=0,
                               tp_rank=0, tp=2)           # this rank's slice of gate_proj + up_proj
    hf = spec.hf_from_shards("decoder.layers.1.self_attention.linear_qkv.weight", [s0, s1], layer_offset=0)
    # -> [("model.layers.1.self_attention.q_proj.weight", q), (... k_proj ...), (... v_proj ...)]

Written for this example instead of mbridge: the mapping is a page, needs no
extra package, and covers exactly the local layer spec (separate
``input_layernorm`` / ``pre_mlp_layernorm``, torch RMSNorm) that runs on CPU.
Megatron layouts, full (TP=1) tensor first, then how TP splits it:

- ``linear_qkv.weight``: per query group ``g``: the group's query heads, then
  its key head, then its value head (``[ng * (nq/ng + 2) * d, h]``); TP ranks
  hold contiguous groups, so the shards concatenate along dim 0.
- ``linear_fc1.weight``: ``[gate; up]`` (SwiGLU's first half is the gate); a
  TP rank holds ``[gate_r; up_r]``, so the shards are split in halves first.
- ``linear_proj`` / ``linear_fc2``: row-parallel, split along dim 1.
- ``word_embeddings`` / ``output_layer``: vocab-parallel, split along dim 0.
- norms: replicated.

Only what this mapping knows is accepted: Llama-style models (RMSNorm, SwiGLU,
RoPE without scaling, no biases). Anything else raises ``ValueError`` naming
the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["LlamaSpec", "load_hf_state"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron (local spec) name inside a layer -> HF name inside a layer, for the 1:1 tensors
_LAYER_1TO1 = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_REPLICATED = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "decoder.final_layernorm.weight")


def load_hf_state(path: str) -> dict[str, Any]:
    """Every tensor of an HF checkpoint directory (``*.safetensors``, sharded or not), on the CPU."""
    import glob
    import os

    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path!r}: expected an HF checkpoint (save_pretrained)")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(f, device="cpu"))
    return state


@dataclass(frozen=True)
class LlamaSpec:
    """The sizes of an HF Llama that decide the Megatron model and the weight layouts."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    rms_eps: float
    rope_theta: float
    tied: bool

    @classmethod
    def from_hf(cls, cfg: Any) -> LlamaSpec:
        """From a transformers ``LlamaConfig`` (or any config with the same fields)."""
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"hf_megatron: rope_type {rope_type!r} is not mapped (only plain RoPE)")
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
        if theta is None:
            raise ValueError("hf_megatron: the HF config has no rope_theta (nor rope_parameters['rope_theta'])")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(cfg, flag, False):
                raise ValueError(f"hf_megatron: {flag}=True is not mapped (the local spec here has no biases)")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hf_megatron: hidden_act={act!r} is not mapped (SwiGLU with silu only)")
        heads = cfg.num_attention_heads
        return cls(hidden=cfg.hidden_size, ffn=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                   heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   vocab=cfg.vocab_size, max_positions=cfg.max_position_embeddings, rms_eps=cfg.rms_norm_eps,
                   rope_theta=float(theta), tied=bool(getattr(cfg, "tie_word_embeddings", False)))

    # ------------------------------------------------------------------------ config
    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise ValueError naming the size when the model does not split over tp / pp."""
        for what, n in (("num_attention_heads", self.heads), ("num_key_value_heads", self.kv_heads),
                        ("intermediate_size", self.ffn), ("vocab_size", self.vocab)):
            if n % tp:
                raise ValueError(f"{what}={n} is not divisible by tp_size={tp} (the mesh's tp); "
                                 f"choose a tp that divides it")
        if self.layers % pp:
            raise ValueError(f"num_hidden_layers={self.layers} is not divisible by pp_size={pp} "
                             f"(the mesh's pp); choose a pp that divides it")

    def megatron_config(self, *, tp: int, pp: int, cpu: bool, micro_batch_size: int = 1) -> tuple[Any, dict]:
        """(TransformerConfig, GPTModel keyword arguments) for this model at (tp, pp), fp32."""
        import torch
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        self.check_parallel(tp, pp)
        tc = TransformerConfig(
            num_layers=self.layers, hidden_size=self.hidden, ffn_hidden_size=self.ffn,
            num_attention_heads=self.heads, num_query_groups=self.kv_heads, kv_channels=self.head_dim,
            normalization="RMSNorm", layernorm_epsilon=self.rms_eps, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
            hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
            params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False, fp16=False,
            use_cpu_initialization=cpu, perform_initialization=False,
            # fused kernels are CUDA-only; plain torch paths everywhere
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            apply_rope_fusion=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
            batch_p2p_sync=not cpu,  # W5: p2p_communication calls torch.cuda.synchronize() otherwise
            attention_softmax_in_fp32=True,
        )
        kwargs = dict(vocab_size=self.vocab, max_sequence_length=self.max_positions, parallel_output=True,
                      share_embeddings_and_output_weights=self.tied, position_embedding_type="rope",
                      rotary_base=int(self.rope_theta) if float(self.rope_theta).is_integer() else self.rope_theta)
        return tc, kwargs

    # ------------------------------------------------------------------------ HF -> Megatron shard
    def _hf_layer(self, i: int, rest: str) -> str:
        return f"model.layers.{i}.{rest}"

    def full_from_hf(self, hf: dict[str, Any], name: str, layer_offset: int) -> Any:
        """The full (TP=1) Megatron tensor ``name`` (local layer index + ``layer_offset``) from HF tensors."""
        import torch

        if name in _TOP:
            key = _TOP[name]
            if name == "output_layer.weight" and self.tied:
                key = _TOP["embedding.word_embeddings.weight"]
            return hf[key]
        m = _LAYER.match(name)
        if not m:
            raise KeyError(f"hf_megatron: no HF tensor for Megatron parameter {name!r}")
        i, rest = int(m.group(1)) + layer_offset, m.group(2)
        if rest in _LAYER_1TO1:
            return hf[self._hf_layer(i, _LAYER_1TO1[rest])]
        if rest == "self_attention.linear_qkv.weight":
            d, ng, per = self.head_dim, self.kv_heads, self.heads // self.kv_heads
            q = hf[self._hf_layer(i, "self_attn.q_proj.weight")].reshape(ng, per * d, -1)
            k = hf[self._hf_layer(i, "self_attn.k_proj.weight")].reshape(ng, d, -1)
            v = hf[self._hf_layer(i, "self_attn.v_proj.weight")].reshape(ng, d, -1)
            return torch.cat([q, k, v], dim=1).reshape(ng * (per + 2) * d, -1)
        if rest == "mlp.linear_fc1.weight":
            return torch.cat([hf[self._hf_layer(i, "mlp.gate_proj.weight")],
                              hf[self._hf_layer(i, "mlp.up_proj.weight")]], dim=0)
        raise KeyError(f"hf_megatron: no HF tensor for Megatron parameter {name!r}")

    def shard_from_hf(self, hf: dict[str, Any], name: str, *, layer_offset: int, tp_rank: int, tp: int) -> Any:
        """This TP rank's slice of Megatron parameter ``name``, cut from the HF tensors."""
        import torch

        full = self.full_from_hf(hf, name, layer_offset)
        rest = _LAYER.match(name).group(2) if _LAYER.match(name) else name
        if rest in _REPLICATED or name in _REPLICATED:
            return full.clone()
        if rest == "mlp.linear_fc1.weight":
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]], 0)
        dim = 1 if rest in _ROW_PARALLEL else 0
        return full.chunk(tp, dim)[tp_rank].clone()

    def load_into(self, named_params: Any, hf: dict[str, Any], *, layer_offset: int, tp_rank: int, tp: int) -> None:
        """Copy every Megatron parameter's TP shard from the HF tensors; ValueError on a shape mismatch."""
        import torch

        with torch.no_grad():
            for name, param in named_params:
                local = self.shard_from_hf(hf, name, layer_offset=layer_offset, tp_rank=tp_rank, tp=tp)
                if tuple(local.shape) != tuple(param.shape):
                    raise ValueError(f"hf_megatron: Megatron parameter {name} is {tuple(param.shape)} but the HF "
                                     f"checkpoint gives {tuple(local.shape)} for tp rank {tp_rank} of {tp}")
                param.copy_(local)

    # ------------------------------------------------------------------------ Megatron shards -> HF
    @staticmethod
    def tp_dim(name: str) -> int | None:
        """The dim Megatron splits ``name`` along over TP (None: replicated)."""
        rest = _LAYER.match(name).group(2) if _LAYER.match(name) else name
        if rest in _REPLICATED or name in _REPLICATED:
            return None
        return 1 if rest in _ROW_PARALLEL else 0

    def hf_blocks(self, name: str, local_shape: tuple, layer_offset: int, tp_rank: int,
                  tp: int) -> tuple[int, list[tuple[str, tuple, int, int]]]:
        """Where TP rank ``tp_rank``'s shard of Megatron parameter ``name`` lies in the HF tensors:
        (dim, [(HF name, HF full shape, start along dim, length), ...] in the shard's own order).
        What a weight sync sends instead of gathering: each block is a view of the shard.

        - norms (replicated): the whole tensor; ``output_layer`` of tied embeddings: nothing;
        - ``linear_qkv``: per local query group, its q rows, k rows and v rows;
        - ``linear_fc1``: this rank's gate rows, then its up rows;
        - row-parallel (``linear_proj``, ``linear_fc2``): its columns; vocab-parallel: its rows.
        """
        dim = self.tp_dim(name)
        m = _LAYER.match(name)
        rest = m.group(2) if m else name
        n_local = int(local_shape[0]) if local_shape else 1
        if not m:
            if name == "output_layer.weight" and self.tied:
                return 0, []
            full = (self.vocab, self.hidden) if name != "decoder.final_layernorm.weight" else (self.hidden,)
            return 0, [(_TOP[name], full, 0 if dim is None else tp_rank * n_local, n_local)]
        i = int(m.group(1)) + layer_offset
        if dim is None:
            return 0, [(self._hf_layer(i, _LAYER_1TO1[rest]), tuple(local_shape), 0, n_local)]
        if rest in _ROW_PARALLEL:
            hf = self._hf_layer(i, _LAYER_1TO1[rest])
            cols = int(local_shape[1])
            return 1, [(hf, (int(local_shape[0]), cols * tp), tp_rank * cols, cols)]
        if rest == "mlp.linear_fc1.weight":
            per = self.ffn // tp
            return 0, [(self._hf_layer(i, f"mlp.{x}_proj.weight"), (self.ffn, self.hidden), tp_rank * per, per)
                       for x in ("gate", "up")]
        if rest == "self_attention.linear_qkv.weight":
            d, ng, per = self.head_dim, self.kv_heads, self.heads // self.kv_heads
            q_full, kv_full = (self.heads * d, self.hidden), (ng * d, self.hidden)
            out = []
            for g in range(tp_rank * ng // tp, (tp_rank + 1) * ng // tp):
                out += [(self._hf_layer(i, "self_attn.q_proj.weight"), q_full, g * per * d, per * d),
                        (self._hf_layer(i, "self_attn.k_proj.weight"), kv_full, g * d, d),
                        (self._hf_layer(i, "self_attn.v_proj.weight"), kv_full, g * d, d)]
            return 0, out
        raise KeyError(f"hf_megatron: Megatron parameter {name!r} has no HF name")

    def hf_from_shards(self, name: str, shards: list[Any], layer_offset: int) -> list[tuple[str, Any]]:
        """The HF-named full tensors of Megatron parameter ``name`` from its TP shards (rank order)."""
        import torch

        dim = self.tp_dim(name)
        m = _LAYER.match(name)
        rest = m.group(2) if m else name
        if dim is None:
            full = shards[0]
        elif rest == "mlp.linear_fc1.weight":
            halves = [s.chunk(2, dim=0) for s in shards]
            gate = torch.cat([h[0] for h in halves], 0)
            up = torch.cat([h[1] for h in halves], 0)
        else:
            full = torch.cat(shards, dim) if len(shards) > 1 else shards[0]
        if not m:
            if name == "output_layer.weight" and self.tied:
                return []  # HF keeps one tensor for tied embeddings
            return [(_TOP[name], full)]
        i = int(m.group(1)) + layer_offset
        if rest in _LAYER_1TO1:
            return [(self._hf_layer(i, _LAYER_1TO1[rest]), full)]
        if rest == "mlp.linear_fc1.weight":
            return [(self._hf_layer(i, "mlp.gate_proj.weight"), gate), (self._hf_layer(i, "mlp.up_proj.weight"), up)]
        if rest == "self_attention.linear_qkv.weight":
            d, ng, per = self.head_dim, self.kv_heads, self.heads // self.kv_heads
            g = full.reshape(ng, (per + 2) * d, -1)
            q, k, v = g.split([per * d, d, d], dim=1)
            return [(self._hf_layer(i, "self_attn.q_proj.weight"), q.reshape(ng * per * d, -1)),
                    (self._hf_layer(i, "self_attn.k_proj.weight"), k.reshape(ng * d, -1)),
                    (self._hf_layer(i, "self_attn.v_proj.weight"), v.reshape(ng * d, -1))]
        raise KeyError(f"hf_megatron: Megatron parameter {name!r} has no HF name")

