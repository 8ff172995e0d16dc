"""A daemon's side of a restart in place (``worker.runs.inplace``), without processes: a newer attempt's Assign
waits for the older attempt's ranks to go, and a Cancel meanwhile keeps the new ranks from ever starting."""

from __future__ import annotations

import asyncio

import structlog

from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.runs.inplace import InPlace
from rankctl.worker.runs.runstate import RunState


class FakeRuns:
    def __init__(self, runs: list[RunState]) -> None:
        self.runs, self.continued = runs, []

    def supersede(self, job_id: str, before: int) -> list[RunState]:
        older = [r for r in self.runs if r.job_id == job_id and r.attempt < before and r.alive]
        for r in older:
            r.superseded = True
        return older

    def continue_stopped(self, job_id: str) -> None:
        self.continued.append(job_id)


class World:
    def __init__(self, runs: list[RunState]) -> None:
        self.runs, self.killed, self.admitted, self.reports = FakeRuns(runs), [], [], []
        self.inplace = InPlace(node="n0", runs=self.runs, kill=self.kill, admit=self.admit, outbox=self,
                               log=structlog.get_logger("test"))

    async def kill(self, job_id: str, attempt: int) -> None:
        self.killed.append((job_id, attempt))

    async def admit(self, msg: pb.Assign) -> None:
        self.admitted.append((msg.job_id, msg.attempt, [sorted(r.alive) for r in self.runs.runs]))

    def report(self, job_id: str, attempt: int, status: pb.RankStatus) -> None:
        self.reports.append((job_id, attempt, status))


def attempt_1(alive: set[int]) -> RunState:
    """Attempt 1 of job j on this node (ranks 2 and 3), with ``alive`` of them still running."""
    return RunState(job_id="j", attempt=1, run_dir="/x", ranks={2, 3}, alive=alive)


def assign(attempt: int) -> pb.Assign:
    return pb.Assign(job_id="j", attempt=attempt, first_rank=2, rank_count=2, world_size=4)


def test_the_new_ranks_start_only_once_the_older_attempts_are_gone() -> None:
    async def main() -> None:
        old = attempt_1(alive={2, 3})
        w = World([old])
        assert w.inplace.assign(assign(2))
        await asyncio.sleep(0.1)
        assert w.killed == [("j", 1)] and w.runs.continued == ["j"] and old.superseded and not w.admitted
        # a registration meanwhile names attempt 2 as this node's: it is on its way, not missing
        assert [(r.job_id, r.attempt, list(r.ranks)) for r in w.inplace.waiting()] == [("j", 2, [2, 3])]
        old.alive.clear()                                  # the launcher reported both exits
        await asyncio.sleep(0.1)
        assert w.admitted == [("j", 2, [[]])] and not w.reports and not w.inplace.waiting()
        assert not w.inplace.assign(assign(3))             # nothing older alive: the daemon admits it itself
    asyncio.run(main())


def test_no_older_attempt_alive_is_admitted_by_the_caller() -> None:
    async def main() -> None:
        w = World([attempt_1(alive=set())])
        assert not w.inplace.assign(assign(2)) and not w.killed
    asyncio.run(main())


def test_a_cancel_while_the_old_ranks_go_keeps_the_new_ones_from_starting() -> None:
    async def main() -> None:
        old = attempt_1(alive={2, 3})
        w = World([old])
        assert w.inplace.assign(assign(2))
        assert w.inplace.assign(assign(3))                 # a later Assign of the job waits behind the first
        await asyncio.sleep(0.05)
        w.inplace.cancel(pb.Cancel(job_id="j", attempt=3, reason="cancelled"))
        assert not w.inplace.waiting()                     # cancelled: no longer this node's to run
        old.alive.clear()
        await asyncio.sleep(0.1)
        assert not w.admitted
        assert [(a, s.rank, s.exited) for _, a, s in w.reports] == [(2, 2, True), (2, 3, True), (3, 2, True),
                                                                     (3, 3, True)]
        assert all("was cancelled before its ranks started on node n0" in s.error for _, _, s in w.reports)
        assert not w.inplace.assign(assign(4))             # the chain is over: nothing waits any more
    asyncio.run(main())


def test_a_cancel_of_an_older_attempt_does_not_stop_the_newer_ones_start() -> None:
    async def main() -> None:
        old = attempt_1(alive={2, 3})
        w = World([old])
        assert w.inplace.assign(assign(2))
        w.inplace.cancel(pb.Cancel(job_id="j", attempt=1, reason="late"))
        old.alive.clear()
        await asyncio.sleep(0.1)
        assert [a for _, a, _ in w.admitted] == [2] and not w.reports
    asyncio.run(main())


def test_a_cancelled_attempt_is_remembered_for_an_assign_that_comes_after_its_cancel() -> None:
    """A relayed Assign can come after the Cancel of its attempt (``worker.uplink.relay``): the node remembers the Cancel,
    whether or not an Assign of the job was waiting when it came."""
    w = World([])
    w.inplace.cancel(pb.Cancel(job_id="j", attempt=3))
    assert w.inplace.cancelled("j", 3) and w.inplace.cancelled("j", 2)
    assert not w.inplace.cancelled("j", 4) and not w.inplace.cancelled("k", 1)
    w.inplace.cancel(pb.Cancel(job_id="other"))   # every attempt
    assert w.inplace.cancelled("other", 7)
    w.inplace.cancel(pb.Cancel(job_id="j", attempt=1))   # an older one does not lower it
    assert w.inplace.cancelled("j", 3)
