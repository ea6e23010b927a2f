"""The caller's turn: each caller's calls are taken in the order it made them. Always.

Ray may start an async actor's tasks out of order, so the dispatcher takes every call
inside its caller's turn: call ``n`` of a caller goes only once call ``n - 1`` of that
caller ended its turn. The gang's one order (every rank gets the calls of all callers in
the order they are submitted) follows. **Order is never traded for liveness**: a call
waits for its caller's earlier call however long that one takes (a producer being
rebuilt, a long stuck check); there is no time after which it goes ahead.

A wait ends in one of three ways: the earlier call ends its turn; or the earlier call's
*settled ref* (the second return of ``Dispatcher.call``, which every call carries of its
predecessor) settles without that call having taken its turn here: Ray failed that call
before it reached this actor, so it never ran anywhere, and it is passed over (the later
call overtakes nothing); or an earlier call has not reached this actor at all within
``TURN_MISSING_S``: then the waiting call fails with a :class:`TurnError` naming the call it
waited for and for how long, and does not run. A call that is here, in its turn or waiting
for its own, is waited for however long it takes.

The table is bounded: only the ``TURN_CALLERS_KEPT`` callers whose turns ended last keep
an entry (every unpickled proxy copy is a caller: their number has no bound). A caller
without an entry waits for its previous call's settled ref instead, or goes at once when
its caller already had that call's reply (``SETTLED``; see :meth:`Sequencer.wait`).

Example::

    turns = Sequencer("trainer/Model")
    async with turns.turn(("caller-id", 0, None)):
        ...submit the call...
    turns.stats()        # {'turns': 1, 'turn_waiters': 0, 'lost_turns': 0}
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

from .aio import quiet
from .errors import TurnError

logger = logging.getLogger(__name__)

# The turn table keeps the entries of this many callers, those whose turns ended last; older
# ones are dropped (every unpickled proxy copy is a caller: their number has no bound). See
# Sequencer.wait for why a dropped caller's next call still comes after its previous one.
TURN_CALLERS_KEPT = 256
# How long a call waits for an earlier call of its caller that has not reached this actor at
# all (calls on their way arrive within milliseconds) before it fails (TurnError), unrun.
TURN_MISSING_S = 300.0
# What a call says of its caller's previous call when the caller already had that call's reply:
# it ended its turn here (so nothing to wait for, and no ref to send: a ref nested in a call's
# arguments costs both sides Ray's borrowing protocol).
SETTLED = "settled"


class Sequencer:
    """The turn table of one gang's callers (plain Python, owned by its dispatcher)."""

    def __init__(self, label: str):
        self.label = label
        # caller id -> number of its next call, least recently ended first (TURN_CALLERS_KEPT)
        self._turns: dict[str, int] = {}
        # (caller id, number) -> future of a call that arrived before its predecessor ended:
        # ending a turn wakes exactly the caller's next call, not every waiting one.
        self._turn_waiters: dict[tuple[str, int], asyncio.Future] = {}
        # caller id -> numbers at or past its next turn that will never arrive
        self._lost: dict[str, set[int]] = {}
        # (caller id, number) of the calls holding their turn now
        self._in_turn: set[tuple[str, int]] = set()

    @contextlib.asynccontextmanager
    async def turn(self, turn: tuple | None) -> AsyncIterator[None]:
        """Hold the caller's turn: wait until its previous call ended its turn, and pass the
        turn on when the body ends (whatever happened in it). None: no order to keep.

        ``turn`` is (caller id, number[, [previous call's settled ref] or SETTLED]).
        """
        if turn is None:
            yield
            return
        caller, seq = turn[0], turn[1]
        await self.wait(caller, seq, turn[2] if len(turn) > 2 else None)
        self._turns.setdefault(caller, seq)  # a new caller's entry: its later calls wait for it
        self._in_turn.add((caller, seq))
        try:
            yield
        finally:
            self._in_turn.discard((caller, seq))
            self.end(caller, seq)

    async def wait(self, caller: str, seq: int, prev: list | str | None = None) -> None:
        """Wait until call ``seq`` of ``caller`` may go: its previous call ended its turn here,
        or is known never to arrive (see the module docstring).

        A caller without an entry (new, or dropped: TURN_CALLERS_KEPT) and ``seq > 0`` waits for
        its previous call's settled ref ``prev``: that call's ``call`` returns only after its
        turn ended, so order holds without the entry; a previous call still in its turn wakes
        this one when it ends (``end``). ``prev`` is SETTLED when the caller had the previous
        call's reply, which this actor sends only once that call's turn ended: no wait then.
        """
        if self._turns.get(caller, 0) >= seq:  # its turn already (the usual case): no wait
            return
        if prev == SETTLED:  # it ended here before its reply went out (its entry since dropped)
            return
        loop = asyncio.get_running_loop()
        fut = self._turn_waiters[(caller, seq)] = loop.create_future()
        settled = asyncio.ensure_future(quiet(prev[0])) if prev and prev[0] is not None else None
        missing: tuple[int, float] | None = None  # (an earlier call not here, since when)
        try:
            while True:
                timeout = None
                gap = self._missing(caller, seq)
                if gap is not None:
                    if missing is None or missing[0] != gap:
                        missing = (gap, loop.time())
                    waited = loop.time() - missing[1]
                    if waited >= TURN_MISSING_S:
                        raise TurnError(
                            f"gang {self.label}: call {seq} of caller {caller} waited {waited:.0f}s "
                            f"for the caller's call {gap}, which never reached the dispatcher; "
                            f"calls never overtake each other, so this one did not run")
                    timeout = TURN_MISSING_S - waited
                else:
                    missing = None
                await asyncio.wait([t for t in (fut, settled) if t is not None], timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
                if fut.done() or self._turns.get(caller, -1) >= seq:  # its turn (or passed over)
                    return
                if settled is not None and settled.done():
                    settled = None
                    if caller not in self._turns:  # an entry dropped, or a first call lost
                        return
                    # Settled without taking its turn here: Ray failed it before it arrived.
                    logger.warning("gang %s: call %d of caller %s never reached the dispatcher; "
                                   "passed over (it ran nowhere)", self.label, seq - 1, caller)
                    self._mark_lost(caller, seq - 1)
        finally:
            self._turn_waiters.pop((caller, seq), None)
            if settled is not None:
                settled.cancel()

    def _missing(self, caller: str, seq: int) -> int | None:
        """The first of the caller's calls before ``seq`` that has not reached this actor (not
        in its turn, not waiting for it, not known lost), if its entry says which those are."""
        nxt = self._turns.get(caller)
        if nxt is None:
            return None
        lost = self._lost.get(caller, ())
        return next((n for n in range(nxt, seq) if n not in lost and (caller, n) not in
                     self._in_turn and (caller, n) not in self._turn_waiters), None)

    def _mark_lost(self, caller: str, seq: int) -> None:
        nxt = self._turns.get(caller)
        if nxt is not None and seq >= nxt:
            self._lost.setdefault(caller, set()).add(seq)
            self._pass_to(caller, nxt)

    def end(self, caller: str, seq: int) -> None:
        """Call ``seq`` of ``caller`` ended its turn: its next call may go. The caller's entry
        moves to the end of the table; the oldest beyond TURN_CALLERS_KEPT are dropped, except
        callers with a call here (in its turn or waiting for it)."""
        old = self._turns.pop(caller, None)
        nxt = max(old or 0, seq + 1)
        self._turns[caller] = nxt
        excess = len(self._turns) - TURN_CALLERS_KEPT
        if excess > 0:
            here = {c for c, _ in self._in_turn} | {c for c, _ in self._turn_waiters} | {caller}
            for dropped in list(itertools.islice((c for c in self._turns if c not in here), excess)):
                del self._turns[dropped]
                self._lost.pop(dropped, None)
        self._pass_to(caller, nxt)

    def _pass_to(self, caller: str, nxt: int) -> None:
        """The caller's next turn is ``nxt``, or the first number after it not known lost: set
        it, and wake that call if it waits."""
        lost = self._lost.get(caller)
        if lost:
            while nxt in lost:
                nxt += 1
            lost.difference_update([n for n in lost if n < nxt])
            if not lost:
                del self._lost[caller]
        self._turns[caller] = nxt
        fut = self._turn_waiters.get((caller, nxt))
        if fut is not None and not fut.done():
            fut.set_result(None)

    def stats(self) -> dict[str, int]:
        """Sizes of its tables: caller turns, calls waiting for their turn, and numbers known
        lost that a caller's turn has not passed yet."""
        return {"turns": len(self._turns), "turn_waiters": len(self._turn_waiters),
                "lost_turns": sum(map(len, self._lost.values()))}
