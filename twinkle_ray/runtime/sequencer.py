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
import itertools
import logging
from collections.abc import AsyncIterator

from .aio import quiet

logger = logging.getLogger(__name__)

TURN_WAIT_S = 60.0  # how long a call waits for its caller's previous call to arrive
# The turn table keeps the entries of this many callers, those whose turns ended last; older
# ones are dropped (every unpickled proxy copy is a caller: their number has no bound). See
# Sequencer.wait for why a dropped caller's next call still comes after its previous one.
TURN_CALLERS_KEPT = 256
# Once one of a caller's calls is known never to arrive, how long an earlier one of its calls
# that has not arrived either is waited for before it is taken as lost too: the call that would
# have told of it was lost with it. Calls on their way arrive within milliseconds.
GAP_GRACE_S = 2.0
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
        # caller id -> numbers at or past its next turn that will never arrive (``skip``)
        self._lost: dict[str, set[int]] = {}
        # (caller id, number) of the calls holding their turn now
        self._in_turn: set[tuple[str, int]] = set()

    @contextlib.asynccontextmanager
    async def turn(self, turn: tuple | None) -> AsyncIterator[None]:
        """Hold the caller's turn: wait until its previous call was submitted, and pass the
        turn on when the body ends (whatever happened in it). None: no order to keep.

        ``turn`` is (caller id, number[, [previous call's ref] or SETTLED]): a previous call
        that Ray failed before it reached this actor (its arguments could not be unpickled)
        never takes its turn; its ref settles, and this call goes as soon as the calls before
        that one have had theirs, instead of waiting for it.
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
        """Wait until call ``seq`` of ``caller`` may go: its previous call ended its turn here.

        The rule that bounds the table: only the TURN_CALLERS_KEPT callers whose turns ended
        last keep an entry. A caller without one (new, or dropped) and ``seq > 0`` waits for
        its previous call's settled ref ``prev`` to settle: that call's ``call`` returns only after
        its turn ended, so order holds without the entry (at the cost of that one await); a
        previous call still in its turn wakes this one when it ends (``end``). ``prev`` is
        SETTLED when the caller had the previous call's reply, which this actor sends only once
        that call's turn ended: no wait then, with or without an entry.

        A ``prev`` that settles while the caller's entry is still short of ``seq`` never
        arrived (Ray could not unpickle its arguments here): it is skipped, and this call waits
        on for the caller's calls before it (other threads' calls may still be on their way).
        One of those that has not arrived GAP_GRACE_S after that is taken as lost too (the
        call that knew of it was lost with it), unless its caller says so first (``skip``).
        """
        if self._turns.get(caller, 0) >= seq:  # its turn already (the usual case): no wait
            return
        if prev == SETTLED:  # it ended here before its reply went out (its entry since dropped)
            return
        loop = asyncio.get_running_loop()
        fut = self._turn_waiters[(caller, seq)] = loop.create_future()
        settled = asyncio.ensure_future(quiet(prev[0])) if prev and prev[0] is not None else None
        give_up = loop.time() + TURN_WAIT_S
        gap: tuple[int, float] | None = None  # (next number, since when) once a call was lost
        try:
            while True:
                left = give_up - loop.time()
                if left <= 0:
                    logger.warning("gang %s: call %d of caller %s waited %.0fs for its "
                                   "predecessor; going ahead", self.label, seq, caller, TURN_WAIT_S)
                    return
                await asyncio.wait(
                    [t for t in (fut, settled) if t is not None], return_when=asyncio.FIRST_COMPLETED,
                    timeout=left if gap is None else min(left, GAP_GRACE_S))
                if fut.done() or self._turns.get(caller, -1) >= seq:  # its turn (or passed over)
                    return
                if settled is not None and settled.done():
                    settled = None
                    if caller not in self._turns:
                        # An entry dropped (TURN_CALLERS_KEPT), or a first call that never arrived.
                        logger.debug("gang %s: call %d of caller %s: its previous call has "
                                     "settled; going ahead", self.label, seq, caller)
                        return
                    # Settled without taking its turn here: it never arrived.
                    logger.warning("gang %s: call %d of caller %s never reached the dispatcher "
                                   "(its arguments could not be unpickled?); skipped", self.label,
                                   seq - 1, caller)
                    self._mark_lost(caller, [seq - 1])
                    gap = (self._turns[caller], loop.time())
                elif gap is not None:
                    if caller not in self._turns:  # its entry dropped meanwhile (TURN_CALLERS_KEPT)
                        return
                    gap = self._lost_in_gap(caller, seq, gap, loop.time())
                if fut.done() or self._turns.get(caller, -1) >= seq:
                    return
        finally:
            self._turn_waiters.pop((caller, seq), None)
            if settled is not None:
                settled.cancel()

    def _here(self, caller: str, seq: int) -> bool:
        """Whether call ``seq`` of ``caller`` has arrived: in its turn, or waiting for it."""
        return (caller, seq) in self._in_turn or (caller, seq) in self._turn_waiters

    def _lost_in_gap(self, caller: str, seq: int, gap: tuple[int, float],
                     now: float) -> tuple[int, float]:
        """Call ``seq``'s check of its caller's next number ``gap[0]``, waited for since
        ``gap[1]`` after a later call was found lost. When it has neither arrived nor moved for
        GAP_GRACE_S, every number before ``seq`` that has not arrived either is taken as lost,
        at once (those that have go in order). Returns the (number, since) to watch next."""
        nxt = self._turns[caller]
        if nxt != gap[0] or self._here(caller, nxt):
            return nxt, now  # moved on, or here: wait for it
        if now - gap[1] < GAP_GRACE_S:
            return gap
        known = self._lost.get(caller, ())
        missing = [n for n in range(nxt, seq) if n not in known and not self._here(caller, n)]
        logger.warning("gang %s: call(s) %s of caller %s have not reached the dispatcher %gs "
                       "after a later call of it was found lost; taken as lost too", self.label,
                       missing if len(missing) <= 8 else f"{missing[:8]}... ({len(missing)})",
                       caller, GAP_GRACE_S)
        self._mark_lost(caller, missing)
        return self._turns[caller], now

    def skip(self, caller: str, seq: int) -> None:
        """Call ``seq`` of ``caller`` will never arrive (Ray failed it before it reached this
        actor): its turn passes over it. No-op for a number already passed, or a caller without
        an entry (its calls wait on their predecessor's settled ref instead)."""
        self._mark_lost(caller, [seq])

    def _mark_lost(self, caller: str, seqs: list[int]) -> None:
        nxt = self._turns.get(caller)
        if nxt is None:
            return
        seqs = [n for n in seqs if n >= nxt]
        if seqs:
            self._lost.setdefault(caller, set()).update(seqs)
            self._pass_to(caller, nxt, nxt)

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
        self._pass_to(caller, nxt, old)

    def _pass_to(self, caller: str, nxt: int, old: int | None) -> None:
        """The caller's next turn is ``nxt``, or the first number after it not known lost
        (``old``: its number before; None: it had no entry). Set it and wake that call if it
        waits, and any of the caller's calls it passed over (overtaken by one that waited
        TURN_WAIT_S: they go now rather than wait that long too)."""
        lost = self._lost.get(caller)
        if lost:
            while nxt in lost:
                nxt += 1
            lost.difference_update([n for n in lost if n < nxt])
            if not lost:
                del self._lost[caller]
        self._turns[caller] = nxt
        if old is not None and old >= nxt - 1:  # the usual step: only the next call can wait
            woken = [self._turn_waiters.get((caller, nxt))]
        else:
            woken = [f for (c, n), f in self._turn_waiters.items() if c == caller and n <= nxt]
        for fut in woken:
            if fut is not None and not fut.done():
                fut.set_result(None)

    def stats(self) -> dict[str, int]:
        """Sizes of its tables: caller turns, calls waiting for their turn, and numbers known
        lost that a caller's turn has not passed yet."""
        return {"turns": len(self._turns), "turn_waiters": len(self._turn_waiters),
                "lost_turns": sum(map(len, self._lost.values()))}
