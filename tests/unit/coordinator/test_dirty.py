"""The marks of the core's turn (``coordinator.jobs.dirty``): taken once, a refused mark kept without waking, a mark
made outside any operation turning the core on the event loop's next iteration, once."""

from __future__ import annotations

import asyncio

from rankctl.coordinator.jobs.dirty import Dirty


def test_marks_are_taken_once_and_a_tick_mark_stays_timed() -> None:
    dirty = Dirty()
    assert not dirty
    dirty.job("a")
    dirty.job("b", timed=True)
    dirty.job("b")                      # a later plain mark keeps the tick's
    dirty.place()
    assert dirty and dirty.take() == ({"a": False, "b": True}, True)
    assert not dirty and dirty.take() == ({}, False)


def test_a_mark_outside_an_operation_turns_the_core_once_on_the_loops_next_iteration() -> None:
    turns: list[tuple[dict, bool]] = []
    dirty = Dirty(lambda: turns.append(dirty.take()))

    async def main() -> None:
        dirty.job("a")
        dirty.job("b")
        dirty.place()
        assert turns == []              # never inside the caller's own step
        await asyncio.sleep(0)
        assert turns == [({"a": False, "b": False}, True)]
        dirty.retry({"c": True})        # what a refused write left: set aside for the tick, no turn asked for
        dirty.retry_lost(["n1"])
        await asyncio.sleep(0)
        assert len(turns) == 1 and not dirty   # an operation's turn meanwhile retries nothing
        dirty.resume()                  # the tick
        assert dirty and dirty.take_lost() == ["n1"] and dirty.take() == ({"c": True}, False)
    asyncio.run(main())
    assert Dirty().take() == ({}, False)   # no loop: nothing to wake, nothing raised


def test_a_failing_turn_is_logged_and_the_marks_wait_for_the_next() -> None:
    def boom() -> None:
        raise RuntimeError("a bug in a reconcile")

    dirty = Dirty(boom)

    async def main() -> None:
        dirty.job("a")
        await asyncio.sleep(0)
        assert dirty.take() == ({"a": False}, False)
    asyncio.run(main())


def test_a_job_asked_for_later_is_marked_once_at_the_soonest_time() -> None:
    """``later``: a judgement that time alone changes before the tick (a stop held long enough, a hang's limit)
    marks the job then and turns the core; of several asks the soonest is kept, and none without a loop."""
    turns: list[tuple[dict, bool]] = []
    dirty = Dirty(lambda: turns.append(dirty.take()))

    async def main() -> None:
        dirty.later("a", 0.2)
        dirty.later("a", 0.05)          # sooner: kept
        dirty.later("a", 0.1)           # later than the one asked for: dropped
        await asyncio.sleep(0.02)
        assert turns == []
        await asyncio.sleep(0.06)
        assert turns == [({"a": False}, False)]
        await asyncio.sleep(0.2)
        assert turns == [({"a": False}, False)]   # the dropped and the superseded ones mark nothing
    asyncio.run(main())
    Dirty().later("a", 0.1)             # no loop: nothing asked, nothing raised
