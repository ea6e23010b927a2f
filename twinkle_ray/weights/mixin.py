"""The worker side: :class:`WeightSyncMixin`, mixed into a trainer and a sampler remote class.

Over 400 lines, and owed a split: the worker-side hooks and the channel's operations (probe,
plan, join, send, recv, close) sit together because both are methods of the user's class; the
operations could move to a second mixin.

Trainer (source) hooks: ``weight_sync_shards()`` (the slabs this rank holds: by default its
model's state dict, a DTensor as its local rows) and ``weight_sync_replica()`` (which data-parallel
copy this rank belongs to). A class that overrides the older ``weight_sync_tensors()`` (full tensors
on the ranks ``weight_sync_lane()`` names) is served from those instead: full tensors of each lane,
logged as the ``gathered-source`` path.

Sampler (receiver) hooks, from the outside in: ``weight_sync_fanout(op, *args)`` (reaches every
receiver of the worker: itself by default, each vLLM worker through ``collective_rpc``),
``weight_sync_wants()`` (what it keeps), ``weight_sync_receive(buckets)``, ``weight_sync_targets()``
and ``weight_sync_load(items)`` (where tensors land).

>>> class Box(WeightSyncMixin):
...     def __init__(self, value):
...         import torch
...         self.model = torch.nn.Linear(2, 2)
...         torch.nn.init.constant_(self.model.weight, value)
>>> from twinkle_ray.weights import sync_weights
>>> a, b = Box(1.0), Box(0.0)
>>> sync_weights(a, b).tensors           # in-process objects: a plain copy
2
>>> bool((b.model.weight == 1.0).all())
True
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

from ..core.context import get_rank
from ..core.functions import RemoteFunction, remote_function
from .fingerprint import fingerprint
from .layout import Slab, TensorSource, Want, is_dtensor, module_slabs, module_wants, unwrap
from .plan import build_plan
from .receiver import ReceiverEnd, load_into, refuse_receivers
from .sender import SourceEnd
from .transport import (
    DEFAULT_BUCKET_MB,
    SetupRefused,
    SourceFailed,
    SyncStats,
    bytes_written,
    choose_backend,
    node_ip,
)

logger = logging.getLogger(__name__)

__all__ = ["WeightSyncMixin"]

def _gathered(module: Any) -> dict[str, Any]:
    """Full tensors of a module: a plain one's on every rank; a sharded one's (DTensors) gathered to
    rank 0, ``{}`` elsewhere (a collective every rank joins)."""
    import torch

    state = unwrap(module).state_dict(keep_vars=False)
    if not any(is_dtensor(t) for t in state.values()):
        return dict(state)  # nothing sharded: every rank has the full tensors
    keep = get_rank() == 0
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, t in state.items():
            full = t.full_tensor() if is_dtensor(t) else t
            if keep:
                out[name] = full.detach()
    return out


def _world() -> tuple[Any, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_world_size()
    return dist, 1


def _all_gather(value: Any) -> list:
    dist, n = _world()
    if n <= 1:
        return [value]
    out = [None] * n
    dist.all_gather_object(out, value)
    return out


class WeightSyncMixin:
    """Weight-sync endpoints for a remote class (trainer or sampler); see the module docstring."""

    # -- source hooks ---------------------------------------------------------------------------
    def weight_sync_shards(self) -> list[Slab]:
        """The slabs this rank holds (called on every rank of the trainer, at set-up and each sync).

        Default: ``self.model``'s state dict; a DTensor (FSDP2 / tensor parallel) gives its local
        rows. A class that overrides the older ``weight_sync_tensors()`` is served from it (full
        tensors of each lane: the ``gathered-source`` path, logged). Override for a layout of your own -- a Megatron rank returns its TP shards under the
        receivers' names, fused QKV / gate-up split with :func:`~twinkle_ray.weights.fused_slabs`::

            def weight_sync_shards(self):
                return [Slab("lm_head.weight", self.head_shard, (vocab, hidden), 0, self.tp_rank * rows)]
        """
        if type(self).weight_sync_tensors is not WeightSyncMixin.weight_sync_tensors:
            return self._weight_sync_gathered()  # a class still written to the older hook
        model = getattr(self, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            raise NotImplementedError(f"{type(self).__name__}: set self.model to a torch module or override "
                                      f"weight_sync_shards() to return the slabs this rank holds")
        return module_slabs(model)

    def weight_sync_replica(self) -> int:
        """Which data-parallel copy of the weights this rank belongs to (ranks of one replica hold
        disjoint slabs). Default: a model with DTensor shards is one replica (0); a plain model is a
        full copy on every rank (its gang rank). A TP x PP x DP trainer returns its dp rank."""
        model = getattr(self, "model", None)
        if model is not None and hasattr(model, "state_dict"):
            if any(is_dtensor(t) for t in unwrap(model).state_dict().values()):
                return 0
        return get_rank()

    def weight_sync_lane(self) -> tuple[int | None, int]:
        """Older hook, for ``weight_sync_tensors()`` overrides: (this rank's lane or None, lanes);
        rank 0 alone by default."""
        return (0 if get_rank() == 0 else None), 1

    def weight_sync_tensors(self) -> dict[str, Any] | TensorSource:
        """Full tensors, gathered to rank 0 (a collective every rank joins; other ranks ``{}``).

        Not the sync's path (it sends each rank's own slabs): for checks and for classes that
        still override it (served as full tensors from their lanes, logged ``gathered-source``).
        """
        model = getattr(self, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            raise NotImplementedError(f"{type(self).__name__}: set self.model or override weight_sync_tensors()")
        return _gathered(model)

    def _weight_sync_gathered(self) -> list[Slab]:
        """The older path: full tensors from ``weight_sync_tensors()`` on the ranks ``weight_sync_lane()``
        names (every rank calls it: it may be a collective; a lazy source is iterated in step)."""
        self.__dict__["_twinkle_ws_path"] = "gathered-source"
        lane, _ = self.weight_sync_lane()
        tensors = self.weight_sync_tensors()
        items = list(tensors) if hasattr(tensors, "metadata") else list(tensors.items())
        return [Slab(n, t.detach()) for n, t in items] if lane is not None else []

    def _weight_sync_slabs(self) -> tuple[list[Slab], str]:
        """(slabs, path): this rank's slabs and which path served them."""
        self.__dict__["_twinkle_ws_path"] = "resharded"
        slabs = list(self.weight_sync_shards())
        return slabs, self.__dict__.pop("_twinkle_ws_path", "resharded")

    # -- receiver hooks -------------------------------------------------------------------------
    def weight_sync_fanout(self, op: str, *args: Any) -> list:
        """Run receiver operation ``op`` (see :class:`ReceiverEnd`) on every receiver of this worker.

        Default: this worker is the one receiver. A worker whose engine has processes of its own
        forwards to each (``self.llm.collective_rpc(...)``), each holding a :class:`ReceiverEnd`.
        """
        end = self.__dict__.get("_twinkle_receiver")
        if end is None:
            end = self.__dict__["_twinkle_receiver"] = ReceiverEnd(self.weight_sync_receive,
                                                                   wants=self.weight_sync_wants)
        return [end.call(op, *args)]

    def weight_sync_wants(self) -> list[Want] | None:
        """What this receiver keeps: a list of :class:`Want` (full tensors, or its rows of a sharded
        one), or None for every tensor the trainer has, whole. Default: the tensors of
        ``weight_sync_targets()`` (a DTensor: its local rows); None when there is no model."""
        try:
            targets = self.weight_sync_targets()
        except NotImplementedError:
            return None
        if not isinstance(targets, dict):
            return None
        if getattr(self, "model", None) is not None and hasattr(self.model, "state_dict") \
                and type(self).weight_sync_targets is WeightSyncMixin.weight_sync_targets:
            return module_wants(self.model)[0]
        return [Want(n, tuple(t.shape), str(t.dtype)) for n, t in targets.items()]

    def weight_sync_receive(self, buckets: Iterator[list[tuple[str, Any]]]) -> None:
        """Take one sync: resolve the targets once, then ``weight_sync_load`` every bucket; a bucket
        that fails does not stop the others (the first failure is raised at the end)."""
        self.__dict__["_twinkle_sync_targets"] = self.weight_sync_targets()
        failure: BaseException | None = None
        try:
            for items in buckets:
                try:
                    self.weight_sync_load(items)
                except Exception as e:  # keep receiving: the senders must not hang
                    failure = failure or e
        finally:
            self.__dict__.pop("_twinkle_sync_targets", None)
        if failure is not None:
            raise failure

    def weight_sync_targets(self) -> dict[str, Any]:
        """name -> tensor that received weights are copied into (``self.model``'s own parameters and
        buffers; a DTensor's local shard)."""
        model = getattr(self, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            raise NotImplementedError(f"{type(self).__name__}: set self.model to a torch module or override "
                                      f"weight_sync_targets() (or weight_sync_receive) to say where weights go")
        return dict(unwrap(model).state_dict(keep_vars=True))

    def weight_sync_load(self, items: list[tuple[str, Any]]) -> None:
        """Take one bucket of received (name, tensor); default: copy into this sync's targets."""
        targets = self.__dict__.get("_twinkle_sync_targets")
        problems = load_into(self.weight_sync_targets() if targets is None else targets, items)
        if problems:
            raise ValueError("weight sync: received tensors did not fit: " + "; ".join(problems[:5])
                             + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))

    # -- this worker's ends ---------------------------------------------------------------------
    def _ws_state(self) -> dict:
        return self.__dict__.setdefault("_twinkle_ws", {"sources": {}, "plans": {}, "tracking": set(),
                                                        "names": {}, "joined": {}, "metas": {}})

    # -- remote endpoints (called by WeightSync) ------------------------------------------------
    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_probe(self, role: str = "target", channel: str | None = None,
                          timeout_s: float = 300.0) -> list[dict]:
        """Facts for the plan. Source: this rank's slabs, replica and endpoint (hosted once per
        channel, on ranks that hold slabs). Target: one dict per receiver of this worker."""
        import torch

        if role != "source":  # a receiver without an id of its own (a sampler's own probe) gets this worker's
            me = f"{os.getpid()}x{id(self):x}"
            return [{"wants": None, **f, "uid": f.get("uid") or f"{me}-{f.get('index', 0)}", "rank": get_rank()}
                    for f in self.weight_sync_fanout("probe")]
        slabs, path = self._weight_sync_slabs()
        state = self._ws_state()
        end = state["sources"].get(channel)
        if slabs and end is None:
            end = state["sources"][channel] = SourceEnd(channel, timeout_s)
        state["metas"][channel] = [s.meta() for s in slabs]  # what the plan is made of: checked each sync
        addr, port = end.endpoint.address if end is not None else (node_ip(), 0)
        replica = 0 if path == "gathered-source" else int(self.weight_sync_replica())
        return [{"rank": get_rank(), "replica": replica, "slabs": [s.meta() for s in slabs], "addr": addr,
                 "port": port, "cuda": bool(torch.cuda.is_available()), "path": path}]

    @remote_function(dispatch="all", execute="first", collect="first")
    def weight_sync_plan(self, channel: str, backend: str | None, timeout_s: float, source: list[dict],
                         *targets: list[dict]) -> dict:
        """Trainer rank 0: the plan from every end's probe (computed once per layouts, then replayed)."""
        cache = self._ws_state()["plans"].setdefault(channel, {})
        holders = [s for s in source if s["slabs"]]
        plan = build_plan(holders, [list(t) for t in targets], cache)
        # this set-up's own id: its hellos and refusals are not read by a later set-up of the same pairs
        plan = {**plan, "attempt": uuid.uuid4().hex[:12]}
        plan["names"] = sorted({m[0] for s in holders for m in s["slabs"]})
        path = source[0]["path"] if source else "resharded"
        logger.info("weight sync %s: %s plan %s (%s) for %d trainer rank(s) in %d replica(s) -> %d receiver(s), "
                    "%d pair(s)", channel, path, plan["key"], "replayed" if plan["replayed"] else "computed",
                    len(holders), len({s["replica"] for s in holders}), len(plan["receivers"]), len(plan["pairs"]))
        return {"plan": plan, "backend": choose_backend(backend, source, list(targets)), "timeout_s": timeout_s,
                "path": path}

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_join(self, channel: str, setup: dict, role: str, gang: int = 0) -> list[int]:
        """Bring this worker's pairs in line with the plan (keep, open, close); how many it opened."""
        if role == "source":
            state = self._ws_state()
            state["names"][channel] = set(setup["plan"]["names"])
            state["joined"][channel] = None  # the next send checks every rank joined (all or nothing)
            end = state["sources"].get(channel)
            if end is None:
                return []
            try:
                before = end.opened
                end.join(setup["plan"], get_rank(), setup["backend"])
                return [end.opened - before]
            except BaseException as e:
                state["joined"][channel] = f"trainer rank {get_rank()}: {type(e).__name__}: {e}"
                if not isinstance(e, SetupRefused):
                    end.refuse(setup["plan"], get_rank(), f"{type(self).__name__} rank {get_rank()}: {e}")
                raise
        try:
            setup = {**setup, "gang": gang, "rank": get_rank()}  # receivers find their place by it
            return [int(x) for x in self.weight_sync_fanout("join", channel, setup)]
        except SetupRefused:
            raise
        except Exception as e:
            refuse_receivers(setup, gang, get_rank(), f"{type(self).__name__}.weight_sync_join on rank "
                                                      f"{get_rank()}: {type(e).__name__}: {e}")
            raise

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_send(self, channel: str, names: list[str] | None = None, only_changed: bool = False,
                         bucket_mb: float = DEFAULT_BUCKET_MB, reset: bool = False) -> list[SyncStats]:
        """Every trainer rank sends its own pieces to its pairs; gang rank 0 returns the merged figures.
        ``reset``: forget what each receiver was last sent (after a failed sync)."""
        w0 = bytes_written()
        state = self._ws_state()
        end = state["sources"].get(channel)
        if reset and end is not None:
            end.forget()
        figures: dict | None = None
        error: BaseException | None = None
        path = "resharded"
        try:
            if channel in state["joined"]:  # a set-up ran before this send: did every rank join?
                refused = [x for x in _all_gather(state["joined"].pop(channel)) if x]
                if refused:
                    raise SetupRefused(f"weight sync: the set-up failed ({refused[0]}); nothing was sent")
            known = state["names"].get(channel)
            if names is not None and known is not None:
                missing = [n for n in names if n not in known]
                if missing:
                    raise ValueError(f"weight sync: unknown tensor name(s) {missing[:5]} (of {len(missing)}) "
                                     f"in names=: the trainer has no such tensor; nothing was sent")
            slabs, path = self._weight_sync_slabs()
            planned = state["metas"].get(channel)
            now = [x.meta() for x in slabs]
            if planned is not None and now != planned:
                old, new = {m[0] for m in planned}, {m[0] for m in now}
                raise ValueError(f"weight sync: the tensors of trainer rank {get_rank()} changed since the plan "
                                 f"(new: {sorted(new - old)[:5]}, gone: {sorted(old - new)[:5]}, or other "
                                 f"shapes/dtypes); nothing was sent, the next sync makes a new plan")
        except Exception as e:
            error = e
        # Bookkeeping by what was really sent: once only_changed was asked for on this channel, every
        # sync fingerprints the slabs it may send and each pair records, per slab, the fingerprint
        # its receiver last got. only_changed sends a tensor to a receiver when any rank finds it
        # stale there (gathered: every rank sends its pieces of the same tensors, never a part).
        tracking = only_changed or channel in state["tracking"]
        prints: list | None = None
        chosen: dict | None = None
        t0 = time.perf_counter()
        if tracking:
            state["tracking"].add(channel)
            if error is None:
                prints = [fingerprint(s.tensor) if names is None or s.name in names else None for s in slabs]
        if only_changed:  # every rank in step: the decision per tensor and receiver is the same on all
            mine = end.stale(slabs, prints, names) if error is None and end is not None else {}
            chosen = {}
            for part in _all_gather(mine):
                for uid, stale in part.items():
                    chosen.setdefault(uid, set()).update(stale)
        prepare_s = time.perf_counter() - t0
        # Past the trainer's own collectives: a failed rank tells its receivers now (its error
        # header waits for each receiver to take it; told before the gather above, a receiver
        # reading another rank's pair first would leave that rank, and so this one, waiting).
        if error is not None and end is not None:
            end.fail(f"{type(self).__name__} rank {get_rank()}: {type(error).__name__}: {error}")
        if error is None and end is not None:
            try:
                figures = end.send(slabs, set(names) if names is not None else None, prints, chosen,
                                   int(bucket_mb * 2**20))
                figures["prepare_s"] = prepare_s
            except Exception as e:  # raised after the figures are exchanged: no rank left in a collective
                error = e
        parts = _all_gather((get_rank(), figures, bytes_written() - w0, path, error is not None))
        if end is not None and any(p[4] for p in parts):
            # a rank failed: each receiver it serves took none of this sync (taken whole or not at
            # all), the other ranks' pieces drained unloaded: what they hold is unknown here, so the
            # next sync (maybe made before anyone read this one's error) sends them everything
            end.forget()
        if error is not None:
            raise error
        if get_rank() != 0:
            return []
        sent = [(r, f) for r, f, *_ in parts if f is not None]
        why = ("plain" if names is None and not only_changed else
               ", ".join(([f"names={sorted(names)[:8]}"] if names is not None else [])
                         + (["only_changed"] if only_changed else [])))
        sent_names = sorted({n for _, f in sent for n in f["names"]})
        logger.info("weight sync %s: sent %d tensor(s) (%s): %s%s", channel, len(sent_names), why,
                    sent_names[:20], " ..." if len(sent_names) > 20 else "")
        if chosen is not None:
            for uid, stale in sorted(chosen.items()):
                logger.debug("weight sync %s: receiver %s: changed since it last got them: %s", channel, uid,
                             sorted(stale))
        stats = SyncStats(tensors=len({n for _, f in sent for n in f["names"]}),
                          bytes=sum(f["bytes"] for _, f in sent), buckets=sum(f["buckets"] for _, f in sent),
                          seconds=max((f["seconds"] for _, f in sent), default=0.0),
                          prepare_s=max((f.get("prepare_s", 0.0) for _, f in sent), default=0.0),
                          names=sorted({n for _, f in sent for n in f["names"]}),
                          backend=next((f["backend"] for _, f in sent), ""),
                          receivers=max((f["receivers"] for _, f in sent), default=0), lanes=len(sent),
                          path=path, sent_bytes={f"rank {r}": w for r, _, w, *_ in parts},
                          payload_bytes={f"rank {r}": f["bytes"] for r, f in sent})
        logger.info("weight sync %s: %s path, %s", channel, path, stats)
        return [stats]

    # beside: issued while a balanced call runs on this gang, it does not queue behind that call
    # (runtime.beside: the engine paused, the receive, the gang's version set, the engine resumed)
    @RemoteFunction.marked(dispatch="all", collect="flatten", beside=True)
    def weight_sync_recv(self, channel: str) -> list[dict]:
        """Every receiver of this worker takes one sync; their figures. A receiver that fails leaves
        its pairs in step (it drains them) or closes them (the transport broke)."""
        try:
            return list(self.weight_sync_fanout("recv", channel))
        except SourceFailed:  # told by the senders, every pair drained: the pairs stay in step
            raise
        except BaseException:
            try:  # leave: the trainer ranks waiting for this receiver see its pairs close and go on;
                # broken, so the next set-up rebuilds them on both ends
                self.weight_sync_fanout("close", channel, True)
            except Exception:  # best effort: the original error is the one to raise
                logger.debug("weight sync %s: closing a failed receiver failed", channel, exc_info=True)
            raise

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_ready(self, channel: str, role: str) -> list[bool]:
        """Whether this worker's ends hold ``channel`` (source: ranks that hold slabs answer)."""
        if role == "source":
            end = self._ws_state()["sources"].get(channel)
            return [] if end is None else [bool(end.pairs)]
        return list(self.weight_sync_fanout("ready", channel))

    @remote_function(dispatch="all")
    def weight_sync_close(self, channel: str, role: str | None = None, broken: bool = False) -> None:
        """Leave ``channel``: close this worker's pairs and endpoint (``role`` None: whatever it holds).
        ``broken``: a receiver leaving a channel that goes on marks its pairs broken, so the senders
        rebuild them (not keep them as healthy) if it joins again."""
        state = self._ws_state()
        if role in (None, "source"):
            end = state["sources"].pop(channel, None)
            if end is not None:
                end.close()
            state["plans"].pop(channel, None)
            state["tracking"].discard(channel)
        if role == "target" or (role is None and "_twinkle_receiver" in self.__dict__):
            self.weight_sync_fanout("close", channel, broken)

    @remote_function(dispatch="all", collect="flatten")
    def weight_sync_channels(self) -> list[dict]:
        """Diagnostics, one dict per rank: the channels this worker holds, with its pairs and how many
        it opened over its life (a trainer's ``opened`` that stays put across a sampler's rebuild
        shows nobody else's pairs were rebuilt)."""
        state = self._ws_state()
        out = {"rank": get_rank(), "sources": {c: e.counts() for c, e in state["sources"].items()}}
        end = self.__dict__.get("_twinkle_receiver")
        if end is not None:
            out["receivers"] = {c: end.counts(c) for c in end.channels}
        return [out]

