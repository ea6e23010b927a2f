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
        who = f"worker rank {rank}" if rank is not None else "a worker"
        super().__init__(
            f"{who} of {cls} in group '{group}' died (node {node or '?'}): {cause}. "
            f"The gang was torn down; call .restart() on it to rebuild."
        )

    def __reduce__(self):
        return (type(self), (self.group, self.cls, self.rank, self.node, self.cause))


class GangStuckError(WorkerDiedError):
    """A rank failed while its peers sat in a collective; the gang was torn down whole.

    ``rank`` is the rank that failed first (``cause`` says how), ``stuck`` the
    ranks that had not finished the same call ``grace_s`` seconds later, which
    are presumed blocked in a collective that can no longer complete. It is a
    :class:`WorkerDiedError`, so code that handles deaths (``restart()``,
    ``max_restarts``) handles it too.

    >>> e = GangStuckError("g", "Model", 1, [0], "step", "KeyError: 'x'", 3.0)
    >>> e.stuck, isinstance(e, WorkerDiedError)
    ([0], True)
    """

    def __init__(self, group: str, cls: str, rank: int | None, stuck: list[int], method: str,
                 cause: str, grace_s: float):
        self.group, self.cls, self.rank, self.node, self.cause = group, cls, rank, None, cause
        self.stuck, self.method, self.grace_s = list(stuck), method, grace_s
        who = f"rank {rank}" if rank is not None else "a rank"
        RuntimeError.__init__(
            self,
            f"{who} of {cls} in group '{group}' failed in {method}() ({cause}); rank(s) {self.stuck} "
            f"had not finished that call {grace_s:g}s later (blocked in a collective?). The gang "
            f"was torn down; call .restart() on it to rebuild (max_restarts does it by itself).",
        )

    def __reduce__(self):
        return (type(self), (self.group, self.cls, self.rank, self.stuck, self.method, self.cause,
                             self.grace_s))


class CallTimeoutError(TimeoutError):
    """A remote_function call did not finish within its ``timeout``.

    ``ranks`` lists the gang ranks that had not answered.
    """

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self):
        return (type(self), (self.args[0], self.ranks))


def dead_worker(text: str) -> tuple[str, str, int, str, str | None] | None:
    """(group, class, rank, gang label, namespace) of the gang worker named in the text of
    Ray's ActorDiedError, or None if it names none.

    Worker actors are named ``label/rank`` with label ``group/Class`` (``Class-2``
    for a second gang of the class on the group; ``#n`` follows the rank after
    restarts). The label is also the gang dispatcher's actor name.

    >>> dead_worker("The actor died...\\n\\tname: sampler/Sampler-2/3#1\\n\\tnamespace: rl")
    ('sampler', 'Sampler', 3, 'sampler/Sampler-2', 'rl')
    """
    name = namespace = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("name:"):
            name = s[5:].strip()
        elif s.startswith("namespace:"):
            namespace = s[10:].strip()
    parts = (name or "").split("/")
    if len(parts) != 3 or not parts[2].split("#")[0].isdigit():
        return None
    group, label_cls, rank = parts
    cls = label_cls.rsplit("-", 1)[0] if label_cls.rsplit("-", 1)[-1].isdigit() else label_cls
    return group, cls, int(rank.split("#")[0]), f"{group}/{label_cls}", namespace


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
