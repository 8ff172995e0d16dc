"""Unit tests of coordinator.jobs.signals: per-key one-shot events for watchers."""

from __future__ import annotations

import asyncio

from rankctl.coordinator.jobs.signals import Signals


def test_arm_gives_the_same_unset_event_to_every_watcher_of_a_key_until_notified() -> None:
    signals = Signals()
    first, second = signals.arm("job-1"), signals.arm("job-1")
    assert first is second
    assert not first.is_set()


def test_notify_sets_the_armed_event_and_the_next_arm_gets_a_fresh_one() -> None:
    signals = Signals()
    armed = signals.arm("job-1")
    signals.notify("job-1")
    assert armed.is_set()
    again = signals.arm("job-1")
    assert again is not armed and not again.is_set()


def test_notify_wakes_only_the_key_it_names() -> None:
    signals = Signals()
    one, two = signals.arm("a"), signals.arm("b")
    signals.notify("a")
    assert one.is_set() and not two.is_set()


def test_a_notify_with_no_watcher_is_not_remembered_for_a_later_arm() -> None:
    signals = Signals()
    signals.notify("nobody")
    assert not signals.arm("nobody").is_set()


def test_a_second_notify_does_not_touch_the_event_already_handed_out() -> None:
    signals = Signals()
    armed = signals.arm("k")
    signals.notify("k")
    signals.notify("k")
    assert armed.is_set()
    assert not signals.arm("k").is_set()


def test_wait_returns_true_at_once_for_a_change_that_landed_after_arming() -> None:
    async def main() -> bool:
        signals = Signals()
        event = signals.arm("job")
        signals.notify("job")
        return await Signals.wait(event, 60.0)

    assert asyncio.run(main()) is True


def test_wait_returns_true_when_another_task_notifies_while_it_waits() -> None:
    async def main() -> bool:
        signals = Signals()
        event = signals.arm("job")
        asyncio.get_running_loop().call_soon(signals.notify, "job")
        return await Signals.wait(event, 60.0)

    assert asyncio.run(main()) is True


def test_wait_returns_false_when_the_timeout_passes_without_a_notify() -> None:
    async def main() -> tuple[bool, bool]:
        signals = Signals()
        event = signals.arm("job")
        return await Signals.wait(event, 0), event.is_set()

    assert asyncio.run(main()) == (False, False)


def test_a_notified_event_is_seen_even_with_no_time_left_to_wait() -> None:
    async def main() -> bool:
        signals = Signals()
        event = signals.arm("job")
        signals.notify("job")
        return await Signals.wait(event, 0)

    assert asyncio.run(main()) is True
