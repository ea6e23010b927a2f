"""vLLM receives weight syncs through its own weight-transfer API: a twinkle_ray engine registered with vLLM.

vLLM (0.32) ships a native API for RL weight updates: an engine built with
``LLM(..., weight_transfer_config=WeightTransferConfig(backend=NAME))`` holds, in every vLLM worker, a
``WeightTransferEngine`` that ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` drive (start and finish run vLLM's layer-wise reload:
it shards, fuses q/k/v and gate/up, and repacks the weights for its kernels, in place).

:class:`TwinkleWeightTransferEngine` is such an engine over twinkle_ray's own transport
(:mod:`twinkle_ray.weight_channel`: gloo on CPU, where none of vLLM's built-in backends runs). It
is registered with ``WeightTransferEngineFactory`` under :data:`BACKEND` by :func:`register`; each
vLLM worker is one receiver of the sync (one on CPU, where vLLM runs TP=1), joins every lane (one
per pipeline stage of the trainer) at the channel rank the driver gave it, and loads each bucket
with ``model.load_weights`` between the start and finish of vLLM's layer-wise reload::

    from twinkle_ray.integrations.vllm_engine import register, init_info, update_info
    llm = vllm.LLM(model, weight_transfer_config=WeightTransferConfig(backend=register()))
    llm.init_weight_transfer_engine({"init_info": init_info(channel, addr, port, ranks, world, "gloo", 300)})
    llm.start_weight_update()
    llm.update_weights({"update_info": update_info(channel)})    # the trainer sends meanwhile
    llm.finish_weight_update()

On CUDA the sampler selects vLLM's own ``nccl`` engine instead (:data:`CUDA_BACKEND`; its M-to-N
resharding engine ``nccl_m2n`` is the option for TP-sharded receivers and several sources) -- see
:func:`transfer_config`. That path is written to vLLM's API and has not run here (no GPU).

This module imports vLLM; nothing in twinkle_ray imports it but a sampler that builds a vLLM engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from ..weight_channel import ReceiverEnd

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "CUDA_BACKEND", "RESHARDING_BACKEND", "TwinkleWeightTransferEngine", "init_info",
           "register", "transfer_config", "update_info"]

BACKEND = "twinkle_gloo"  # registered by register(): twinkle_ray's channel, gloo (CPU)
CUDA_BACKEND = "nccl"  # vLLM's own dense NCCL engine (one source, full tensors to every receiver)
RESHARDING_BACKEND = "nccl_m2n"  # vLLM's M-to-N engine: sharded receivers, several sources


@dataclass
class TwinkleInitInfo(WeightTransferInitInfo):
    """Where a vLLM worker joins a twinkle_ray weight-sync channel (``init_weight_transfer_engine``)."""

    channel: str
    addr: str
    port: int
    ranks: list = field(default_factory=list)  # [[receiver index, channel rank], ...] of this engine
    world_size: int = 0
    backend: str = "gloo"
    timeout_s: float = 300.0


@dataclass
class TwinkleUpdateInfo(WeightTransferUpdateInfo):
    """Which channel one update comes through (``update_weights``); the tensors' manifest comes over it."""

    channel: str


class TwinkleWeightTransferEngine(WeightTransferEngine[TwinkleInitInfo, TwinkleUpdateInfo]):
    """A vLLM weight-transfer engine receiving twinkle_ray weight syncs (see the module docstring).

    One :class:`~twinkle_ray.weight_channel.ReceiverEnd` per vLLM worker (``index`` = the worker's
    rank in its engine): it joins every lane of a channel, and takes one sync, all lanes at once,
    into ``model.load_weights``. The figures of the last update are kept in :attr:`last`.
    """

    init_info_cls = TwinkleInitInfo
    update_info_cls = TwinkleUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.end = ReceiverEnd(self._load, index=int(getattr(self.parallel_config, "rank", 0)))
        self.last: dict = {}

    def init_transfer_engine(self, init_info: TwinkleInitInfo) -> None:
        """Join the channel (every lane) at this worker's channel rank."""
        self.end.join(init_info.channel, init_info.addr, int(init_info.port), init_info.ranks,
                      int(init_info.world_size), init_info.backend, float(init_info.timeout_s))

    def start_weight_update(self) -> None:
        """vLLM's layer-wise reload starts: received checkpoint-format weights are processed per layer."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one sync (every lane) into the model; CPU needs no device synchronisation."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: TwinkleUpdateInfo) -> None:
        """Take one sync from the channel: each bucket goes to ``model.load_weights`` as it arrives."""
        self.last = self.end.recv(update_info.channel)

    def _load(self, buckets: Any) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            for items in buckets:
                self.model.load_weights(items)

    def finish_weight_update(self) -> None:
        """vLLM's layer-wise reload ends: the last layers are processed (repacked) in place."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Leave every channel this worker joined."""
        for channel in list(self.end.channels):
            self.end.close(channel)


def register() -> str:
    """Register :class:`TwinkleWeightTransferEngine` with vLLM (once per process); returns its backend name."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, TwinkleWeightTransferEngine)
    except ValueError:  # registered already in this process
        pass
    return BACKEND


def transfer_config(device_type: str) -> WeightTransferConfig:
    """The engine's ``weight_transfer_config``: ours on CPU (registered here), vLLM's ``nccl`` on CUDA."""
    return WeightTransferConfig(backend=register() if device_type == "cpu" else CUDA_BACKEND)


def init_info(channel: str, addr: str, port: int, ranks: list, world_size: int, backend: str,
              timeout_s: float) -> dict:
    """The ``init_info`` payload of ``LLM.init_weight_transfer_engine`` for :data:`BACKEND`."""
    return {"channel": channel, "addr": addr, "port": int(port), "ranks": [list(r) for r in ranks],
            "world_size": int(world_size), "backend": backend, "timeout_s": float(timeout_s)}


def update_info(channel: str) -> dict:
    """The ``update_info`` payload of ``LLM.update_weights`` for :data:`BACKEND`."""
    return {"channel": channel}


def engine_figures(worker: Any) -> dict:
    """The last update's figures in a vLLM worker (for ``collective_rpc``: a read, not a transfer)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return dict(getattr(engine, "last", {}) or {})
