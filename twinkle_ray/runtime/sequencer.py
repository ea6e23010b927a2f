"""The caller's turn: each caller's calls are taken in the order it made them.

Ray may start an async actor's tasks out of order, so the dispatcher takes
every call inside its caller's turn: call ``n`` of a caller goes only once
call ``n - 1`` of that caller ended its turn. The gang's one order (every rank
gets the calls of all callers in the order they are submitted) follows.

The table is bounded: only the ``TURN_CALLERS_KEPT`` callers whose turns
ended last keep an entry (every unpickled proxy copy is a caller: their
number has no bound). A caller without an entry waits for its previous
call's settled ref instead, or goes at once when its caller already had
that call's reply (``SETTLED``; see :meth:`Sequencer.wait`).

Example::

    turns = Sequencer("trainer/Model")
    async with turns.turn(("caller-id", 0, None)):
        ...submit the call...
    turns.stats()        # {'turns': 1, 'turn_waiters': 0}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from .aio import quiet

logger = logging.getLogger(__name__)

TURN_WAIT_S = 60.0  # how long a call waits for its caller's previous call to arrive
# The turn table keeps the entries of this many callers, those whose turns ended last; older
# ones are dropped (every unpickled proxy copy is a caller: their number has no bound). See
# Sequencer.wait for why a dropped caller's next call still comes after its previous one.
TURN_CALLERS_KEPT = 256
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

    @contextlib.asynccontextmanager
    async def turn(self, turn: tuple | None) -> AsyncIterator[None]:
        """Hold the caller's turn: wait until its previous call was submitted, and pass the
        turn on when the body ends (whatever happened in it). None: no order to keep.

        ``turn`` is (caller id, number[, [previous call's ref] or SETTLED]): a previous call
        that Ray failed before it reached this actor (its arguments could not be unpickled)
        never takes its turn; its ref settles, and this call goes ahead at once instead of
        waiting for it.
        """
        if turn is None:
            yield
            return
        await self.wait(turn[0], turn[1], turn[2] if len(turn) > 2 else None)
        try:
            yield
        finally:
            self.end(turn[0], turn[1])

    async def wait(self, caller: str, seq: int, prev: list | str | None = None) -> None:
        """Wait until call ``seq`` of ``caller`` may go: its previous call ended its turn here.

        The rule that bounds the table: only the TURN_CALLERS_KEPT callers whose turns ended
        last keep an entry. A caller without one (new, or dropped) and ``seq > 0`` waits for
        its previous call's settled ref ``prev`` to settle: that call's ``call`` returns only after
        its turn ended, so order holds without the entry (at the cost of that one await); a
        previous call still in its turn wakes this one when it ends (``end``). ``prev`` is
        SETTLED when the caller had the previous call's reply, which this actor sends only once
        that call's turn ended: no wait then, with or without an entry.
        """
        if self._turns.get(caller, 0) >= seq:  # its turn already (the usual case): no wait
            return
        if prev == SETTLED:  # it ended here before its reply went out (its entry since dropped)
            return
        fut = self._turn_waiters[(caller, seq)] = asyncio.get_running_loop().create_future()
        settled = asyncio.ensure_future(quiet(prev[0])) if prev and prev[0] is not None else None
        try:
            done, _ = await asyncio.wait([t for t in (fut, settled) if t is not None],
                                         timeout=TURN_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
            if fut in done:
                return
            if settled is not None and settled in done and caller not in self._turns:
                # An entry dropped (TURN_CALLERS_KEPT), or a previous call that never arrived.
                logger.debug("gang %s: call %d of caller %s: its previous call has settled; "
                             "going ahead", self.label, seq, caller)
                return
            if settled is not None and settled in done and self._turns[caller] < seq:
                # Settled without taking its turn here: it never arrived. Skip it.
                logger.warning("gang %s: call %d of caller %s never reached the dispatcher (its "
                               "arguments could not be unpickled?); call %d goes ahead",
                               self.label, seq - 1, caller, seq)
                self._turns[caller] = seq
                return
            if not done:
                logger.warning("gang %s: call %d of caller %s waited %.0fs for its predecessor; "
                               "going ahead", self.label, seq, caller, TURN_WAIT_S)
        finally:
            self._turn_waiters.pop((caller, seq), None)
            if settled is not None:
                settled.cancel()

    def end(self, caller: str, seq: int) -> None:
        """Call ``seq`` of ``caller`` ended its turn: its next call may go. The caller's entry
        moves to the end of the table; the oldest beyond TURN_CALLERS_KEPT are dropped."""
        nxt = max(self._turns.pop(caller, 0), seq + 1)
        self._turns[caller] = nxt
        while len(self._turns) > TURN_CALLERS_KEPT:
            del self._turns[next(iter(self._turns))]
        fut = self._turn_waiters.get((caller, nxt))
        if fut is not None and not fut.done():
            fut.set_result(None)

    def stats(self) -> dict[str, int]:
        """Sizes of its tables: caller turns, and calls waiting for their turn."""
        return {"turns": len(self._turns), "turn_waiters": len(self._turn_waiters)}

