"""The CUDA weight sync into vLLM engines, on vLLM's own NCCL API, with NCCL replaced by recording fakes.

No GPU here: vLLM's rendezvous (``stateless_init_process_group``) and its packed NCCL broadcast are
replaced, in this test only, by fakes that record what they were given and hand the tensors over in
memory. Everything else is the code that runs on CUDA: each lane's source opens vLLM's
``NCCLTrainerWeightTransferEngine`` (:mod:`twinkle_ray.integrations.vllm_trainer`), each engine's
receivers drive ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` (:class:`~twinkle_ray.integrations.vllm_engine.NcclReceivers`) into vLLM's
``NCCLWeightTransferEngine`` with a communicator per lane (``LaneNCCLWeightTransferEngine``).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from conftest import concurrently  # noqa: E402
from twinkle_ray.weights import VLLM_NCCL, choose_backend  # noqa: E402

LANES = {0: ["embed.weight", "layers.0.weight"], 1: ["layers.1.weight", "head.weight"]}


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"embed.weight": torch.randn(6, 4, generator=g),
            "layers.0.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),
            "layers.1.weight": torch.randn(4, 4, generator=g),
            "head.weight": torch.randn(3, 4, generator=g).to(torch.bfloat16)}


class Wire:
    """The fake NCCL: communicators by rendezvous address, and what each broadcast carried."""

    def __init__(self):
        self.comms: list[dict] = []
        self.sent: dict[tuple, list] = {}  # (addr, port) -> one list of (name, tensor) per broadcast round
        self.cond = threading.Condition()

    def group(self, master_address, master_port, rank, world_size, device):
        comm = SimpleNamespace(key=(master_address, master_port), rank=rank, world_size=world_size,
                               rounds=0, destroyed=False)
        comm.destroy = lambda: setattr(comm, "destroyed", True)
        with self.cond:
            self.comms.append({"addr": master_address, "port": master_port, "rank": rank,
                               "world_size": world_size, "comm": comm})
        return comm

    def produce(self, iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers):
        assert src == 0 and group.rank == 0
        out = [(name, post_iter_func((name, t)).clone()) for name, t in iterator]
        with self.cond:
            self.sent.setdefault(group.key, []).append(out)
            self.cond.notify_all()

    def consume(self, iterator, group, src, post_unpack_func, buffer_size_bytes, num_buffers, device):
        expected = list(iterator)  # (name, (shape, dtype)), as vLLM builds it from the update info
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.sent.get(group.key, [])) > group.rounds, timeout=20)
            got = self.sent[group.key][group.rounds]
        group.rounds += 1
        assert [(n, list(t.shape), t.dtype) for n, t in got] == [(n, list(s), d) for n, (s, d) in expected]
        post_unpack_func(got)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, items):
        self.loaded.update((n, t.clone()) for n, t in items)


class FakeLLM:
    """``vllm.LLM``'s weight-transfer API over real engines, one per TP worker (what its workers do)."""

    def __init__(self, tp: int, log: list):
        from twinkle_ray.integrations.vllm_engine import LaneNCCLWeightTransferEngine

        def config(rank):
            return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=tp, rank=rank),
                                   model_config=None)

        self.engines = [LaneNCCLWeightTransferEngine(None, config(r), torch.device("cpu"), Model())
                        for r in range(tp)]
        self.log = log

    def init_weight_transfer_engine(self, request):
        info = request["init_info"]
        self.log.append(("init", info["lane"]))
        for e in self.engines:
            e.init_transfer_engine(e.parse_init_info(info))

    def start_weight_update(self):
        self.log.append(("start",))
        for e in self.engines:
            e.start_weight_update()

    def update_weights(self, request):
        self.log.append(("update", request["update_info"]["lane"], request["update_info"]))
        for e in self.engines:
            e.update_weights(request["update_info"])

    def finish_weight_update(self):
        self.log.append(("finish",))
        for e in self.engines:
            e.finish_weight_update()


@pytest.fixture
def wire(monkeypatch):
    from vllm.distributed.weight_transfer import nccl_common, nccl_engine
    from vllm.model_executor.model_loader import reload

    w = Wire()
    monkeypatch.setattr(nccl_common, "stateless_init_process_group", w.group)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", w.produce)
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_consumer", w.consume)
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: None)
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, config: None)
    return w


def test_lanes_open_vllms_trainer_endpoint_and_engines_receive_through_vllms_api(wire):
    from twinkle_ray.integrations.vllm_engine import NcclReceivers
    from twinkle_ray.integrations.vllm_trainer import VLLMNcclSource
    from twinkle_ray.weight_channel import WeightChannel

    state = model_state()
    world = 4  # the source of each lane + engine A (TP=2: channel ranks 1, 2) + engine B (rank 3)
    host = WeightChannel.host(world, 30, host_ip="127.0.0.1", lanes=2)
    addr, port = host.address
    other = WeightChannel.connect(addr, port, 0, world, 30)
    logs: dict = {"A": [], "B": []}
    llms = {"A": FakeLLM(2, logs["A"]), "B": FakeLLM(1, logs["B"])}
    ranks = {"A": [[0, 1], [1, 2]], "B": [[0, 3]]}
    joined = concurrently(lambda: VLLMNcclSource(host, "ws-t", 0), lambda: VLLMNcclSource(other, "ws-t", 1),
                  *[lambda k=k: NcclReceivers.join(llms[k], "ws-t", addr, port, ranks[k], world, 30) for k in "AB"])
    assert not [j for j in joined if isinstance(j, Exception)], joined
    sources, rx = joined[:2], dict(zip("AB", joined[2:], strict=True))

    # Each lane's source opened vLLM's trainer endpoint: rank 0 of a group of its own, at its own port.
    trainer_info = [s.init_info for s in sources]
    assert [(i.rank, i.world_size, i.master_address, i.packed) for i in trainer_info] == [(0, 4, "127.0.0.1", True)] * 2
    assert trainer_info[0].master_port != trainer_info[1].master_port
    # Every vLLM worker joined both lanes' groups at its channel rank (rank_offset + its TP rank).
    for lane, info in enumerate(trainer_info):
        joins = sorted((c["rank"], c["world_size"]) for c in wire.comms
                       if (c["addr"], c["port"]) == (info.master_address, info.master_port))
        assert joins == [(0, 4), (1, 4), (2, 4), (3, 4)], (lane, joins)
    assert all(sorted(e.lanes) == [0, 1] for llm in llms.values() for e in llm.engines)
    assert all(e.packed for llm in llms.values() for e in llm.engines)  # the trainer's wire params

    # One sync: each lane sends its own tensors with vLLM's send_weights, every engine takes both.
    stats = concurrently(*[lambda k=k: sources[k].send([(n, state[n]) for n in LANES[k]]) for k in (0, 1)],
                 *[lambda k=k: rx[k].recv(llms[k]) for k in "AB"])
    assert not [s for s in stats if isinstance(s, Exception)], stats
    assert [(s.tensors, s.bytes, s.backend, s.receivers) for s in stats[:2]] == [
        (2, 6 * 4 * 4 + 16 * 2, VLLM_NCCL, 3), (2, 16 * 4 + 12 * 2, VLLM_NCCL, 3)]
    assert [len(stats[2]), len(stats[3])] == [2, 1]  # figures per receiver (TP worker)
    assert stats[2][0]["tensors"] == 4 and stats[2][0]["lanes"] == 2
    for k in "AB":
        order = [entry[:2] for entry in logs[k]]
        assert order == [("init", 0), ("init", 1), ("start",), ("update", 0), ("update", 1), ("finish",)]
        updates = [entry[2] for entry in logs[k] if entry[0] == "update"]
        assert [u["names"] for u in updates] == [LANES[0], LANES[1]]
        assert [u["dtype_names"] for u in updates] == [["float32", "bfloat16"], ["float32", "bfloat16"]]
        assert [u["shapes"] for u in updates] == [[[6, 4], [4, 4]], [[4, 4], [3, 4]]]
        for e in llms[k].engines:  # every TP worker loaded every tensor, bit for bit
            assert e.model.loaded.keys() == state.keys()
            assert all(torch.equal(e.model.loaded[n], state[n]) for n in state)

    # A source that failed before sending: the receivers raise its message and keep their previous
    # weights whole: the other lane is received (its source is in an NCCL broadcast) and dropped.
    for llm in llms.values():
        for e in llm.engines:
            e.model.loaded.clear()
    out = concurrently(lambda: sources[0].send([(n, state[n]) for n in LANES[0]], names=["layers.0.weight"]),
               lambda: sources[1].fail("weight_sync_tensors() raised KeyError: 'x'"),
               *[lambda k=k: rx[k].recv(llms[k]) for k in "AB"])
    assert out[0].names == ["layers.0.weight"]
    assert all(isinstance(o, RuntimeError) and "KeyError: 'x'" in str(o) for o in out[2:]), out
    for k in "AB":
        assert [entry[:2] for entry in logs[k][6:]] == [("start",), ("update", 0), ("finish",)]
        assert logs[k][7][2]["drop"] is True
        assert all(e.model.loaded == {} for e in llms[k].engines)
    # the lanes are still in step: the next sync arrives whole
    stats = concurrently(*[lambda k=k: sources[k].send([(n, state[n]) for n in LANES[k]]) for k in (0, 1)],
                         *[lambda k=k: rx[k].recv(llms[k]) for k in "AB"])
    assert not [s for s in stats if isinstance(s, Exception)], stats
    assert all(e.model.loaded.keys() == state.keys() for llm in llms.values() for e in llm.engines)

    for s in sources:
        s.close()
    for llm in llms.values():
        for e in llm.engines:
            groups = list(e.lanes.values())
            e.shutdown()
            assert groups and all(g.destroyed for g in groups) and not e.lanes
    for k in "AB":
        rx[k].close()


def test_the_backend_is_vllms_nccl_when_every_receiver_is_a_vllm_engine_on_cuda():
    engine = {"cuda": True, "transfer": VLLM_NCCL}
    assert choose_backend(None, [{"cuda": True}], [[engine, engine]]) == VLLM_NCCL
    assert choose_backend(None, [{"cuda": True}], [[{"cuda": True}]]) == "nccl"
    assert choose_backend(None, [{"cuda": False}], [[{"cuda": True}]]) == "gloo"
    assert choose_backend("gloo", [{"cuda": True}], [[{"cuda": True}]]) == "gloo"
    with pytest.raises(ValueError, match="1 of 2 receivers take weights only through vLLM's NCCL engine"):
        choose_backend(None, [{"cuda": True}], [[engine], [{"cuda": True}]])


def test_cuda_engines_are_built_with_the_lane_nccl_engine():
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from twinkle_ray.integrations.vllm_engine import (
        CUDA_BACKEND,
        LaneNCCLWeightTransferEngine,
        transfer_config,
    )

    assert transfer_config("cuda").backend == CUDA_BACKEND
    assert transfer_config("cpu").backend == "twinkle_gloo"
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                  model_config=None)
    engine = WeightTransferEngineFactory.create_engine(transfer_config("cuda"), vllm_config, torch.device("cpu"),
                                                       Model())
    assert type(engine) is LaneNCCLWeightTransferEngine and isinstance(engine, NCCLWeightTransferEngine)
