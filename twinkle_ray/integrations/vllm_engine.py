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

On CUDA the sampler selects vLLM's own NCCL engine instead -- see :func:`transfer_config`:
:class:`LaneNCCLWeightTransferEngine` (:data:`CUDA_BACKEND`) is vLLM's ``NCCLWeightTransferEngine``
holding one communicator per lane (one per trainer pipeline stage; vLLM's keeps one, with one
sender); joining, receiving (packed NCCL broadcast) and the layer-wise reload are vLLM's. The trainer
side is vLLM's ``NCCLTrainerWeightTransferEngine``, opened by each lane's source
(:mod:`twinkle_ray.integrations.vllm_trainer`); :class:`NcclReceivers` reads what it publishes and
drives ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``. vLLM's M-to-N engine ``nccl_m2n`` (:data:`RESHARDING_BACKEND`) is the
option for TP-sharded receivers taking only their shard. The CUDA path is written to vLLM's API
and has not run here (no GPU); the tests replace NCCL with recording fakes.

This module imports vLLM; nothing in twinkle_ray imports it but a sampler that builds a vLLM engine.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

from ..weight_channel import (
    PEER_WAIT_S,
    ReceiverEnd,
    SourceFailed,
    WeightChannel,
    _dtype,
    lane_prefix,
)

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "CUDA_BACKEND", "RESHARDING_BACKEND", "LaneNCCLWeightTransferEngine", "NcclReceivers",
           "TwinkleWeightTransferEngine", "WholeOrNothingReload", "init_info", "register", "transfer_config",
           "update_info"]

BACKEND = "twinkle_gloo"  # registered by register(): twinkle_ray's channel, gloo (CPU)
CUDA_BACKEND = "twinkle_nccl"  # vLLM's dense NCCL engine, one communicator per lane (full tensors to every receiver)
RESHARDING_BACKEND = "nccl_m2n"  # vLLM's M-to-N engine: sharded receivers, several sources


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
    reload here. When it had loaded nothing (a source failed before sending; a dropped lane),
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


class _Dropped:
    """A stand-in model whose ``load_weights`` takes the received tensors and keeps none: what a
    lane's receive loads into when the sync is dropped (another lane's source failed)."""

    def load_weights(self, weights: Any = None, *args: Any, **kwargs: Any) -> set:
        for _ in weights or ():
            pass
        return set()


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
        """Join the channel (every lane) at this worker's channel rank."""
        self.end.join(init_info.channel, init_info.addr, int(init_info.port), init_info.ranks,
                      int(init_info.world_size), init_info.backend, float(init_info.timeout_s))

    def start_weight_update(self) -> None:
        """vLLM's layer-wise reload starts: received checkpoint-format weights are processed per layer."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one sync (every lane) into the model; CPU needs no device synchronisation. A
        source that failed before sending loads nothing (see
        :func:`~twinkle_ray.weight_channel.receive_lanes`), so the engine keeps its previous
        weights whole (:class:`WholeOrNothingReload`)."""
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

    One :class:`~twinkle_ray.weight_channel.ReceiverEnd` per vLLM worker (``index`` = the worker's
    rank in its engine): it joins every lane of a channel, and takes one sync, all lanes at once,
    into ``model.load_weights``. The figures of the last update are kept in :attr:`last`. A sync
    that fails leaves the weights as :class:`WholeOrNothingReload` says.
    """


# ------------------------------------------------------------------------------ CUDA: vLLM's NCCL engine
@dataclass(kw_only=True)
class LaneNCCLInitInfo(NCCLWeightTransferInitInfo):
    """vLLM's NCCL worker init info, and the lane (trainer source) whose group it joins."""

    lane: int = 0


@dataclass
class LaneNCCLUpdateInfo(NCCLWeightTransferUpdateInfo):
    """vLLM's NCCL update info (names, dtype names, shapes), the lane it comes from, and whether
    its tensors are received and dropped (``drop``: another lane's source failed)."""

    lane: int = 0
    drop: bool = False


class LaneNCCLWeightTransferEngine(WholeOrNothingReload, NCCLWeightTransferEngine):
    """vLLM's ``NCCLWeightTransferEngine`` with one communicator per lane: a pipeline-parallel trainer's
    stages each send their own layers from rank 0 of a group of their own (vLLM's engine holds one
    group, with one sender). ``init_weight_transfer_engine`` is called once per lane; each
    ``update_weights`` names its lane. Joining and receiving are vLLM's own (not run here: no GPU).
    """

    init_info_cls = LaneNCCLInitInfo
    update_info_cls = LaneNCCLUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.lanes: dict[int, Any] = {}

    def init_transfer_engine(self, init_info: LaneNCCLInitInfo) -> None:
        """Join lane ``init_info.lane``'s group (vLLM's rendezvous, rank = rank_offset + worker rank)."""
        old = self.lanes.pop(init_info.lane, None)
        if old is not None:
            old.destroy()
        super().init_transfer_engine(init_info)
        self.lanes[init_info.lane] = self.model_update_group

    def receive_weights(self, update_info: LaneNCCLUpdateInfo) -> None:
        """Receive one lane's tensors with vLLM's NCCL receive, on that lane's communicator."""
        group = self.lanes.get(update_info.lane)
        if group is None:
            raise RuntimeError(f"{type(self).__name__}: lane {update_info.lane} was not initialised "
                               f"(lanes {sorted(self.lanes)})")
        self.model_update_group = group
        if not update_info.drop:
            self.loaded = True
            super().receive_weights(update_info)
            return
        model, self.model = self.model, _Dropped()  # vLLM's receive loads into self.model
        try:
            super().receive_weights(update_info)
        finally:
            self.model = model

    def shutdown(self) -> None:
        for group in self.lanes.values():
            group.destroy()
        self.lanes.clear()
        self.model_update_group = None


class NcclReceivers:
    """One vLLM engine's receivers of a weight-sync channel on CUDA, driving vLLM's API on its ``LLM``.

    The trainer's sources open vLLM's NCCL trainer endpoint (:mod:`twinkle_ray.integrations.vllm_trainer`)
    and publish into the channel's store, per lane, the worker init info and each sync's update info.
    :meth:`join` passes each lane's set-up gate and calls ``init_weight_transfer_engine`` with that
    init info (``rank_offset`` = this engine's first channel rank: its TP workers take the ranks after
    it); :meth:`recv` reads every lane's update info for the next sync, then ``start_weight_update``,
    ``update_weights`` per lane and ``finish_weight_update``.

    >>> # rx = NcclReceivers.join(llm, channel, addr, port, [[0, 1], [1, 2]], world_size=3, timeout_s=300)
    >>> # figures = rx.recv(llm)        # one dict per receiver (TP worker) of the engine
    """

    def __init__(self, channel: str, end: WeightChannel, receivers: int, lanes: int):
        self.channel, self.end, self.receivers, self.lanes = channel, end, receivers, lanes
        self.syncs = 0

    @classmethod
    def join(cls, llm: Any, channel: str, addr: str, port: int, ranks: list, world_size: int,
             timeout_s: float) -> NcclReceivers:
        """Join every lane of ``channel`` (``ranks``: [[receiver index, channel rank], ...] of this engine)."""
        from .vllm_trainer import lane_store

        first = min(int(r) for _, r in ranks)
        if sorted(int(r) for _, r in ranks) != list(range(first, first + len(ranks))):
            raise ValueError(f"weight sync channel {channel!r}: vLLM ranks its workers from one offset, but "
                             f"this engine's channel ranks are {list(ranks)}")
        end = WeightChannel.connect(addr, int(port), first, int(world_size), float(timeout_s))
        rx = cls(channel, end, len(ranks), end.lanes())
        for k in range(rx.lanes):
            end.pass_gate(lane_prefix(channel, k), count=len(ranks))
            keys = lane_store(end.store, channel, k)
            keys.wait(["init"], end.timeout)
            payload = {**json.loads(keys.get("init").decode()), "rank_offset": first, "lane": k}
            llm.init_weight_transfer_engine({"init_info": payload})
        return rx

    def recv(self, llm: Any) -> list[dict]:
        """Take one sync (every lane) through vLLM's API; figures per receiver. All or nothing: when
        a lane's source failed before sending, the other lanes are received and dropped (their
        sources are in NCCL broadcasts and must not hang) and the engine keeps its previous weights
        whole; the source's error is raised at the end."""
        from .vllm_trainer import lane_store

        infos = []
        for k in range(self.lanes):  # the sources may still be busy with earlier calls: the peer wait
            keys = lane_store(self.end.store, self.channel, k)
            keys.wait([f"update/{self.syncs}"], timedelta(seconds=PEER_WAIT_S))
            infos.append(json.loads(keys.get(f"update/{self.syncs}").decode()))
        self.syncs += 1
        start = time.perf_counter()
        llm.start_weight_update()
        failed = [info["error"] for info in infos if "error" in info]
        for k, info in enumerate(infos):
            if "error" not in info:
                llm.update_weights({"update_info": {**info, "lane": k, "drop": bool(failed)}})
        llm.finish_weight_update()  # nothing loaded (dropped): every layer keeps its tensors (WholeOrNothingReload)
        seconds = time.perf_counter() - start
        if failed:
            raise SourceFailed(f"weight sync: the source failed: {failed[0]}")
        sent = [i for i in infos if "error" not in i]
        nbytes = sum(_dtype(d).itemsize * int(torch.Size(s).numel())
                     for i in sent for d, s in zip(i["dtype_names"], i["shapes"], strict=True))
        figures = {"tensors": sum(len(i["names"]) for i in sent), "bytes": nbytes, "buckets": 0,
                   "seconds": seconds, "backend": "vllm_nccl", "receivers": self.end.world_size - 1,
                   "lanes": self.lanes}
        return [{**figures, "sent_bytes": {}} for _ in range(self.receivers)]

    def close(self) -> None:
        """Leave the channel's store (the engine's communicators: ``shutdown_weight_transfer_engine``)."""
        self.end.close()


def register() -> str:
    """Register twinkle_ray's engines with vLLM (once per process): :class:`TwinkleWeightTransferEngine`
    (CPU) and :class:`LaneNCCLWeightTransferEngine` (CUDA); returns the CPU one's backend name."""
    for name, cls in [(BACKEND, TwinkleWeightTransferEngine), (CUDA_BACKEND, LaneNCCLWeightTransferEngine)]:
        try:
            WeightTransferEngineFactory.register_engine(name, cls)
        except ValueError:  # registered already in this process
            pass
    return BACKEND


def transfer_config(device_type: str) -> WeightTransferConfig:
    """The engine's ``weight_transfer_config``: ours on CPU, vLLM's NCCL engine per lane on CUDA."""
    register()
    return WeightTransferConfig(backend=BACKEND if device_type == "cpu" else CUDA_BACKEND)


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
