"""The messages of a call: :class:`CallRequest` (caller -> dispatcher) and
:class:`WorkerCall` (dispatcher -> each worker).

A call reaches its dispatcher as one :class:`CallRequest`, one task argument:
Ray serialises each argument of a task on its own, and the request's nine
fields as nine arguments cost both sides ~0.7 ms more per call than one
(BENCHMARKS.md, seventh session).

A call reaches a worker as one actor task carrying five fields:

- ``method``: the name of the method on the user's instance;
- ``seq``: the gang's call number (the dispatcher's one order; the stuck
  check compares it with what a worker says it is running); None for calls
  made outside the dispatcher (benchmarks, tests);
- ``lead``: values the routed markers in the arguments index into, by
  position: producers' length records and aligned producer outputs. They
  are ObjectRefs (or plain values); the worker has them resolved before the
  method runs;
- ``args`` / ``kwargs``: this rank's arguments: plain values, ObjectRefs of
  large values the proxy put, and routed markers (``Pieces``/``Collected``)
  the worker materialises.

It travels flattened, so that Ray resolves the ``lead`` refs as top-level
task arguments before the task runs (the transfer is Ray's, as with raw
direct ref passing), behind one head, the bytes ``b'method/seq/len(lead)'``::

    worker.run.remote(f"{method}/{seq}/{len(lead)}".encode(), *lead, *args, **kwargs)

Every task argument costs: Ray serialises each one on its own. Measured on an
actor's 32 tasks (``python -m bench.probes``, BENCHMARKS.md, eighth to
twelfth sessions), the bytes head costs 0.08 ms per task on a quiet machine
(0.13 loaded) against none at all; a str, an int or a tuple costs more.
A method name holds no ``/``; one with a ``.`` keeps the head.

So a call with no leading values (nothing routed: the common case) travels
with **no head** (:attr:`~twinkle_ray.runtime.routing.CallPlan.named`; unless it
is balanced or its method's name has a ``.``): only its arguments, as a task named
``'group/Class.method'`` (the name the dashboard shows anyway;
``'Class.method'`` with metrics off). The
worker reads the method from the task's name
(``ray.get_runtime_context().get_task_name()``) and knows the call by the
task's id (``get_task_id()``), which it reports in place of the number (the
stuck check, a failure report); the dispatcher maps task ids to numbers
(:class:`~twinkle_ray.runtime.ranks.TaskNumbers`). The number cannot go in
the name: Ray labels its ``ray_tasks`` metric by task name, and a name per
call would grow the node's metric series without bound. Routed calls keep
the head (they need ``len(lead)``), and so do balanced ones (their chunk
requests name the call by its number).

Example::

    >>> call = WorkerCall("forward", 7, (), ([1, 2],), {})
    >>> call.task_args()
    (b'forward/7/0', [1, 2])
    >>> WorkerCall.from_task(b"forward/7/0", ([1, 2],), {}) == call
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class CallRequest(NamedTuple):
    """One call as its caller sends it to the gang's dispatcher (see ``Dispatcher.call``).

    Example::

        CallRequest("forward", [((batch,), {})], "slice_dp", "all", None, False,
                    ("caller-id", 0, None), "flatten", False)
    """

    method: str
    per_worker: list  # each worker's (args, kwargs) as the caller split them; one entry: the same for all
    dispatch: Any  # the method's dispatch mode (or callable)
    execute: str  # 'all', 'first' or 'peer'
    caller: tuple[int, int] | None = None  # (rank, world size) of a calling gang worker ('peer')
    wait_meta: bool = False  # wait for the outputs' length records (iteration: StopIteration)
    turn: tuple | None = None  # (caller id, number, previous call: [settled ref] | SETTLED | None)
    collect: str | None = None  # the caller's collect mode (None: unknown)
    inline: bool = False  # an eager call: values back in the reply (runtime.inline)


@dataclass(frozen=True)
class WorkerCall:
    """One call as one worker receives it (see the module docstring)."""

    method: str
    seq: int | str | None  # the call's number; a named task's id (hex) in the worker
    lead: tuple
    args: tuple
    kwargs: dict

    def task_args(self) -> tuple:
        """The positional arguments of the task form: ``(head, *lead, *args)``; kwargs travel as
        keyword arguments. The head is ``b'method/seq/len(lead)'`` (bytes: see above)."""
        return (f"{self.method}/{self.seq}/{len(self.lead)}".encode(), *self.lead, *self.args)

    @classmethod
    def from_task(cls, head: bytes | str, args: tuple, kwargs: dict) -> WorkerCall:
        """Rebuild the message from a task's arguments; ``head`` (bytes, or a str when called by
        hand) may be a bare method name (no sequence number, no leading values)."""
        if type(head) is bytes:
            head = head.decode()
        method, sep, rest = head.partition("/")
        if not sep:
            return cls(head, None, (), tuple(args), dict(kwargs))
        seq, n = rest.split("/")
        n = int(n)
        return cls(method, None if seq == "None" else int(seq), tuple(args[:n]), tuple(args[n:]),
                   dict(kwargs))

    @classmethod
    def from_name(cls, name: str, task_id: str, args: tuple, kwargs: dict) -> WorkerCall:
        """Rebuild a call sent without a head from its task's name (``'group/Class.method'``, or
        ``'Class.method'`` with metrics off: the method is after the last ``.``) and id.

        >>> WorkerCall.from_name("g.v2/Model.step", "ab12", (1,), {})
        WorkerCall(method='step', seq='ab12', lead=(), args=(1,), kwargs={})
        """
        return cls(name.rpartition(".")[2], task_id, (), tuple(args), dict(kwargs))


