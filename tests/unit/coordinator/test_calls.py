"""The request/watch/release machine the allocations of jobs and the worker pools share (``coordinator.batch.calls``),
as values over a fake clock: no scheduler, no store."""

from __future__ import annotations

from dataclasses import replace

from rankctl.coordinator.batch.calls import RELEASE_GRACE_S, WATCH_S, Calls
from rankctl.coordinator.model.allocation import Allocation, AllocationRequest, Ask


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def ask(a: Allocation):  # noqa: ANN201 - the Ask factory ``next`` calls when a request is due
    return lambda: Ask("j", "j", a, 2, 2, "127.0.0.1:1")


def test_a_request_once_in_flight_again_only_a_watch_period_after_a_call_that_could_not_be_made() -> None:
    clock = Clock()
    calls = Calls(clock)
    a = Allocation(request=AllocationRequest(), pool="j-a1")
    work = calls.next("j", a, ask(a))
    assert work is not None and work.action == "request" and work.ask.nodes == 2
    assert calls.next("j", a, ask(a)) is None                  # in flight: never twice at once
    calls.answered(work)
    calls.failed(work)                                         # sbatch could not reach the controller
    assert calls.next("j", a, ask(a)) is None                  # not again at once ...
    clock.t += WATCH_S
    assert calls.next("j", a, ask(a)).action == "request"      # ... but WATCH_S later


def test_a_watch_every_period_at_once_after_watch_now_and_a_release_after_the_grace() -> None:
    clock = Clock()
    calls = Calls(clock)
    a = Allocation(request=AllocationRequest(), pool="j-a1", id="77", state="RUNNING")
    work = calls.next("j", a, ask(a))
    assert work.action == "watch"
    calls.answered(work), calls.seen(work)
    assert calls.next("j", a, ask(a)) is None
    calls.watch_now("j", a.number)                             # a node of it was lost: did it all end?
    assert calls.next("j", a, ask(a)).action == "watch"
    calls.answered(work), calls.seen(work)
    released = replace(a, released=True)
    calls.told_to_exit("j", a.number)
    clock.t += RELEASE_GRACE_S - 1
    watch = calls.next("j", released, ask(released))           # its workers may still exit by themselves: watched
    assert watch.action == "watch"
    calls.answered(watch), calls.seen(watch)
    clock.t += 1
    rel = calls.next("j", released, ask(released))
    assert rel.action == "release"
    calls.answered(rel), calls.released(rel)
    assert calls.next("j", released, ask(released)).action == "watch"   # released once; the watch sees it end
    renewed = replace(a, number=2, id="", state="REQUESTING")
    assert calls.next("j", renewed, ask(renewed)).action == "request"   # another allocation: its own timers
