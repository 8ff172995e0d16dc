"""The adaptive hang judgement (``coordinator.diagnosis.pace``): pure, no processes."""

from __future__ import annotations

import pytest

from rankctl.coordinator.diagnosis.pace import PACE_FLOOR_S, Pace

WAITING = '{"still_s":2.1,"groups":[{"kind":"tp","members":[0,1],"size":2,"entered":9,"in":true}]}'
SPINNING = '{"still_s":2.1,"groups":[{"kind":"tp","members":[0,1],"size":2,"entered":8,"in":false}]}'
SAVING = '{"still_s":2.1,"activity":"checkpoint","groups":[]}'


def paced(interval: float, steps: int = 5) -> Pace:
    p = Pace()
    for s in range(1, steps + 1):
        p.step_completed(s, 100.0 + s * interval)
    return p


def test_until_the_pace_is_known_only_the_hang_timeout_rules() -> None:
    p = Pace()
    p.step_completed(1, 10.0)
    p.evidence(3, WAITING)
    assert p.limit(300) == 300 and not p.hung(299, 300) and p.hung(301, 300)
    p.step_completed(2, 10.2)
    assert p.limit(300) == 300                     # one interval: not yet
    p.step_completed(3, 10.4)
    assert p.limit(300) == PACE_FLOOR_S and p.hung(PACE_FLOOR_S + 0.1, 300)


def test_fast_steps_are_judged_at_the_floor_and_only_when_someone_waits() -> None:
    p = paced(0.2)
    assert p.limit(300) == PACE_FLOOR_S
    assert not p.hung(7.0, 300)                    # still, but nobody waits: computing, reading ...
    p.evidence(1, SPINNING)
    assert not p.hung(7.0, 300)                    # a rank outside any collective alone is no wait
    p.evidence(0, WAITING)
    assert not p.hung(PACE_FLOOR_S - 0.1, 300) and p.hung(PACE_FLOOR_S + 0.1, 300)
    p.evidence(0, '{"moved":true}')                # the evidence withdrawn: it went on
    assert not p.hung(7.0, 300)
    p.process(2, "stopped", now=10.0)              # a stopped rank is enough, on the pace too
    assert p.hung(PACE_FLOOR_S + 0.1, 300) and not p.hung(PACE_FLOOR_S - 0.1, 300)
    p.process(2, "")
    assert not p.hung(7.0, 300)


def test_a_save_holds_its_peers_without_a_hang_until_the_timeout() -> None:
    p = paced(0.2)
    p.evidence(0, WAITING)
    p.evidence(1, SAVING)
    assert not p.hung(60.0, 300) and p.hung(301, 300)
    p.gone(1)
    assert p.hung(PACE_FLOOR_S + 0.1, 300)


def test_slow_steps_are_judged_on_their_own_scale() -> None:
    p = paced(30.0)                                # a step every 30 s
    p.evidence(0, WAITING)
    assert p.limit(300) == 120.0 and not p.hung(100.0, 300) and p.hung(121.0, 300)
    assert paced(200.0).limit(300) == 300          # never past the timeout
    coalesced = Pace()                             # a jump of 4 steps is one interval of its mean ...
    coalesced.step_completed(1, 0.0)
    coalesced.step_completed(5, 4.0)
    coalesced.step_completed(9, 8.0)
    assert list(coalesced.intervals) == [1.0, 1.0]
    first = Pace()                                 # ... that counts as 4 towards trusting the pace: a loaded
    first.step_completed(2, 0.0)                   # daemon coalesced a fast job's first steps (CI: a rank that
    first.step_completed(4, 0.1)                   # slept 120 s inside step 5 was judged on the 300 s timeout)
    first.evidence(0, WAITING)
    assert first.limit(300) == PACE_FLOOR_S and first.hung(PACE_FLOOR_S + 0.1, 300)


def test_the_rule_says_how_the_job_was_judged() -> None:
    assert Pace().rule(300) == "restart.hang_timeout=300"
    text = paced(0.25).rule(300)
    assert "judged after 1.5 s from the job's pace: a step every 0.25 s, the longest 0.25 s;" in text, text
    assert "restart.hang_timeout=300" in text and "growing" not in text, text


def test_a_judgement_waits_for_every_live_ranks_evidence_and_a_little_for_stacks() -> None:
    """Past the limit with ranks waiting, but the rank they wait for has sent nothing: it moved within its own
    stall time and may be computing, so no judgement on the pace (only restart.hang_timeout); once every live
    rank's counters are in, up to EVIDENCE_GRACE_S more for their stacks (a second report), so that the reason
    can show them; then judged without them."""
    from rankctl.coordinator.diagnosis.pace import EVIDENCE_GRACE_S

    p = paced(0.2)
    for r in (2, 3):
        p.evidence(r, WAITING, "stack")
    assert not p.hung(PACE_FLOOR_S + EVIDENCE_GRACE_S + 60, 300, live=4)   # ranks 0, 1 not heard: never on pace
    assert p.hung(301, 300, live=4)                                       # the timeout still rules
    p.evidence(0, WAITING)
    p.evidence(1, SPINNING)
    assert p.waits() and not p.hung(PACE_FLOOR_S + EVIDENCE_GRACE_S / 2, 300, live=4)   # stacks not in yet
    assert p.hung(PACE_FLOOR_S + EVIDENCE_GRACE_S + 0.1, 300, live=4)    # judged without the stacks
    p.evidence(0, WAITING, "stack")
    p.evidence(1, SPINNING, "stack")
    assert p.hung(PACE_FLOOR_S + 0.1, 300, live=4)                        # every live rank heard: at once
    p.evidence(1, '{"moved":true}')
    assert not p.hung(PACE_FLOOR_S + 60, 300, live=4)
    p.process(1, "stopped")                                               # a stopped rank counts as heard
    assert p.hung(PACE_FLOOR_S + 0.1, 300, live=4)


COMPUTING = '{"still_s":2.1,"computing":true,"groups":[{"kind":"tp","members":[0,1],"size":2,"entered":8,"in":false}]}'


def test_a_rank_whose_cpu_time_advances_outside_collectives_is_never_hung_on_the_pace() -> None:
    """Its peers wait for it in a collective, but its daemon says its CPU time advances (a slow or throttled
    rank computing): no hang until restart.hang_timeout, even with another rank stopped; once its evidence says
    it stopped computing, the pace judges again."""
    p = paced(0.2)
    p.evidence(0, WAITING, "stack")
    p.evidence(1, COMPUTING, "stack")
    assert not p.waits() and not p.hung(250.0, 300, live=2) and p.hung(301, 300, live=2)
    p.process(2, "stopped")
    assert not p.hung(250.0, 300, live=3)
    p.evidence(1, SPINNING, "stack")                                      # its CPU time went still
    assert p.hung(PACE_FLOOR_S + 0.1, 300, live=3)
    p.gone(2)
    p.evidence(1, COMPUTING, "stack")
    p.gone(1)                                                             # an exited rank computes no more
    assert p.hung(PACE_FLOOR_S + 0.1, 300, live=1)


def test_growing_steps_move_the_limit_with_their_trend_and_a_pause_is_no_step() -> None:
    """Step times doubling each step (0.1 s ... 3.2 s): the next one, 6.4 s, is expected, and the limit is 4 x
    that, not 4 x the median (issue 43 saw "judged after 6 s ...: a step every 0.16 s" right after a 3.2 s
    step). The longest recent step counts while it is in the window; a step in which a rank was stopped is a
    pause and counts not at all."""
    from rankctl.coordinator.diagnosis.pace import GROWTH_MAX, PACE_FACTOR

    p = Pace()
    t = 0.0
    for s in range(1, 7):
        t += 0.1 * 2 ** (s - 1)
        p.step_completed(s, t)
    assert p.growth() == pytest.approx(2.0) and p.expected() == pytest.approx(6.4)
    assert p.limit(300) == pytest.approx(PACE_FACTOR * 6.4)
    p.evidence(0, WAITING, "stack")
    assert not p.hung(12.0, 300, live=1) and p.hung(PACE_FACTOR * 6.4 + 0.1, 300, live=1)
    assert "growing x2.0 a step" in p.rule(300) and "the longest 3.20 s" in p.rule(300)
    jump = paced(0.2)
    jump.step_completed(6, jump.last_step_at + 20.0)                     # one step 100 x its predecessors is
    assert jump.growth() == 1.0 and jump.limit(300) == PACE_FACTOR * 20.0   # no trend: 4 x the longest step
    noisy = paced(0.1)                                                    # a fast job's one slower step (CI saw
    noisy.step_completed(6, noisy.last_step_at + 0.3)                     # 0.07 s, 0.21 s, 0.1 s ... judged on
    for s in range(7, 10):                                                # "growing x3.0"): no growth
        noisy.step_completed(s, noisy.last_step_at + 0.1)
    assert noisy.growth() == pytest.approx(1.0) and noisy.limit(300) == PACE_FLOOR_S
    assert paced(0.1).growth() == 1.0 and GROWTH_MAX == 4.0
    steady = paced(0.2, steps=16)
    steady.step_completed(17, steady.last_step_at + 5.0)                 # one slow step in a steady run ...
    for s in range(18, 22):
        steady.step_completed(s, steady.last_step_at + 0.2)
    assert steady.growth() == pytest.approx(1.0) and steady.limit(300) == pytest.approx(PACE_FACTOR * 5.0)   # ... is remembered
    paused = paced(0.2)
    paused.process(3, "stopped")                                          # SIGSTOPped for 3 s, then continued
    paused.process(3, "")
    paused.step_completed(6, paused.last_step_at + 3.0)
    paused.step_completed(7, paused.last_step_at + 0.2)
    assert max(paused.intervals) < 0.3 and paused.limit(300) == PACE_FLOOR_S


@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0])
def test_each_next_step_of_a_growing_rank_is_within_the_limit(ratio: float) -> None:
    """Steps growing x1.5, x2 or x3 a step from 0.1 s to past a minute, the ranks waiting for the slow one the
    whole time: at every step the next one (ratio x the last) ends before the limit, so the job is never hung
    on its pace while it keeps finishing steps."""
    p, t, step_s, s = Pace(), 0.0, 0.1, 0
    p.evidence(0, WAITING, "stack")
    while step_s < 80.0:
        s += 1
        t += step_s
        p.step_completed(s, t)
        step_s *= ratio
        if len(p.intervals) >= 2:
            assert not p.hung(step_s, 300, live=1), (s, step_s, p.limit(300))


def test_a_stop_held_for_about_a_second_is_a_hang_and_the_rule_for_pauses() -> None:
    """Issue 45: a stopped rank (its daemon confirmed the stop: CPU still CPU_STILL_S) is a hang once held
    STOP_HOLD_S on the coordinator's clock while no rank advanced, whatever the pace, once every live rank's
    evidence is in or EVIDENCE_GRACE_S more passed; shorter stops are pauses, and so are a traced rank (a
    debugger) and the whole job stopped together (a suspend). ``due`` says when to look again."""
    from rankctl.coordinator.diagnosis.pace import EVIDENCE_GRACE_S, STOP_HOLD_S

    p = paced(30.0)                                # slow steps: the pace alone would wait 120 s
    p.process(3, "stopped", now=50.0)
    assert not p.hung(2.0, 300, live=4, now=50.0 + STOP_HOLD_S - 0.1)            # a pause so far
    assert p.due(2.0, 300, 50.0 + STOP_HOLD_S - 0.1) == pytest.approx(0.1)
    assert not p.hung(2.0, 300, live=4, now=50.0 + STOP_HOLD_S + 0.1)            # peers' evidence not in yet
    assert p.hung(2.0, 300, live=4, now=50.0 + STOP_HOLD_S + EVIDENCE_GRACE_S + 0.1)   # judged without it
    for r in (0, 1, 2):
        p.evidence(r, WAITING)
    assert p.hung(2.0, 300, live=4, now=50.0 + STOP_HOLD_S + 0.1)                # every rank heard: at once
    assert not p.hung(STOP_HOLD_S - 0.1, 300, live=4, now=60.0)                  # a rank advanced since
    assert "a rank stopped for" in p.rule(300, now=50.0 + STOP_HOLD_S + 0.1)
    p.process(3, "", now=51.0)                     # continued: the stop is over
    assert not p.hung(2.0, 300, live=4, now=52.0) and p.stop_held(52.0) is None
    p.process(3, "traced", now=53.0)               # a debugger holds it: only the upper bound
    assert not p.hung(250.0, 300, live=4, now=80.0) and p.hung(301.0, 300, live=4, now=80.0)
    assert p.due(250.0, 300, 80.0) is None
    p.process(3, "", now=81.0)
    for r in range(4):                             # every live rank stopped together: a suspend, a pause
        p.process(r, "stopped", now=90.0)
    assert not p.hung(5.0, 300, live=4, now=95.0)
    p.gone(0)                                      # (one exited: the three live ones are all stopped)
    assert not p.hung(5.0, 300, live=3, now=95.0)
    p.process(1, "", now=95.0)                     # the suspend ends, one rank's report before the others':
    assert not p.hung(5.0, 300, live=3, now=95.1)  # those still stopped are stopped from now on
    assert p.hung(5.0, 300, live=3, now=95.0 + STOP_HOLD_S + EVIDENCE_GRACE_S)   # ... and held: a hang


def test_due_is_the_pace_limit_while_ranks_wait() -> None:
    p = paced(0.2)
    assert p.due(0.5, 300, 10.0) is None           # nobody waits: nothing time alone decides before the tick
    p.evidence(0, WAITING)
    assert p.due(0.5, 300, 10.0) == pytest.approx(PACE_FLOOR_S - 0.5)


def test_a_stop_in_a_big_job_waits_for_no_more_evidence_than_the_reason_reads() -> None:
    """At 16,384 ranks every rank's evidence takes the coordinator longer to take in than the stop's hold: the
    stop is judged once NAMING_EVIDENCE ranks' evidence is in (what ``hangs`` reads of the waiting ranks)."""
    from rankctl.coordinator.diagnosis.pace import NAMING_EVIDENCE, STOP_HOLD_S

    p = paced(0.5)
    p.process(9000, "stopped", now=10.0)
    for r in range(NAMING_EVIDENCE - 2):
        p.evidence(r, WAITING)
    assert not p.hung(1.0, 300, live=16384, now=10.0 + STOP_HOLD_S + 0.1)
    p.evidence(NAMING_EVIDENCE, WAITING)          # with the stopped rank: enough to name it
    assert p.hung(1.0, 300, live=16384, now=10.0 + STOP_HOLD_S + 0.1)


def test_a_stop_is_named_at_once_and_a_ranks_stops_at_most_once_in_a_while() -> None:
    from rankctl.coordinator.diagnosis.pace import ANNOUNCE_EVERY_S

    p = Pace()
    assert not p.announce(1, 0.0)                 # not stopped: nothing to name
    p.process(1, "stopped", now=1.0)
    assert p.announce(1, 1.0) and not p.announce(1, 1.1)
    p.process(1, "", now=2.0)
    p.process(1, "stopped", now=3.0)              # a throttle's next stop: not named again so soon
    assert not p.announce(1, 3.0)
    assert p.announce(1, 1.0 + ANNOUNCE_EVERY_S)
    p.process(2, "traced", now=4.0)               # a debugger's hold is named too (as a pause)
    assert p.announce(2, 4.0)


def test_the_pace_clock_restarts_when_a_suspended_job_goes_on() -> None:
    """CI: a job suspended for 3 s (every rank SIGSTOPped while waiting inside a collective) went on, and its
    ranks' continue reports came in before their counters moved: still 'waiting', 3 s past a 1.5 s pace, it was
    judged hung. The time stopped is a pause's: the pace counts from the moment a rank went on."""
    from rankctl.coordinator.diagnosis.pace import STOP_HOLD_S

    p = paced(0.2)                                   # limit: the 1.5 s floor
    for r in range(4):
        p.evidence(r, WAITING, stack="main")
        p.process(r, "stopped", now=10.0)
    assert not p.hung(3.0, 300, live=4, now=13.0)    # suspended: a pause
    p.process(0, "", now=13.0)                       # it goes on, one report after another
    assert not p.hung(3.0, 300, live=4, now=13.05)
    for r in (1, 2, 3):
        p.process(r, "", now=13.1)
    assert not p.hung(3.2, 300, live=4, now=13.2)    # every rank still 'in' its all-reduce: no hang yet
    assert p.due(3.2, 300, 13.2) == pytest.approx(PACE_FLOOR_S - 0.1)
    assert p.hung(3.0 + PACE_FLOOR_S + 0.1, 300, live=4, now=13.1 + PACE_FLOOR_S + 0.1)   # still stuck: hung
    q = paced(0.2)                                   # a debugger let go of a rank: the same
    q.process(1, "traced", now=20.0)
    q.evidence(0, WAITING, stack="main")
    q.process(1, "", now=25.0)
    q.evidence(1, WAITING, stack="main")
    assert not q.hung(5.0, 300, live=2, now=25.0 + STOP_HOLD_S)
    assert q.hung(5.0 + PACE_FLOOR_S, 300, live=2, now=25.0 + PACE_FLOOR_S + 0.1)
