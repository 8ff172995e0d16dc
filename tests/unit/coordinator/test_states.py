"""The job state machine: table, terminal states, illegal transitions."""

import pytest

from rankctl.coordinator.model.states import (
    TERMINAL, TRANSITIONS, IllegalTransition, JobState, can_transition, is_active, is_terminal, transition,
)
from rankctl.proto import rankctl_pb2 as pb

S = JobState


def test_happy_path_is_allowed() -> None:
    path = [S.PENDING, S.PLACED, S.STARTING, S.RUNNING, S.SUCCEEDED]
    for src, dst in zip(path, path[1:]):
        assert transition(src, dst, "ok").dst is dst


def test_table_covers_every_state_and_matches_proto() -> None:
    assert set(TRANSITIONS) == set(JobState)
    for state in JobState:
        assert pb.JobState.Value("JOB_STATE_" + state.value) > 0


def test_terminal_states_have_no_exits() -> None:
    assert TERMINAL == {S.SUCCEEDED, S.FAILED, S.CANCELLED}
    for state in JobState:
        assert is_terminal(state) == (state in TERMINAL)
        if is_terminal(state):
            assert not TRANSITIONS[state]
            assert not is_active(state)


@pytest.mark.parametrize("src", [s for s in JobState if s not in TERMINAL])
def test_every_live_state_can_fail_and_be_cancelled(src: JobState) -> None:
    assert can_transition(src, S.FAILED) and can_transition(src, S.CANCELLED)


@pytest.mark.parametrize(
    "src,dst", [(S.PENDING, S.RUNNING), (S.SUCCEEDED, S.RUNNING), (S.FAILED, S.PENDING), (S.RUNNING, S.PLACED),
                (S.STARTING, S.SUCCEEDED)],
)
def test_illegal_transitions_raise(src: JobState, dst: JobState) -> None:
    with pytest.raises(IllegalTransition, match="illegal transition"):
        transition(src, dst, "because")


def test_a_reason_is_required() -> None:
    with pytest.raises(IllegalTransition, match="needs a reason"):
        transition(S.PENDING, S.PLACED, "  ")
