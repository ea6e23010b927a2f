"""The driver API: :func:`sync_weights`, :class:`WeightSync`.

One piece, a little over 400 lines: ``sync_weights``, a channel's set-up and its syncs share
the channel's state (its pairs, its sync count, its last handle); the registry is three
functions of that state.

A :class:`WeightSync` is one trainer -> samplers channel. Its set-up is four calls, made at once and
in each gang's order (nothing waits on the driver): ``weight_sync_probe`` on every gang (the
trainer's slabs, the receivers' wants), ``weight_sync_plan`` on the trainer's rank 0 (the plan, from
the probes, passed as routed results), and ``weight_sync_join`` on every gang (each end keeps its
healthy pairs, opens the new ones, closes the rest). A sync is ``weight_sync_send`` on the trainer
and ``weight_sync_recv`` on each sampler gang. The set-up runs again only when a gang was rebuilt,
a sync failed, or the samplers changed -- and then only the pairs of what changed are opened.

Channels belong to the runtime: a WeightSync is closed by :meth:`WeightSync.close`, by the close of
any of its gangs (``GangProxy.on_close``) and by ``shutdown()`` (``Runtime.own``). ``sync_weights``
keeps one WeightSync per trainer in a registry the runtime owns, and closes the one it replaces.

>>> # ws = WeightSync(trainer, [sampler_a, sampler_b], timeout_s=120)
>>> # ws.sync(); h = ws.sync(only_changed=True, wait=False); ...; twinkle_ray.get(h); ws.close()
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

from ..runtime.proxy import call_setting_version
from .handle import SyncHandle
from .transport import DEFAULT_BUCKET_MB, DEFAULT_TIMEOUT_S, SyncStats

logger = logging.getLogger(__name__)

__all__ = ["WeightSync", "sync_weights"]

CLOSE_WAIT_S = 10.0  # closing a channel: how long each gang gets to leave it


def _is_gang(obj: Any) -> bool:
    from ..runtime.proxy import GangProxy

    return isinstance(obj, GangProxy)


def _identity(obj: Any) -> Any:
    """What names one gang, whichever handle of it (a pickled copy, one found by name): its label
    (``'group/Class'``); an in-process object: itself."""
    if _is_gang(obj):
        return ("gang", obj.label)
    return ("object", id(obj))


def _name(obj: Any) -> str:
    return repr(obj) if _is_gang(obj) else f"{type(obj).__name__} object"


def check_targets(source: Any, targets: Sequence[Any]) -> None:
    """Refuse targets no sync can serve, before any byte moves (``ValueError`` naming the gang): none
    at all, the trainer among its own targets, one gang twice (also through two handles of it)."""
    if not targets:
        raise ValueError(f"weight sync from {_name(source)}: the target list is empty (give at least one "
                         f"sampler gang)")
    me = _identity(source)
    seen: dict = {}
    for i, t in enumerate(targets):
        key = _identity(t)
        if key == me:
            raise ValueError(f"weight sync: the trainer {_name(source)} is among its own targets (target {i}); "
                             f"a gang cannot send its weights to itself")
        if key in seen:
            raise ValueError(f"weight sync: {_name(t)} is twice among the targets (targets {seen[key]} and {i}"
                             + ("; two handles of one gang" if t is not targets[seen[key]] else "")
                             + "): each sampler gang may be named once")
        seen[key] = i


def check_settings(timeout_s: Any, bucket_mb: Any, backend: Any) -> None:
    """Refuse settings no sync can run with (``ValueError`` naming the setting), before any side effect:
    ``timeout_s`` and ``bucket_mb`` positive numbers, ``backend`` None, 'gloo' or 'nccl'.

    >>> check_settings(60, 32, None)
    >>> check_settings(0, 32, None)
    Traceback (most recent call last):
    ...
    ValueError: weight sync: timeout_s must be a positive number of seconds, got 0
    """
    for name, value, unit in (("timeout_s", timeout_s, " of seconds"), ("bucket_mb", bucket_mb, " of MB")):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"weight sync: {name} must be a positive number{unit}, got {value!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"weight sync: backend must be None (chosen by the ends), 'gloo' or 'nccl', got {backend!r}")


def check_names(names: Sequence[str] | None, known: Any, trainer: Any) -> list[str] | None:
    """``names`` as a list, refused (``ValueError`` naming them) when the trainer lacks any of them
    (``known``: the trainer's tensor names, None when not known yet); a bare string is refused too."""
    if names is None:
        return None
    if isinstance(names, str):
        raise ValueError(f"weight sync: names= takes a list of tensor names, got the string {names!r}")
    names = list(names)
    if known is not None:
        missing = [n for n in names if n not in known]
        if missing:
            raise ValueError(f"weight sync: unknown tensor name(s) {missing[:5]}"
                             + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
                             + f" in names=: trainer {_name(trainer)} has no such tensor; nothing was sent")
    return names


class WeightSync:
    """Driver-side handle of one trainer -> samplers weight channel (see the module docstring).

    Timeouts: no wait in a sync or a set-up is longer than ``timeout_s`` -- a pair's first wait too
    (the other gang may still be running earlier calls: it has ``timeout_s`` to reach the sync); a
    death of the other side ends any wait at once. ``wait=True`` bounds the whole sync by
    ``timeout_s + 30`` s.
    """

    def __init__(self, source: Any, targets: Any, *, backend: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, bucket_mb: float = DEFAULT_BUCKET_MB):
        self.source = source
        self.targets = list(targets) if isinstance(targets, list | tuple) else [targets]
        check_targets(source, self.targets)
        check_settings(timeout_s, bucket_mb, backend)
        self.backend, self.timeout_s, self.bucket_mb = backend, timeout_s, bucket_mb
        self.channel = f"ws-{uuid.uuid4().hex[:10]}"
        self.backend_used: str | None = backend
        self.closed = False
        # syncs sent on this channel: the number each receiving gang's weight version becomes
        # once it applied the sync (Completed.versions; a rebuilt gang is 0 until its next one)
        self.syncs = 0
        self._ok = False
        self._reset = False  # after a failure: the senders forget what each receiver holds
        self._generations: tuple = ()
        self._last: SyncHandle | None = None
        self._known: set[str] | None = None  # the trainer's tensor names, from the last set-up's plan
        self._setup: Any = None  # that set-up's plan call, read once it is done (never waited on)
        self._remote = _is_gang(source)
        if any(_is_gang(t) != self._remote for t in self.targets):
            raise TypeError("WeightSync: source and targets must all be gangs or all be local objects")
        if self._remote:
            self._watch(self.source, *self.targets)

    def _watch(self, *gangs: Any) -> None:
        """Closed with any of ``gangs`` and with the runtime (weakly: a dropped WeightSync is not kept)."""
        from ..runtime.session import current

        ref = weakref.ref(self)

        def close() -> None:
            ws = ref()
            if ws is not None:
                ws.close()

        for g in gangs:
            g.on_close(close)
        rt = current()
        if rt is not None:
            rt.own(self)

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build (or bring up to date) every end's pairs now."""
        if not self._remote:
            self._ok = True
            return
        SyncHandle(self, self._open(), None, self.timeout_s + 30).get()
        self._ok = True

    def _open(self) -> list[tuple[Any, Any]]:
        """Submit the set-up calls (nothing waits here); returns them as (gang, LazyResult) ends."""
        src = self.source.weight_sync_probe("source", self.channel, self.timeout_s)
        tgt = [g.weight_sync_probe("target") for g in self.targets]
        setup = self._setup = self.source.weight_sync_plan(self.channel, self.backend, self.timeout_s, src, *tgt)
        joins = [(self.source, self.source.weight_sync_join(self.channel, setup, "source"))]
        joins += [(g, g.weight_sync_join(self.channel, setup, "target", i)) for i, g in enumerate(self.targets)]
        self._generations = self._gang_generations()
        return [(self.source, src), *zip(self.targets, tgt, strict=True), (self.source, setup), *joins]

    def _gang_generations(self, must_answer: bool = False) -> tuple:
        """Which build of each gang runs now (its dispatcher answers at once): a rebuilt gang holds no
        pairs. Every gang is asked at once: one round trip per sync, whatever the number of gangs, and
        none waited on longer than ``timeout_s``. A gang closed or gone reads None (the sync says so);
        one whose dispatcher does not answer in time reads None too, or (``must_answer``: before a sync
        submits anything) raises CallTimeoutError naming the gang and the channel."""
        import ray

        gangs = [self.source, *self.targets]
        refs = []
        for g in gangs:
            try:
                refs.append(g.topology_ref())
            except Exception:  # closed: the sync will say so
                refs.append(None)
        asked = [r for r in refs if r is not None]
        ready = set(ray.wait(asked, num_returns=len(asked), timeout=self.timeout_s)[0]) if asked else set()
        silent = [g for g, r in zip(gangs, refs, strict=True) if r is not None and r not in ready]
        if silent and must_answer:
            from ..runtime.errors import CallTimeoutError

            raise CallTimeoutError(f"weight sync {self.channel}: the dispatcher of {silent[0]!r} did not "
                                   f"answer within {self.timeout_s:g}s (timeout_s); nothing was sent", [])
        out = []
        for ref in refs:
            try:
                t = ray.get(ref, timeout=0) if ref in ready else None
                out.append(None if t is None else (t["dispatcher_id"], t["generation"]))
            except Exception:  # gone: the sync will say so
                out.append(None)
        return tuple(out)

    def _check(self) -> None:
        """Whether the set-up must run again, found without waiting on any gang call."""
        last = self._last
        if last is not None and last.done():
            try:
                last.get()  # finished: reading it never waits
            except Exception:  # kept in the handle for its owner; it marked the channel for set-up
                pass
        if self._ok and self._gang_generations(must_answer=True) != self._generations:
            self._ok = False

    def known_names(self, wait: bool = False) -> set[str] | None:
        """The trainer's tensor names as the last set-up's plan found them (None: not known yet).
        ``wait``: set the channel up first when it is not (a ``names=`` sync that waits anyway)."""
        setup = self._setup
        if setup is not None and (setup.done() or wait):
            from ..runtime.session import get

            try:
                self._known = set(get(setup, self.timeout_s + 30)["plan"]["names"])
            except Exception:  # that set-up failed: its sync says why; the trainer checks names itself
                logger.debug("weight sync %s: set-up not readable for names", self.channel, exc_info=True)
            self._setup = None
        elif self._known is None and wait and self._remote:
            try:
                self.setup()
            except Exception:  # the sync itself raises it (and sets up again)
                logger.debug("weight sync %s: set-up before a names= check failed", self.channel, exc_info=True)
                self._ok = False
            return self.known_names(wait=False)
        return self._known

    def failed(self) -> None:
        """A sync failed: the next one sets up again (only broken pairs are rebuilt) and sends everything."""
        self._ok = False
        self._reset = True

    def retarget(self, targets: Sequence[Any]) -> None:
        """Sync to ``targets`` from now on: gangs no longer named leave the channel; new ones join at
        the next sync. The trainer's endpoints and the remaining samplers' pairs are kept."""
        targets = list(targets)
        check_targets(self.source, targets)
        keep = {_identity(t) for t in targets}  # a gang by its name: any handle of it is the same gang
        had = {_identity(g) for g in self.targets}
        gone = [g for g in self.targets if _identity(g) not in keep]
        new = [t for t in targets if _identity(t) not in had]
        self._leave(gone, broken=True)
        self.targets = targets
        if new:
            self._watch(*new)
        self._ok = False

    # -- syncs ----------------------------------------------------------------------------------
    def sync(self, *, names: Sequence[str] | None = None, only_changed: bool = False,
             wait: bool = True) -> SyncStats | SyncHandle:
        """Send the trainer's weights (all, ``names``, or the changed ones) to every receiver.

        ``wait=False``: returns a :class:`SyncHandle` at once; the sync runs in both gangs' call order
        (after their calls made so far, before later ones).
        """
        if self.closed:
            raise RuntimeError(f"weight sync {self.channel} is closed")
        if not self._remote:
            known = {s.name for s in self.source.weight_sync_shards()} if names is not None else None
            stats = _local_sync(self.source, self.targets, check_names(names, known, self.source))
            self.syncs += 1
            return stats if wait else SyncHandle.finished(stats)
        self._check()
        names = check_names(names, self.known_names(wait=wait and names is not None), self.source)
        ends = [] if self._ok else self._open()
        ends.append((self.source, self.source.weight_sync_send(self.channel, names, only_changed, self.bucket_mb,
                                                               self._reset)))
        result = len(ends) - 1
        self.syncs += 1
        # each receiving gang's weight version becomes this sync's number once it applied it
        ends += [(g, call_setting_version(g.weight_sync_recv, self.syncs, self.channel))
                 for g in self.targets]
        self._ok, self._reset = True, False  # later syncs replay it; a failure seen marks it again
        handle = self._last = SyncHandle(self, ends, result, self.timeout_s + 30 if wait else None)
        return handle.get() if wait else handle

    def channels(self) -> dict:
        """Diagnostics: per gang (``'trainer'``, ``'sampler 0'``, ...), each rank's pairs and how many
        it opened over its life (see ``WeightSyncMixin.weight_sync_channels``)."""
        from ..runtime.session import get

        out = {"trainer": get(self.source.weight_sync_channels(), self.timeout_s)}
        for i, g in enumerate(self.targets):
            out[f"sampler {i}"] = get(g.weight_sync_channels(), self.timeout_s)
        return out

    # -- closing --------------------------------------------------------------------------------
    def _leave(self, gangs: list, broken: bool = False) -> None:
        """Each of ``gangs`` leaves the channel (bounded, best effort). ``broken``: receivers leaving a
        channel that goes on mark their pairs broken, so the trainer's ends rebuild them too if they
        come back (an unbroken pair left by one end only would look healthy to the other)."""
        from ..runtime.session import get

        calls = []
        for g in gangs:
            try:
                calls.append(g.weight_sync_close(self.channel, None, broken) if broken
                             else g.weight_sync_close(self.channel))
            except Exception:  # closed or dead: nothing to leave
                logger.debug("weight sync %s: close on %r failed", self.channel, g, exc_info=True)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for c in calls:
            try:
                get(c, max(0.1, deadline - time.monotonic()))
            except Exception:  # a dead gang has nothing to close
                logger.debug("weight sync %s: close failed", self.channel, exc_info=True)

    def close(self) -> None:
        """Close the channel on every gang (best effort, bounded): pairs and endpoints. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._ok = False
        if not self._remote:
            return
        from ..runtime.session import current

        self._leave([self.source, *self.targets])
        rt = current()
        if rt is not None:
            rt.disown(self)
        logger.info("weight sync %s: closed", self.channel)


def _local_sync(source: Any, targets: list, names: Sequence[str] | None) -> SyncStats:
    """In-process objects (local mode): copy tensors directly."""
    import torch

    start = time.perf_counter()
    items = [(s.name, s.tensor) for s in source.weight_sync_shards()]
    if names is not None:
        wanted = set(names)
        items = [(n, t) for n, t in items if n in wanted]
    with torch.no_grad():
        for t in targets:
            t.weight_sync_receive(iter([[(n, v.detach()) for n, v in items]]))
    nbytes = sum(v.numel() * v.element_size() for _, v in items)
    return SyncStats(tensors=len(items), bytes=nbytes, buckets=0, seconds=time.perf_counter() - start,
                     names=[n for n, _ in items], backend="local", receivers=len(targets), path="local")


class Registry:
    """The WeightSyncs ``sync_weights`` made, one per trainer; owned by the runtime (closed at shutdown)."""

    def __init__(self) -> None:
        self.entries: list[WeightSync] = []

    def find(self, trainer: Any) -> WeightSync | None:
        self.entries = [ws for ws in self.entries if not ws.closed]
        me = _identity(trainer)  # any handle of the gang (one found by name, a pickled copy)
        return next((ws for ws in self.entries if _identity(ws.source) == me), None)

    def close(self) -> None:
        for ws in self.entries:
            ws.close()
        self.entries.clear()


def _registry() -> Registry:
    from ..runtime.session import current

    rt = current()
    if rt is None:
        raise RuntimeError("sync_weights: no twinkle_ray runtime (call twinkle_ray.initialize() first)")
    for r in rt.resources:
        if isinstance(r, Registry):
            return r
    reg = Registry()
    rt.own(reg)
    return reg


def sync_weights(
    trainer: Any,
    sampler: Any,
    *,
    names: Sequence[str] | None = None,
    only_changed: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    backend: str | None = None,
    wait: bool = True,
) -> SyncStats | SyncHandle:
    """Send the trainer's weights to every sampler: each trainer rank sends the rows it holds that
    each receiver keeps (see :mod:`twinkle_ray.weights`); returns the trainer's merged stats.

    The channel of a trainer is set up on the first call and reused. Gangs are matched by name
    (``'group/Class'``): a handle found anew each step (``GangProxy.lookup``) is the same gang and
    reuses the same channel and pairs. Other samplers than last time
    (one added, one replaced) join at this sync, the others keep their pairs; other ``timeout_s``,
    ``bucket_mb`` or ``backend`` closes the old channel and opens a new one. ``wait=False`` returns
    a :class:`SyncHandle` at once: the sync takes its place in both gangs' call order.

    >>> # stats = sync_weights(trainer, sampler, only_changed=True)
    >>> # handle = sync_weights(trainer, [sampler_a, sampler_b], wait=False); ...; twinkle_ray.get(handle)
    """
    samplers = list(sampler) if isinstance(sampler, list | tuple) else [sampler]
    # every input is checked before any side effect (closing a channel, a sampler leaving it): a
    # refused call changes nothing
    check_targets(trainer, samplers)
    check_settings(timeout_s, bucket_mb, backend)
    names = check_names(names, None, trainer)
    if not _is_gang(trainer):
        return WeightSync(trainer, samplers).sync(names=names, only_changed=only_changed, wait=wait)
    reg = _registry()
    ws = reg.find(trainer)
    if ws is not None and names is not None:  # the trainer's names, as its channel knows them
        check_names(names, ws.known_names(wait=wait), trainer)
    syncs = 0
    if ws is not None and (ws.timeout_s, ws.bucket_mb, ws.backend) != (timeout_s, bucket_mb, backend):
        logger.info("weight sync %s: settings changed; closing it for a new channel", ws.channel)
        ws.close()
        syncs, ws = ws.syncs, None  # the trainer's sync count goes on: versions never go back
    if ws is None:
        ws = WeightSync(trainer, samplers, timeout_s=timeout_s, bucket_mb=bucket_mb, backend=backend)
        ws.syncs = syncs
        reg.entries.append(ws)
    elif [_identity(s) for s in ws.targets] != [_identity(s) for s in samplers]:
        ws.retarget(samplers)
    return ws.sync(names=names, only_changed=only_changed, wait=wait)
