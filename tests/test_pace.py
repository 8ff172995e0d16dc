"""The adaptive hang judgement (``coordinator.pace``): pure, no processes."""

from __future__ import annotations

from rankctl.coordinator.pace import PACE_FLOOR_S, Pace

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
    assert not p.hung(5.9, 300) and p.hung(6.1, 300)
    p.evidence(0, '{"moved":true}')                # the evidence withdrawn: it went on
    assert not p.hung(7.0, 300)
    p.process(2, "stopped")                        # a stopped rank is enough
    assert p.hung(6.1, 300) and not p.hung(5.0, 300)
    p.process(2, "")
    assert not p.hung(7.0, 300)


def test_a_save_holds_its_peers_without_a_hang_until_the_timeout() -> None:
    p = paced(0.2)
    p.evidence(0, WAITING)
    p.evidence(1, SAVING)
    assert not p.hung(60.0, 300) and p.hung(301, 300)
    p.gone(1)
    assert p.hung(6.1, 300)


def test_slow_steps_are_judged_on_their_own_scale() -> None:
    p = paced(30.0)                                # a step every 30 s
    p.evidence(0, WAITING)
    assert p.limit(300) == 120.0 and not p.hung(100.0, 300) and p.hung(121.0, 300)
    assert paced(200.0).limit(300) == 300          # never past the timeout
    coalesced = Pace()                             # a jump of 4 steps is 4 intervals of its mean
    coalesced.step_completed(1, 0.0)
    coalesced.step_completed(5, 4.0)
    coalesced.step_completed(9, 8.0)
    assert list(coalesced.intervals) == [1.0, 1.0]


def test_the_rule_says_how_the_job_was_judged() -> None:
    assert Pace().rule(300) == "restart.hang_timeout=300"
    text = paced(0.25).rule(300)
    assert "judged after 6 s" in text and "a step every 0.25 s" in text and "restart.hang_timeout=300" in text


def test_a_judgement_waits_a_little_for_ranks_that_sent_no_evidence_or_no_stack_yet() -> None:
    """Past the limit with ranks waiting, but the rank they wait for has sent nothing (a loaded node's daemon), or
    only its counters (its stack comes in a second report): up to EVIDENCE_GRACE_S more, so that the reason can
    name it and show its stack; then judged without them."""
    from rankctl.coordinator.pace import EVIDENCE_GRACE_S

    p = paced(0.2)
    for r in (2, 3):
        p.evidence(r, WAITING, "stack")
    assert not p.hung(PACE_FLOOR_S + 1, 300, live=4)                      # ranks 0, 1 not heard yet
    assert p.hung(PACE_FLOOR_S + EVIDENCE_GRACE_S + 0.1, 300, live=4)    # judged without them
    p.evidence(0, WAITING)
    p.evidence(1, SPINNING)
    assert p.waits() and not p.hung(PACE_FLOOR_S + 1, 300, live=4)       # counters in, their stacks not yet
    p.evidence(0, WAITING, "stack")
    p.evidence(1, SPINNING, "stack")
    assert p.hung(PACE_FLOOR_S + 0.1, 300, live=4)                        # every live rank heard: at once
    p.evidence(1, '{"moved":true}')
    assert not p.hung(PACE_FLOOR_S + 1, 300, live=4)
