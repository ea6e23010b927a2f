"""Errors users of twinkle_ray catch.

Every error names what failed (group, class, rank, method) so a user reading
a traceback from a 64-worker job knows where to look.

Example::

    try:
        loss = trainer.train_step(batch)()
    except twinkle_ray.WorkerDiedError as e:
        print(e.group, e.rank, e.cause)
        trainer.restart()
"""

from __future__ import annotations


class PlacementError(RuntimeError):
    """A DeviceGroup's placement group could not be reserved.

    Raised at once when the cluster can never hold the group (the message lists
    requested vs available resources), or after ``placement_timeout_s`` when the
    cluster is merely busy. Nothing stays reserved when it is raised.
    """


class WorkerDiedError(RuntimeError):
    """A worker of a gang died; the gang was torn down whole.

    Attributes name the first worker that died: ``group``, ``cls`` (the user's
    class name), ``rank``, ``node`` (IP address) and ``cause`` (Ray's account of
    the death). Call ``restart()`` on the gang to rebuild it.
    """

    def __init__(self, group: str, cls: str, rank: int | None, node: str | None, cause: str):
        self.group, self.cls, self.rank, self.node, self.cause = group, cls, rank, node, cause
        where = f"rank {rank}" if rank is not None else "a worker"
        super().__init__(
            f"worker {where} of {cls} in group '{group}' died (node {node or '?'}): {cause}. "
            f"The gang was torn down; call .restart() on it to rebuild."
        )

    def __reduce__(self):
        return (type(self), (self.group, self.cls, self.rank, self.node, self.cause))


class CallTimeoutError(TimeoutError):
    """A remote_function call did not finish within its ``timeout``.

    ``ranks`` lists the gang ranks that had not answered.
    """

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self):
        return (type(self), (self.args[0], self.ranks))


def describe_actor_death(text: str) -> tuple[str | None, str]:
    """(node ip, short cause) from the text of Ray's ActorDiedError.

    >>> describe_actor_death("The actor died...\\n\\tip: 10.0.0.2\\nThe actor is dead because "
    ...                      "it was killed by `ray.kill`.")
    ('10.0.0.2', 'The actor is dead because it was killed by `ray.kill`.')
    """
    node = None
    cause = ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("ip:"):
            node = s[3:].strip()
        elif not cause and ("dead because" in s or "killed" in s or "exit" in s.lower()):
            cause = s
    if not cause:
        cause = next((s.strip() for s in text.splitlines() if s.strip()), "unknown cause")
    for marker in (" Some common causes include", " If the process was killed"):
        cause = cause.split(marker)[0]
    return node, cause[:400]
