"""The trainer side of a weight sync into vLLM engines on CUDA: vLLM's own NCCL trainer engine per lane.

When every receiver of a sync is a vLLM engine on CUDA (its probe says ``transfer: vllm_nccl``), the
set-up's backend is :data:`~twinkle_ray.weights.VLLM_NCCL` and each lane's source (the trainer's
rank 0, or the first TP rank of each pipeline stage) opens vLLM's NCCL trainer endpoint
(``NCCLTrainerWeightTransferEngine.trainer_init``: rank 0 of that lane's NCCL group, the engines'
workers at the channel ranks the driver gave them) and sends its lane's tensors with vLLM's
``send_weights`` (packed NCCL broadcast). The receiving side is
:class:`twinkle_ray.integrations.vllm_engine.NcclReceivers`.

vLLM's trainer engine drives the inference side through a client (``VLLMWeightSyncClient``). Here
the driver calls both gangs in their own call order, so the client (:class:`StoreClient`) only
*publishes*: the worker init info and each sync's update info (names, dtypes, shapes) go into the
channel's ``TCPStore`` under the lane's prefix, where the receivers read them; the receivers run
``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` themselves. A source whose
``weight_sync_tensors()`` raised publishes an error instead of an update info: the receivers raise it.

Not run here (no GPU): written to vLLM 0.32's API; the tests replace NCCL with recording fakes.

>>> # ch = WeightChannel.host(world_size=3)                 # the channel's store, as today
>>> # src = VLLMNcclSource(ch, "ws-1", lane=0)              # vLLM's trainer endpoint for lane 0
>>> # stats = src.send(model.state_dict().items())          # the receivers take it meanwhile
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
)
from vllm.utils.network_utils import get_open_port

from ..weight_channel import (
    SyncStats,
    WeightChannel,
    _check_names,
    _dtype,
    _node_ip,
    _spec,
    fingerprint,
    lane_prefix,
)

logger = logging.getLogger(__name__)

__all__ = ["LaneSource", "StoreClient", "VLLMNcclSource", "lane_store"]


def lane_store(store: Any, channel: str, lane: int) -> Any:
    """The keys of ``channel``'s lane ``lane`` that vLLM's NCCL path uses (init info, update infos)."""
    import torch.distributed as dist

    return dist.PrefixStore(lane_prefix(channel, lane) + "/vllm", store)


class StoreClient:
    """A ``VLLMWeightSyncClient`` that publishes into the channel's store (one lane) instead of calling
    the engines: the receivers' gang reads it and drives vLLM's API itself, in its own call order.

    Keys: ``init`` (the worker init info, once per set-up), ``update/<n>`` (sync n's update info, or
    ``{"error": ...}`` when the source failed before sending).
    """

    def __init__(self, store: Any, channel: str, lane: int):
        self.store = lane_store(store, channel, lane)
        self.syncs = 0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.store.set("init", json.dumps(init_info))

    def start_weight_update(self) -> None:
        """Nothing: every receiver starts its own update when its gang reaches the sync."""

    def update_weights(self, update_info: Any) -> None:
        self.store.set(f"update/{self.syncs}", json.dumps(update_info))
        self.syncs += 1

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Nothing: every receiver finishes its own update once it has taken every lane."""

    def fail(self, message: str) -> None:
        """This sync ends with ``message`` on every receiver; the lane stays in step."""
        self.store.set(f"update/{self.syncs}", json.dumps({"error": message}))
        self.syncs += 1


class LaneSource(WeightSource):
    """vLLM's ``WeightSource`` over one sync's tensors of one lane (set per sync by :meth:`VLLMNcclSource.send`).

    ``metadata()`` declares exactly what iteration yields; a lazy source (``TensorSource``) is
    iterated to its end whatever is selected (its materialisation may be a collective).
    """

    def __init__(self) -> None:
        self.specs: list[tuple[str, str, tuple[int, ...]]] = []
        self._produce: Any = lambda: iter(())

    def set(self, specs: list[tuple[str, str, tuple[int, ...]]], produce: Any) -> None:
        self.specs, self._produce = specs, produce

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, _dtype(d), tuple(s)) for n, d, s in self.specs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._produce())


class VLLMNcclSource:
    """One lane's source of a weight sync into vLLM engines: vLLM's NCCL trainer endpoint.

    ``host``: this process's end of the channel (lane 0: the hosted store; another lane: connected to
    it). Opening the endpoint is a rendezvous: every receiver joins concurrently
    (:class:`~twinkle_ray.integrations.vllm_engine.NcclReceivers`). Quacks like a joined
    :class:`~twinkle_ray.weight_channel.WeightChannel` for :class:`~twinkle_ray.weights.WeightSyncMixin`
    (``pg``, ``send``, ``fail``, ``close``).
    """

    def __init__(self, host: WeightChannel, channel: str, lane: int, packed: bool = True):
        self.host, self.channel, self.lane = host, channel, lane
        self.rank, self.world_size = 0, host.world_size
        self.client = StoreClient(host.store, channel, lane)
        self.source = LaneSource()
        self.sent: dict[str, tuple[int, int]] = {}
        self.tracking = False
        info = NCCLTrainerInitInfo(master_address=_node_ip(), master_port=get_open_port(),
                                   world_size=host.world_size, rank=0, packed=packed)
        self.init_info = info
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=self.client, source=self.source)

    @property
    def pg(self) -> Any:
        """The lane's NCCL communicator (None once closed)."""
        return None if self.engine is None else self.engine.model_update_group

    def send(self, named_tensors: Any, *, names: Sequence[str] | None = None, only_changed: bool = False,
             bucket_mb: float = 0.0) -> SyncStats:
        """Send one sync with vLLM's ``send_weights`` (``bucket_mb``: vLLM's packed buffers size the
        transfer instead). ``names`` / ``only_changed`` select as on twinkle_ray's channel."""
        t0 = time.perf_counter()
        lazy = hasattr(named_tensors, "metadata") and not (only_changed or self.tracking)
        try:
            if lazy:
                specs = [_spec(m) for m in named_tensors.metadata()]
                wanted = _check_names([s[0] for s in specs], names)
                specs = [s for s in specs if wanted is None or s[0] in wanted]

                def produce(src: Any = named_tensors) -> Iterator:
                    for n, t in src:  # every tensor is materialised (a collective), the selected sent
                        if wanted is None or n in wanted:
                            yield n, t
                prints: dict = {}
            else:
                items = list(named_tensors)
                wanted = _check_names([n for n, _ in items], names)
                items = [(n, t) for n, t in items if wanted is None or n in wanted]
                self.tracking = self.tracking or only_changed
                prints = {n: fingerprint(t) for n, t in items} if self.tracking else {}
                if only_changed:
                    items = [(n, t) for n, t in items if self.sent.get(n) != prints[n]]
                specs = [(n, str(t.dtype), tuple(t.shape)) for n, t in items]

                def produce(items: list = items) -> Iterator:
                    return iter(items)
        except Exception as e:
            self.fail(f"{type(e).__name__}: {e}")
            raise
        self.source.set(specs, produce)
        prepare_s = time.perf_counter() - t0
        start = time.perf_counter()
        self.engine.send_weights()  # publishes the update info (StoreClient), then broadcasts
        self.sent.update(prints)
        nbytes = sum(_dtype(d).itemsize * int(torch.Size(s).numel()) for _, d, s in specs)
        return SyncStats(tensors=len(specs), bytes=nbytes, buckets=0, seconds=time.perf_counter() - start,
                         prepare_s=prepare_s, names=[s[0] for s in specs], backend="vllm_nccl",
                         receivers=self.world_size - 1)

    def fail(self, message: str) -> None:
        """End this sync with ``message`` on every receiver (nothing was broadcast)."""
        self.client.fail(message)

    def close(self) -> None:
        """Leave the lane's NCCL group and the channel's store (best effort)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # already broken: dropping it is enough
                logger.debug("weight sync %s: vLLM trainer endpoint shutdown failed", self.channel, exc_info=True)
        self.host.close()
