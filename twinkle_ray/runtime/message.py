"""The one message a worker receives for a call: :class:`WorkerCall`.

Whichever way a call reaches a worker (an actor task or a Compiled Graph
execution), the worker gets the same five fields:

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

As an actor task it travels flattened, so that Ray resolves the ``lead``
refs as top-level task arguments before the task runs (the transfer is
Ray's, as with raw direct ref passing)::

    worker.run.remote((method, seq, len(lead)), *lead, *args, **kwargs)

Through a Compiled Graph it travels as the object itself (rank ``i`` reads
input ``i``) and the worker resolves ``lead`` with one ``ray.get``.

Example::

    >>> call = WorkerCall("forward", 7, (), ([1, 2],), {})
    >>> call.task_args()
    (('forward', 7, 0), [1, 2])
    >>> WorkerCall.from_task(("forward", 7, 0), ([1, 2],), {}) == call
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerCall:
    """One call as one worker receives it (see the module docstring)."""

    method: str
    seq: int | None
    lead: tuple
    args: tuple
    kwargs: dict

    def task_args(self) -> tuple:
        """The positional arguments of the task form: ``(head, *lead, *args)``; kwargs travel as
        keyword arguments."""
        return ((self.method, self.seq, len(self.lead)), *self.lead, *self.args)

    @classmethod
    def from_task(cls, head: str | tuple, args: tuple, kwargs: dict) -> WorkerCall:
        """Rebuild the message from a task's arguments; ``head`` may be a bare method name
        (no sequence number, no leading values)."""
        if isinstance(head, str):
            return cls(head, None, (), tuple(args), dict(kwargs))
        method, seq, n = head
        return cls(method, seq, tuple(args[:n]), tuple(args[n:]), dict(kwargs))



# -- replies through a Compiled Graph ----------------------------------------------------------
# A rank answers a graph execution with (body, meta): meta is the result's batch length (as in the
# task form's second return) and body one of the three types below. None: not a target of the call.


@dataclass(frozen=True)
class Inline:
    """A small result, carried by value (through the graph's channel and in the CallOutput) as
    its pickled bytes: only whoever reads ``value`` (the caller, or a consumer worker) unpickles
    it, never the dispatcher in between.

    >>> Inline.of([1, 2]).value
    [1, 2]
    """

    data: bytes

    @classmethod
    def of(cls, value: Any) -> Inline:
        import ray.cloudpickle

        return cls(ray.cloudpickle.dumps(value))

    @property
    def value(self) -> Any:
        import ray.cloudpickle

        return ray.cloudpickle.loads(self.data)


@dataclass(frozen=True)
class Kept:
    """A large result the worker keeps under the call's number until the dispatcher's ``take``
    task turns it into a Ray object (owned by the dispatcher, stored on the worker's node)."""

    seq: int


@dataclass(frozen=True)
class Raised:
    """The user's exception on ``rank`` (with its remote traceback), or an error about the
    whole call (``rank`` None: e.g. the gang died under it)."""

    error: BaseException
    rank: int | None
    traceback: str = ""
