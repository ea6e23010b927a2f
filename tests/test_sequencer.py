"""The caller's turn (``runtime.sequencer``), without Ray: each caller's calls in the order it
made them, always (no wait ever ends in going ahead), the bounded table, a call whose caller
already had its predecessor's reply, and a predecessor that never arrives.

Waits here are bounded by ``asyncio.wait_for`` only to turn a hang into a failure; no figure
is timed.
"""

from __future__ import annotations

import asyncio

import pytest

from twinkle_ray.runtime import sequencer
from twinkle_ray.runtime.errors import TurnError
from twinkle_ray.runtime.sequencer import SETTLED, TURN_CALLERS_KEPT, Sequencer

HANG_S = 10.0  # a turn that should go at once and has not by then is waiting for good


async def _take(turns: Sequencer, caller: str, n: int, prev=None, log: list | None = None,
                gate: asyncio.Event | None = None) -> None:
    """Call ``n`` of ``caller``: in its turn, wait for ``gate`` (if given), then note itself."""
    async with turns.turn((caller, n, prev)):
        if gate is not None:
            await gate.wait()
        if log is not None:
            log.append((caller, n))
        await asyncio.sleep(0)


def test_each_callers_calls_take_their_turns_in_the_order_made():
    async def main():
        turns, log = Sequencer("g/C"), []
        # arrive out of order (as Ray may start an async actor's tasks), two callers interleaved
        await asyncio.wait_for(asyncio.gather(
            _take(turns, "a", 2, log=log), _take(turns, "b", 1, log=log), _take(turns, "a", 1, log=log),
            _take(turns, "b", 0, log=log), _take(turns, "a", 0, log=log),
        ), HANG_S)
        return log, turns.stats()

    log, stats = asyncio.run(main())
    assert [n for c, n in log if c == "a"] == [0, 1, 2]
    assert [n for c, n in log if c == "b"] == [0, 1]
    assert stats == {"turns": 2, "turn_waiters": 0, "lost_turns": 0}


def test_a_caller_dropped_from_the_table_goes_at_once_when_it_had_the_previous_reply():
    async def main():
        turns = Sequencer("g/C")
        await _take(turns, "old", 0)
        for i in range(TURN_CALLERS_KEPT):  # other callers push 'old' out of the bounded table
            await _take(turns, f"c{i}", 0)
        assert turns.stats()["turns"] == TURN_CALLERS_KEPT
        log: list = []
        # its reply to call 0 came back: call 1 says SETTLED and must not wait for an entry
        await asyncio.wait_for(_take(turns, "old", 1, SETTLED, log), HANG_S)
        return log, turns.stats()

    log, stats = asyncio.run(main())
    assert log == [("old", 1)]
    assert stats["turns"] == TURN_CALLERS_KEPT and stats["turn_waiters"] == 0


def test_a_call_waits_for_its_predecessor_still_in_its_turn():
    async def main():
        turns, log = Sequencer("g/C"), []
        gate = asyncio.Event()

        async def slow_first():
            async with turns.turn(("a", 0, None)):
                await gate.wait()
                log.append(0)

        first = asyncio.ensure_future(slow_first())
        await asyncio.sleep(0)
        # call 1 of the same caller while call 0 holds the turn: it waits until call 0 ends
        second = asyncio.ensure_future(_take(turns, "a", 1, [None], log))
        await asyncio.sleep(0.05)
        assert log == [] and not second.done()
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), HANG_S)
        return log

    assert asyncio.run(main()) == [0, ("a", 1)]


def _lost() -> asyncio.Future:
    """A previous call's settled ref that failed: Ray could not unpickle that call's arguments
    in the dispatcher, so it never arrived."""
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(RuntimeError("could not unpickle"))
    return fut


@pytest.mark.parametrize("first", [0, 5], ids=["new-caller", "known-caller"])
def test_a_call_after_one_that_never_arrived_still_waits_for_the_calls_before_that(first):
    # Threads sharing a proxy: call `first` (another thread's) still holds the caller's turn,
    # the next one never arrived, the one after it arrives. Before, that one went at once,
    # ahead of the call still in its turn.
    async def main():
        turns, log = Sequencer("g/C"), []
        for n in range(first):
            await _take(turns, "a", n)
        gate = asyncio.Event()

        held = asyncio.ensure_future(_take(turns, "a", first, SETTLED, log, gate))
        await asyncio.sleep(0)
        later = asyncio.ensure_future(_take(turns, "a", first + 2, [_lost()], log))
        await asyncio.sleep(0.1)
        assert log == [] and not later.done()
        gate.set()
        await asyncio.wait_for(asyncio.gather(held, later), HANG_S)
        return log, turns.stats()

    log, stats = asyncio.run(main())
    assert log == [("a", first), ("a", first + 2)]
    assert stats == {"turns": 1, "turn_waiters": 0, "lost_turns": 0}


def test_a_call_waiting_on_one_that_never_arrives_fails_and_never_overtakes(monkeypatch, caplog):
    # Calls 1 and 2 never arrived; call 3 knows of call 2 only (its predecessor's settled ref):
    # call 2 is passed over (it ran nowhere), and call 3 waits for call 1. Past TURN_MISSING_S
    # it fails, naming call 1 and the wait, and does not run: it never goes ahead of call 1.
    monkeypatch.setattr(sequencer, "TURN_MISSING_S", 0.3)

    async def main():
        turns, log = Sequencer("g/C"), []
        await _take(turns, "a", 0)
        with pytest.raises(TurnError, match=r"call 3 of caller a waited 0s for the caller's call 1, "
                                            r"which never reached the dispatcher"):
            await asyncio.wait_for(_take(turns, "a", 3, [_lost()], log), HANG_S)
        assert log == []
        # call 1 arrives after all: it runs, and the caller's calls go on in order (2 was lost)
        await asyncio.wait_for(_take(turns, "a", 1, SETTLED, log), HANG_S)
        await asyncio.wait_for(_take(turns, "a", 4, SETTLED, log), HANG_S)
        return log, turns.stats()

    log, stats = asyncio.run(main())
    assert log == [("a", 1), ("a", 4)]
    assert stats == {"turns": 1, "turn_waiters": 0, "lost_turns": 0}
    assert "call 2 of caller a never reached the dispatcher; passed over" in caplog.text


def test_a_long_wait_for_a_call_that_is_here_never_ends_in_going_ahead(monkeypatch):
    # Guards against: a call that waited 60 s (its predecessor held its turn, awaiting a producer
    # being rebuilt) went ahead of it. A predecessor that is here is waited for, however long.
    monkeypatch.setattr(sequencer, "TURN_MISSING_S", 0.05)

    async def main():
        turns, log = Sequencer("g/C"), []
        gate = asyncio.Event()
        held = asyncio.ensure_future(_take(turns, "a", 0, None, log, gate))
        await asyncio.sleep(0)
        later = asyncio.ensure_future(_take(turns, "a", 1, [None], log))
        await asyncio.sleep(0.5)  # ten times the bound for a missing call
        assert log == [] and not later.done()
        gate.set()
        await asyncio.wait_for(asyncio.gather(held, later), HANG_S)
        return log

    assert asyncio.run(main()) == [("a", 0), ("a", 1)]


def test_a_call_holding_its_turn_past_the_bound_is_not_taken_as_missing(monkeypatch):
    monkeypatch.setattr(sequencer, "TURN_MISSING_S", 0.05)

    async def main():
        turns, log = Sequencer("g/C"), []
        await _take(turns, "a", 0)

        async def slow_second():
            async with turns.turn(("a", 1, SETTLED)):
                await asyncio.sleep(0.4)  # eight bounds
                log.append(("a", 1))

        second = asyncio.ensure_future(slow_second())
        await asyncio.sleep(0)
        # call 2 never arrived; call 3 waits for call 1, here and in its turn, however long
        await asyncio.wait_for(asyncio.gather(second, _take(turns, "a", 3, [_lost()], log)), HANG_S)
        return log

    assert asyncio.run(main()) == [("a", 1), ("a", 3)]


def test_a_full_table_keeps_the_entry_of_a_caller_with_a_call_here(monkeypatch):
    monkeypatch.setattr(sequencer, "TURN_CALLERS_KEPT", 2)

    async def main():
        turns, log = Sequencer("g/C"), []
        await _take(turns, "a", 0)
        gate = asyncio.Event()

        held = asyncio.ensure_future(_take(turns, "a", 1, SETTLED, log, gate))
        await asyncio.sleep(0)
        later = asyncio.ensure_future(_take(turns, "a", 3, [_lost()], log))  # call 2 lost
        for other in ("x", "y", "z"):  # other callers' turns fill the table
            await _take(turns, other, 0)
        await asyncio.sleep(0.05)
        assert log == [] and not later.done()  # 'a' kept its entry: call 3 waits for call 1
        gate.set()
        await asyncio.wait_for(asyncio.gather(held, later), HANG_S)
        return log

    assert asyncio.run(main()) == [("a", 1), ("a", 3)]
