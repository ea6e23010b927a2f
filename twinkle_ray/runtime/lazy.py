"""LazyResult: what a remote_function call returns, and how it travels.

A call returns at once with a LazyResult holding the ref of its dispatcher's
:class:`~twinkle_ray.runtime.reply.Reply` (the per-rank output ObjectRefs). Nothing is
fetched until someone needs the value::

    out = sampler.generate(prompts)      # LazyResult, returns immediately
    scores = out()                       # or out.get(), len(out), list(out)
    trainer.train_step(out)              # routed: never fetched by the driver

Passed to another gang's method (anywhere in its arguments), a LazyResult is routed: the
pickler of the call's arguments turns it into a slot (:mod:`~twinkle_ray.runtime.wire`)
and each consumer rank builds its part from the producers' object stores
(:mod:`~twinkle_ray.runtime.routed`): what it would get had the caller fetched the value
and passed it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import cloudpickle
import ray
from ray.exceptions import (
    GetTimeoutError,
    ObjectFetchTimedOutError,
    ObjectLostError,
    RayActorError,
    RayError,
    RaySystemError,
    RayTaskError,
)

from ..core.balance import Completed
from ..core.routing import Source, join
from .completed import completions
from .diagnose import OUTPUT_REFS, Caller, GangRef, fetch, fetch_timed_out, read_quietly, user_error
from .errors import CallTimeoutError
from .reply import Reply, values_of
from .wire import PUT_BYTES, Routable, Route

END_OF_ITERATION = "twinkle_ray:end-of-iteration"


class Pending:
    """Something :func:`twinkle_ray.get` materialises: a value still being computed.

    Subclasses implement ``get(timeout)`` and ``done()``; :class:`LazyResult` (one call) and
    the handle of a weight sync started with ``wait=False`` are the two.
    """

    __slots__ = ()

    def get(self, timeout: float | None = None) -> Any:
        raise NotImplementedError

    def done(self) -> bool:
        """Whether it has finished (never waits)."""
        raise NotImplementedError


def ray_running() -> None:
    """RuntimeError unless Ray runs in this process: a result of a gang shut down is gone
    (and ``ray.get`` would start a new, empty Ray, left running)."""
    if not ray.is_initialized():
        raise RuntimeError("twinkle_ray.shutdown() was called (Ray is not running in this "
                           "process): the results of its gangs are gone")


class LazyResult(Pending, Routable):
    """The per-rank outputs of one call, collected only when needed.

    Materialises on ``get()``, ``()``, ``len()`` and iteration; ``refs`` gives the per-rank
    ObjectRefs. Passed to another gang's method it is routed, not fetched: payload bytes go
    straight from producer to consumer workers.

    Example::

        out = model.forward(batch)        # LazyResult
        out.refs                          # [ObjectRef, ...] one per rank
        loss = out()                      # collected value
    """

    __slots__ = ("reply_ref", "_reply", "_value", "_has_value", "collect", "gang", "method",
                 "timeout", "turn", "_caller", "_previous", "_again")

    @property
    def requeue(self) -> Any:
        """How a balanced call's undelivered items run again on the rebuilt gang after a death
        (:class:`~twinkle_ray.runtime.completed.Requeue`), or None."""
        return self._again

    def fill(self, value: Any) -> None:
        """The value ``get()`` gives from now on (``as_completed``'s join after a re-queue)."""
        self._value, self._has_value = value, True

    def __init__(self, reply_ref: Any, *, collect: Any, gang: GangRef, method: str,
                 timeout: float | None = None, reply: Reply | None = None,
                 turn: tuple[str, int] | None = None, caller: Caller | None = None,
                 previous: Any = None, again: Any = None):
        self.reply_ref = reply_ref  # the ref of the dispatcher's Reply
        self._reply = reply
        self._caller = caller  # the proxy that made the call (never pickled)
        # that proxy's record of this call (proxy.Previous): told once the reply is here, so the
        # proxy's next call need not wait on it (never pickled)
        self._previous = previous
        # a balanced call's way to run its undelivered items again on the rebuilt gang after a
        # death (completed.Requeue; set by the proxy that made it, never pickled)
        self._again = again
        self.turn = turn  # (caller id, number): its dispatcher knows the reply by it a while
        self._value = None
        self._has_value = False
        self.collect = collect
        self.gang = gang
        self.method = method
        self.timeout = timeout

    @property
    def _where(self) -> str:
        return f"{self.gang.cls_name}.{self.method}() on group '{self.gang.group}'"

    # -- the reply and refs --------------------------------------------------------------------
    def reply(self, timeout: float | None = None) -> Reply:
        """The dispatcher's :class:`~twinkle_ray.runtime.reply.Reply` (refs only); raises the
        call's routing and death errors.

        The dispatcher replies as soon as it has submitted the call's tasks: past ``timeout``
        seconds without it, CallTimeoutError says that no rank has started the call (it waits
        in the dispatcher, behind its caller's earlier call, a stuck check or the gang's
        rebuild).
        """
        if self._reply is None:
            ray_running()
            start = time.monotonic()
            try:
                reply = ray.get(self.reply_ref, timeout=timeout)
            except GetTimeoutError:
                raise CallTimeoutError(
                    f"{self._where}: not started on any rank within {timeout:g}s (it waits in "
                    f"the dispatcher, behind its caller's earlier call, a stuck check or the "
                    f"gang's rebuild)", []) from None
            except RayTaskError as e:
                raise user_error(e, self.gang, self.method, None, self._caller) from None
            except RayActorError as e:
                raise self.gang.death_error(e, None, self._caller, self.method) from None
            except ObjectFetchTimedOutError as e:  # Ray found no copy in time: not a death
                raise fetch_timed_out(e, self.gang, self.method, None, "the reply") from None
            except RaySystemError as e:
                e.add_note(f"while sending {self._where} to its gang's dispatcher")
                raise
            if self._previous is not None:
                self._previous.replied_now()
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            try:
                self._reply = reply.unpacked(timeout=left)
            except GetTimeoutError:
                raise CallTimeoutError(
                    f"{self._where}: submitted, but the refs of its outputs (held by the gang's "
                    f"dispatcher) did not arrive within {timeout:g}s", []) from None
            except ObjectFetchTimedOutError as e:  # Ray found no copy in time: not a death
                raise fetch_timed_out(e, self.gang, self.method, None, OUTPUT_REFS) from None
            except ObjectLostError as e:  # its dispatcher (the bundle's owner) died
                raise self.gang.death_error(e, None, self._caller, self.method) from None
        return self._reply

    @property
    def refs(self) -> list:
        """Per-rank payload ObjectRefs, in gang-rank order of the executing workers."""
        return list(self.reply().refs)

    @property
    def ranks(self) -> list[int]:
        """Gang ranks that produced each of ``refs``."""
        return list(self.reply().workers)

    def route_facts(self) -> Route:
        """What a call this LazyResult is passed to routes it by (see ``wire.Route``)."""
        collect = self.collect
        if not isinstance(collect, str):  # a callable travels pickled; put when large (one
            collect = cloudpickle.dumps(collect)  # holding a big closure): never payload in a
            if len(collect) >= PUT_BYTES:  # dispatcher, nor once per rank
                collect = ray.put(collect)
        reply = self._reply.traveling() if self._reply is not None else None
        return Route(self.reply_ref, reply, self.gang, self.method, self.turn, collect)

    # -- materialising -------------------------------------------------------------------------
    def get(self, timeout: float | None = None) -> Any:
        """Fetch and collect the value (cached after the first call)."""
        if not self._has_value:
            ray_running()
            t = timeout if timeout is not None else self.timeout
            start = time.monotonic()
            reply = self.reply(t)
            left = None if t is None else max(0.0, t - (time.monotonic() - start))

            def outputs(ks: list[int]) -> list:
                ranks = [reply.workers[k] for k in ks]
                if reply.values is not None:  # an eager call answered with its values
                    return values_of([reply.values[k] for k in ks], lambda held, at: fetch(
                        held, [ranks[i] for i in at], self.gang, self.method, None, None,
                        self._caller))
                refs = [reply.refs[k] for k in ks]
                try:
                    return ray.get(refs, timeout=left)  # the usual case; else, named:
                except (RayError, GetTimeoutError) as e:  # (the time is up: late ranks named)
                    late = 0 if isinstance(e, GetTimeoutError) else None
                    try:
                        return fetch(refs, ranks, self.gang, self.method, late, t, self._caller)
                    except Exception:
                        read_quietly(reply.records)  # their copy of the error: no log noise
                        raise

            records = None
            if reply.balanced:  # its records say where each item goes (they come with the items)
                records = fetch(reply.records, reply.workers, self.gang, self.method, left, t,
                                self._caller)
            source = Source(self.collect, records, reply.workers, self.gang.mesh,
                            self.gang.gpus_per_worker, reply.balanced)
            self._value = join(source, outputs)
            self._has_value = True
        return self._value

    def as_completed(self, timeout: float | None = None) -> Iterator[Completed]:
        """A balanced call's items in the order they finish, while the call runs: one
        :class:`~twinkle_ray.core.balance.Completed` ``(index, value, rank, versions)`` per
        input item, every index exactly once.

        ``index`` is the item's position in the call's input list, ``rank`` the data-parallel
        group that ran it, ``versions`` the gang's weight version when its chunk started and
        when it ended. An error is raised where it is met (its type kept, its rank named; a
        dead worker: WorkerDiedError); past ``timeout`` seconds (default: the method's
        ``timeout=``) CallTimeoutError. ``get()`` afterwards still gives the input order,
        and this LazyResult still routes. Results travel as the caller's own refs (Ray's
        streaming generators), never through the dispatcher
        (:mod:`~twinkle_ray.runtime.completed`). TypeError (at once) on a call whose result
        is not one item per input: only ``dispatch='balance'`` calls stream.

        Example::

            for c in sampler.generate(prompts).as_completed():
                rewards[c.index] = score(c.value)
        """
        ray_running()
        return completions(self, timeout if timeout is not None else self.timeout, self._where,
                           self._caller)

    def done(self) -> bool:
        """Whether every rank has finished this call (with a value or an error); never waits."""
        if self._has_value:
            return True
        ray_running()
        if self._reply is None:
            if not ray.wait([self.reply_ref], timeout=0)[0]:
                return False
            try:
                reply = ray.get(self.reply_ref)  # here already: no wait
                # a large gang's refs travel as a bundle: not fetched here until it is local
                if reply.bundle is not None and not ray.wait([reply.bundle], timeout=0)[0]:
                    return False
                self.reply()
            except Exception:  # the call failed before it ran: finished
                return True
        refs = [r for r in self._reply.refs if isinstance(r, ray.ObjectRef)]
        if not refs:  # an eager call's values came back with its reply
            return True
        return len(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]) == len(refs)

    def __call__(self) -> Any:
        return self.get()

    def __len__(self) -> int:
        return len(self.get())

    def __iter__(self):
        return iter(self.get())

    def __repr__(self) -> str:
        state = "collected" if self._has_value else "pending"
        return f"LazyResult({self.gang.cls_name}.{self.method} on '{self.gang.group}', {state})"

    def __reduce__(self):
        # Travels as refs and routing facts; never with a fetched value.
        reply = self._reply.traveling() if self._reply is not None else None
        return (_rebuild_lazy, (self.reply_ref, self.collect, self.gang, self.method, self.timeout,
                                reply, self.turn))


def _rebuild_lazy(reply_ref, collect, gang, method, timeout, reply, turn=None):
    return LazyResult(reply_ref, collect=collect, gang=gang, method=method, timeout=timeout,
                      reply=reply, turn=turn)
