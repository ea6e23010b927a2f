"""vLLM receives weight syncs through its own weight-transfer API: a twinkle_ray engine registered with vLLM.

vLLM (0.32) ships a native API for RL weight updates: an engine built with
``LLM(..., weight_transfer_config=WeightTransferConfig(backend=NAME))`` holds, in every vLLM worker, a
``WeightTransferEngine`` that ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` drive (start and finish run vLLM's layer-wise reload:
it shards, fuses q/k/v and gate/up, and repacks the weights for its kernels, in place).

:class:`TwinkleWeightTransferEngine` is such an engine over twinkle_ray's own transport
(:mod:`twinkle_ray.weights`: point-to-point pairs with the trainer ranks that hold what this worker
keeps; gloo on CPU, where none of vLLM's built-in backends runs, NCCL pairs on CUDA -- not run here).
It is registered with ``WeightTransferEngineFactory`` under :data:`BACKEND` by :func:`register`; each
vLLM worker is one receiver of the sync: it joins its pairs from the plan it is given, and loads each
completed tensor with ``model.load_weights`` between the start and finish of vLLM's layer-wise reload::

    from twinkle_ray.integrations.vllm_engine import register, init_info, update_info
    llm = vllm.LLM(model, weight_transfer_config=WeightTransferConfig(backend=register()))
    llm.init_weight_transfer_engine({"init_info": init_info(channel, setup)})   # setup: the plan
    llm.start_weight_update()
    llm.update_weights({"update_info": update_info(channel)})    # the trainer ranks send meanwhile
    llm.finish_weight_update()

An engine whose workers run in processes of their own (``AsyncLLM``: its engine core is always a
child process, spawned in a Ray actor; CUDA TP > 1: one more per GPU) names
:data:`EXTENSION` as its ``worker_extension_cls``: vLLM imports this module in each of its worker
processes before it builds their weight-transfer engines, which registers :data:`BACKEND` there
too, and the extension's methods answer ``collective_rpc`` by name (no pickled callables)::

    AsyncEngineArgs(model, weight_transfer_config=transfer_config("cpu"), worker_extension_cls=EXTENSION)
    await engine.collective_rpc("twinkle_engine_figures")   # the last update's figures, per worker

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

from ..weights.receiver import ReceiverEnd

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "EXTENSION", "TwinkleWeightTransferEngine", "TwinkleWorkerExtension", "WholeOrNothingReload",
           "decode_params", "init_info", "register", "transfer_config", "update_info"]

BACKEND = "twinkle_gloo"  # registered by register(): twinkle_ray's pairs (gloo on CPU, NCCL on CUDA)
EXTENSION = f"{__name__}.TwinkleWorkerExtension"  # an engine's worker_extension_cls (see the module docstring)


class _BelowError(logging.Filter):
    """Drops records below ERROR (leaves the logger's level as it was)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


class WholeOrNothingReload:
    """What a failed update leaves, for an engine that loads through vLLM's layer-wise reload
    (mixed in before the vLLM engine class).

    ``start_weight_update`` moves every layer to the meta device, and vLLM's worker does not call
    ``finish_weight_update`` after a failed update: left so, the engine cannot read its weights,
    and its generation spins even after a later sync succeeds. So a failed update finishes the
    reload here. When it had loaded nothing (a sender failed before sending),
    that puts every layer's previous tensors back: the engine keeps its weights whole and
    generates as before. When part of it was loaded (a load or the transfer failed part-way),
    the layers it reached are new and a layer cut mid-way holds uninitialised values; the error
    says so, and the next successful sync makes the engine whole.
    """

    loaded = False  # whether this update has handed any tensor to the model

    def start_weight_update(self) -> None:
        self.loaded = False
        super().start_weight_update()

    def finish_weight_update(self) -> None:
        if self.loaded:
            super().finish_weight_update()
            return
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        quiet = _BelowError()  # one 'Failed to load weights' per layer: expected here
        reload_log.addFilter(quiet)
        try:
            super().finish_weight_update()
        finally:
            reload_log.removeFilter(quiet)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            super().update_weights(update_info)
        except BaseException as e:
            try:
                self.finish_weight_update()
            except Exception:
                logger.warning("weight sync: ending vLLM's layer-wise reload after a failed update failed",
                               exc_info=True)
            if self.loaded:
                why = ("weight sync failed after part of it was loaded: this vLLM engine's weights are "
                       "partly new (a layer cut mid-way holds uninitialised values) until a sync succeeds")
                logger.error(why)
                e.add_note(why)
            raise


@dataclass
class TwinkleInitInfo(WeightTransferInitInfo):
    """Where a vLLM worker joins a twinkle_ray weight-sync channel (``init_weight_transfer_engine``)."""

    channel: str
    setup: dict = field(default_factory=dict)  # the plan, the backend and the timeout (WeightSync's set-up)


@dataclass
class TwinkleUpdateInfo(WeightTransferUpdateInfo):
    """Which channel one update comes through (``update_weights``); the tensors' manifest comes over it."""

    channel: str


class _ChannelReceiving(WeightTransferEngine[TwinkleInitInfo, TwinkleUpdateInfo]):
    """The receiving of :class:`TwinkleWeightTransferEngine` (which adds what a failure leaves)."""

    init_info_cls = TwinkleInitInfo
    update_info_cls = TwinkleUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.end = ReceiverEnd(self._load, index=int(getattr(self.parallel_config, "rank", 0)))
        self.last: dict = {}

    def init_transfer_engine(self, init_info: TwinkleInitInfo) -> None:
        """Join this worker's pairs of the channel, as the plan says."""
        self.end.join(init_info.channel, init_info.setup)

    def start_weight_update(self) -> None:
        """vLLM's layer-wise reload starts: received checkpoint-format weights are processed per layer."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one sync (every pair) into the model; CPU needs no device synchronisation. A
        sender that failed before sending loads nothing (see
        :class:`~twinkle_ray.weights.ReceiverEnd`), so the engine keeps its previous weights whole
        (:class:`WholeOrNothingReload`)."""
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
                self.loaded = True
                self.model.load_weights(items)

    def finish_weight_update(self) -> None:
        """vLLM's layer-wise reload ends: the last layers are processed (repacked) in place."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Leave every channel this worker joined."""
        for channel in list(self.end.channels):
            self.end.close(channel)


class TwinkleWeightTransferEngine(WholeOrNothingReload, _ChannelReceiving):
    """A vLLM weight-transfer engine receiving twinkle_ray weight syncs (see the module docstring).

    One :class:`~twinkle_ray.weights.ReceiverEnd` per vLLM worker (``index`` = the worker's rank in
    its engine): it joins its pairs of a channel, and takes one sync, every pair at once, into
    ``model.load_weights``. The figures of the last update are kept in :attr:`last`. A sync
    that fails leaves the weights as :class:`WholeOrNothingReload` says.
    """


def register() -> str:
    """Register :class:`TwinkleWeightTransferEngine` with vLLM (once per process); returns its backend name."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, TwinkleWeightTransferEngine)
    except ValueError:  # registered already in this process
        pass
    return BACKEND


def transfer_config(device_type: str) -> WeightTransferConfig:
    """The engine's ``weight_transfer_config``: ours (the pairs' backend follows the devices)."""
    register()
    return WeightTransferConfig(backend=BACKEND)


def init_info(channel: str, setup: dict) -> dict:
    """The ``init_info`` payload of ``LLM.init_weight_transfer_engine`` for :data:`BACKEND`."""
    return {"channel": channel, "setup": setup}


def update_info(channel: str) -> dict:
    """The ``update_info`` payload of ``LLM.update_weights`` for :data:`BACKEND`."""
    return {"channel": channel}


def engine_figures(worker: Any) -> dict:
    """The last update's figures in a vLLM worker (for ``collective_rpc``: a read, not a transfer)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return dict(getattr(engine, "last", {}) or {})


def engine_params(worker: Any) -> dict:
    """A vLLM worker's weight-transfer engine class and its model's parameters as they are now (CPU
    copies; vLLM's names: fused qkv_proj / gate_up_proj). For checks."""
    engine = getattr(worker, "weight_transfer_engine", None)
    params = {n: p.detach().cpu().clone() for n, p in worker.model_runner.get_model().named_parameters()}
    return {"engine": type(engine).__name__, "params": params}


class TwinkleWorkerExtension:
    """Mixed into every vLLM worker of an engine built with ``worker_extension_cls=EXTENSION``: reads
    by name for ``collective_rpc`` (an engine in another process takes no pickled callables)."""

    def twinkle_engine_figures(self) -> dict:
        """:func:`engine_figures` of this worker."""
        return engine_figures(self)

    def twinkle_engine_params(self) -> dict:
        """:func:`engine_params` of this worker, each tensor as ``[dtype, shape, bytes]`` (vLLM's RPC
        from another process returns tensors in a result as nested lists): :func:`decode_params`."""
        got = engine_params(self)
        got["params"] = {n: [str(t.dtype).removeprefix("torch."), list(t.shape), t.contiguous().numpy().tobytes()
                             if t.dtype != torch.bfloat16 else t.contiguous().view(torch.int16).numpy().tobytes()]
                         for n, t in got["params"].items()}
        return got


def decode_params(encoded: dict) -> dict:
    """Tensors back from :meth:`TwinkleWorkerExtension.twinkle_engine_params`'s ``[dtype, shape, bytes]``.

    >>> t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    >>> decode_params({"w": ["float32", [2, 3], t.numpy().tobytes()]})["w"].equal(t)
    True
    """
    out = {}
    for name, (dtype, shape, raw) in encoded.items():
        dt = getattr(torch, dtype)
        if not raw:
            out[name] = torch.empty(shape, dtype=dt)
        else:
            out[name] = torch.frombuffer(bytearray(raw), dtype=dt).reshape(shape).clone()
    return out


# vLLM imports this module in each worker process of an engine that names EXTENSION, before it builds
# the worker's weight-transfer engine: the backend must be known there, not only in the process
# that configured the engine (a spawned process starts with vLLM's registry empty).
register()
