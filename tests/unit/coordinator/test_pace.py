"""The hang judgement (``coordinator.diagnosis.pace``): certain evidence at once, uncertain at the bound; pure."""

from __future__ import annotations

import pytest

from rankctl.coordinator.diagnosis.pace import (
    DEADLOCK, DEADLOCK_HOLD_S, EVIDENCE_GRACE_S, LEARN_FACTOR, LINK, NAMING_EVIDENCE, STOP_HOLD_S, STOPPED,
    UNCERTAIN, Learned, Pace,
)

WAITING = '{"still_s":2.0,"groups":[{"kind":"tp","members":[0,1],"size":2,"entered":9,"in":true}]}'
OUTSIDE = '{"still_s":2.0,"groups":[{"kind":"tp","members":[0,1],"size":2,"entered":8,"in":false}]}'
COMPUTING = '{"still_s":2.0,"computing":true,"groups":[{"kind":"tp","members":[0,1],"size":2,"entered":8}]}'
SPINNING = '{"still_s":2.0,"spinning":true,"groups":[{"kind":"tp","members":[0,1],"size":2,"entered":8}]}'
SAVING = '{"still_s":2.0,"activity":"checkpoint","groups":[]}'
LOSING = '{"still_s":2.0,"lost":2,"groups":[{"kind":"dp","members":[0,2],"size":2,"entered":9,"in":true}]}'
MOVED = '{"moved":true}'


def moving(at: float = 100.0) -> Pace:
    p = Pace()
    p.step_completed(5, at)
    return p


@pytest.mark.parametrize("laggard", [OUTSIDE, COMPUTING, SPINNING, SAVING])
def test_a_live_rank_outside_collectives_is_uncertain_and_acted_on_only_at_the_hang_timeout(laggard: str) -> None:
    """Rank 0 waits in its all-reduce for rank 1, which sleeps, computes, spins or saves: named, but no action
    before restart.hang_timeout (raising it raises the bound), counted from when the job last moved."""
    p = moving()
    p.evidence(0, WAITING, "stack", now=101.0)
    assert p.judge(500.0, 300, live=2, step=5) is None          # rank 1 sent nothing: it may be moving
    p.evidence(1, laggard, "stack", now=101.0)
    assert p.nameable(101.0) == 0.0
    assert p.judge(399.0, 300, live=2, step=5) is None
    verdict = p.judge(401.0, 300, live=2, step=5)
    assert verdict is not None and verdict.kind == UNCERTAIN and not verdict.certain
    assert "restart.hang_timeout=300" in verdict.rule
    assert p.judge(401.0, 600, live=2, step=5) is None         # hang_timeout: 600 raises it
    assert p.due(200.0, 300, live=2) == pytest.approx(200.01)
    p.evidence(1, MOVED, now=402.0)                             # it went on: the job moved
    assert p.judge(600.0, 300, live=2, step=5) is None and p.quiet_since == 402.0


def test_the_quiet_clock_starts_at_the_latest_stillness_its_daemons_measured_and_never_from_zero() -> None:
    p = Pace()                                                  # nothing seen move yet (a rebuilt attempt)
    p.evidence(0, WAITING, now=10.0)
    p.evidence(1, OUTSIDE, now=10.0)
    assert p.quiet_since is None and p.judge(1.8e9, 300, live=2, step=1) is None
    q = moving(at=100.0)
    q.evidence(0, WAITING, now=500.0)                           # still for 2 s when sent: still since 498
    q.evidence(1, OUTSIDE, now=450.0)
    assert q.quiet_since == 498.0
    assert q.judge(798.0, 300, live=2, step=5) is None and q.judge(798.1, 300, live=2, step=5) is not None
    q.discount(5.0)                                             # the coordinator's loop stood still 5 s
    assert q.judge(802.0, 300, live=2, step=5) is None


def test_a_pause_the_job_survived_raises_what_it_tolerates_and_a_step_that_died_uncertain_is_spared() -> None:
    learned = Learned()
    p = Pace(learned=learned)
    p.step_completed(1, 0.0)
    p.evidence(0, WAITING, now=1.0)
    p.evidence(1, OUTSIDE, now=1.0)
    assert p.judge(8.0, 10, live=2, step=1) is None             # an 8 s save, rank 0 waiting
    p.step_completed(2, 8.0)                                    # survived
    assert learned.pauses == {"asleep": 8.0}
    assert learned.bound("asleep", 10) == LEARN_FACTOR * 8.0 and learned.bound("computing", 10) == 10
    p.evidence(0, WAITING, now=9.0)
    p.evidence(1, OUTSIDE, now=9.0)
    assert p.judge(8.0 + 12.0, 10, live=2, step=2) is None      # a 12 s save later: within 16 s
    verdict = p.judge(8.0 + 16.5, 10, live=2, step=2)
    assert verdict is not None and "raised from 10 s by a asleep pause of 8.0 s" in verdict.rule
    p.spared = {2}                                              # an earlier attempt died so at step 2
    assert p.judge(8.0 + 100.0, 10, live=2, step=2) is None


def test_a_stop_held_about_a_second_is_certain_and_the_pauses_are_spared() -> None:
    """A stopped rank (its daemon confirmed it) held STOP_HOLD_S is certain, once the peers' evidence is in or
    EVIDENCE_GRACE_S more passed; a shorter stop, a traced rank and the whole job stopped are pauses. It needs no
    step reported (a plain script)."""
    p = Pace()
    p.process(3, "stopped", now=50.0)
    assert p.judge(50.0 + STOP_HOLD_S - 0.1, 300, live=4, step=0) is None
    assert p.due(50.0 + STOP_HOLD_S - 0.1, 300, live=4) == pytest.approx(0.1)
    assert p.judge(50.0 + STOP_HOLD_S + 0.1, 300, live=4, step=0) is None          # peers not heard yet
    verdict = p.judge(50.0 + STOP_HOLD_S + EVIDENCE_GRACE_S + 0.1, 300, live=4, step=0)
    assert verdict is not None and verdict.kind == STOPPED and verdict.certain
    for r in (0, 1, 2):
        p.evidence(r, WAITING)
    assert p.judge(50.0 + STOP_HOLD_S + 0.1, 300, live=4, step=0) is not None      # every rank heard: at once
    p.process(3, "", now=51.0)
    assert p.judge(52.0, 300, live=4, step=0) is None and p.stop_held(52.0) is None
    p.process(3, "traced", now=53.0)                            # a debugger: never acted on
    assert p.judge(1000.0, 300, live=4, step=0) is None
    p.process(3, "", now=81.0)
    for r in range(4):                                          # the whole job stopped together: a suspend
        p.process(r, "stopped", now=90.0)
    assert p.judge(95.0, 300, live=4, step=0) is None
    p.process(1, "", now=95.0)                                  # it ends, one report before the others':
    assert p.judge(95.1, 300, live=4, step=0) is None           # those still stopped are stopped from now on
    assert p.judge(95.0 + STOP_HOLD_S + EVIDENCE_GRACE_S, 300, live=4, step=0) is not None


def test_a_stop_in_a_big_job_waits_for_no_more_evidence_than_the_reason_reads() -> None:
    p = Pace()
    p.process(9000, "stopped", now=10.0)
    for r in range(NAMING_EVIDENCE - 2):
        p.evidence(r, WAITING)
    assert p.judge(10.0 + STOP_HOLD_S + 0.1, 300, live=16384, step=3) is None
    p.evidence(NAMING_EVIDENCE, WAITING)
    assert p.judge(10.0 + STOP_HOLD_S + 0.1, 300, live=16384, step=3) is not None


def test_every_rank_waiting_is_certain_only_for_a_deadlock_held_or_a_link_losing_data() -> None:
    p = moving()
    p.evidence(0, WAITING, now=101.0)
    p.evidence(1, WAITING, now=101.0)
    assert p.all_waiting(2)
    p.analysed, p.blocked = p.generation, DEADLOCK              # what ``hangs.blocked`` found
    assert p.judge(102.0, 300, live=2, step=5) is None          # not held yet
    verdict = p.judge(102.0 + DEADLOCK_HOLD_S, 300, live=2, step=5)
    assert verdict is not None and verdict.kind == DEADLOCK
    q = moving()
    q.evidence(0, WAITING, now=101.0)
    q.evidence(2, WAITING, now=101.0)
    q.analysed, q.blocked = q.generation, LINK
    assert q.judge(110.0, 300, live=2, step=5) is None          # all inside one operation, nothing lost: a
    assert q.judge(401.0, 300, live=2, step=5).kind == UNCERTAIN   # slow transfer cannot be told from a cut
    q.evidence(2, LOSING, now=402.0)
    q.analysed, q.blocked = q.generation, LINK
    assert q.judge(402.0, 300, live=2, step=5).kind == LINK
    q.evidence(1, COMPUTING, now=402.0)                         # a rank outside: no longer all waiting
    assert not q.all_waiting(3)


def test_a_stop_is_named_at_once_and_a_ranks_stops_at_most_once_in_a_while() -> None:
    from rankctl.coordinator.diagnosis.pace import ANNOUNCE_EVERY_S

    p = Pace()
    assert not p.announce(1, 0.0)
    p.process(1, "stopped", now=1.0)
    assert p.announce(1, 1.0) and not p.announce(1, 1.1)
    p.process(1, "", now=2.0)
    p.process(1, "stopped", now=3.0)
    assert not p.announce(1, 3.0)
    assert p.announce(1, 1.0 + ANNOUNCE_EVERY_S)
    p.process(2, "traced", now=4.0)
    assert p.announce(2, 4.0)
