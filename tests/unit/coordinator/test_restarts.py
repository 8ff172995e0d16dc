"""Automatic restarts in the coordinator core (issue 13, first part), without a network: a failed
attempt is stopped and confirmed gone before the next one is queued, a lost node is replaced by a
spare, and a job out of restarts fails with every attempt's reason."""

from __future__ import annotations

from dataclasses import replace

from pathlib import Path

import pytest

from rankctl.coordinator.model.records import RankRecord, RankUpdate
from rankctl.coordinator.model.states import JobState
from test_core import World, make_world

S = JobState


def job_yaml(max_restarts: int, nodes: int = 2) -> str:
    return (f"name: rs\nkind: comm-check\nresources: {{nodes: {nodes}, slots_per_node: 2}}\nparallel: {{tp: 2}}\n"
            f"restart: {{max_restarts: {max_restarts}}}\n")


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


def exit_all(world: World, job, node: str, code: int = -9) -> None:
    k = job.nodes.index(node)
    for r in range(2 * k, 2 * k + 2):
        world.report(job.id, r, "exited", code=code, node=node)


def cancels(world: World, node: str, attempt: int) -> list:
    return [c for c in world.nodes[node].bodies("cancel") if c.attempt == attempt]


def test_a_failed_rank_restarts_the_job_only_after_every_rank_of_the_attempt_is_gone(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml(1))
    for r in range(4):
        world.report(job.id, r, "running")
    world.report(job.id, 3, "failed", code=1, error="Traceback\nValueError: boom")
    assert job.state is S.RESTARTING and "attempt 1 failed: rank 3 on node n1 exited with code 1" in job.reason
    assert cancels(world, "n0", 1) and cancels(world, "n1", 1)
    exit_all(world, job, "n0")
    assert job.state is S.RESTARTING and job.attempt == 1          # rank 2 on n1 has not exited yet
    world.report(job.id, 2, "exited", code=-9, node="n1")
    assert job.attempt == 2 and job.state is S.STARTING             # queued and placed again at once
    assigns = [a for a in world.nodes["n0"].bodies("assign") if a.attempt == 2]
    assert len(assigns) == 1 and assigns[0].restart and world.nodes["n0"].assignments(job.id)[-1].restart
    late = RankUpdate(job.id, 1, RankRecord(0, "n0", "exited", exited=True, exit_code=1), "", 999)
    world.deliver(world.nodes["n0"].session, late)        # a late report of attempt 1 is ignored
    assert job.state is S.STARTING and job.attempt == 2
    attempts = world.store.attempts.listed(job.id)
    assert [a["attempt"] for a in attempts] == [1, 2] and attempts[0]["state"] == "RESTARTING"
    assert "ValueError: boom" in attempts[0]["reason"]


def test_a_lost_node_is_replaced_by_a_spare(world: World) -> None:
    for n in ("n0", "n1", "n2"):
        world.connect(n)
    job = world.core.submit(job_yaml(2))
    assert job.nodes == ["n0", "n1"]
    for r in range(4):
        world.report(job.id, r, "running")
    world.core.disconnect(world.nodes["n1"].session)               # n1 is lost with its ranks
    assert job.state is S.RESTARTING and "node n1 lost" in job.reason
    exit_all(world, job, "n0")                                      # n0's ranks confirmed stopped
    assert job.attempt == 2 and job.nodes == ["n0", "n2"] and job.state is S.STARTING
    world.run_all(job.id)
    assert job.state is S.SUCCEEDED


def test_out_of_restarts_fails_with_every_attempts_reason(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml(1))
    world.report(job.id, 1, "failed", code=1, error="first boom")
    exit_all(world, job, "n1")
    world.report(job.id, 0, "exited", code=-9)
    assert job.attempt == 2 and job.state is S.STARTING
    world.report(job.id, 2, "failed", code=1, error="second boom")
    assert job.state is S.FAILED
    assert "no restart is left (max_restarts=1)" in job.reason and "second boom" in job.reason
    assert "attempt 1: rank 1 on node n0 exited with code 1: first boom" in job.reason


def test_without_restarts_a_failure_fails_the_job_at_once(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml(0))
    world.report(job.id, 1, "failed", code=1, error="boom")
    assert job.state is S.FAILED and job.reason == "rank 1 on node n0 exited with code 1: boom"


def test_cancel_while_restarting_cancels_and_queues_nothing(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml(3))
    world.report(job.id, 0, "failed", code=1, error="boom")
    assert job.state is S.RESTARTING
    world.core.cancel(job.id)
    assert job.state is S.CANCELLED and job.attempt == 1
    exit_all(world, job, "n0")
    exit_all(world, job, "n1")
    assert job.state is S.CANCELLED and job.attempt == 1


def test_a_stop_that_is_never_confirmed_fails_the_job(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml(3))
    world.report(job.id, 0, "failed", code=1, error="boom")
    world.clock.t += 121
    for n in ("n0", "n1"):                                          # still heartbeating, never reporting exits
        world.core.heartbeat(world.nodes[n].session)
    world.core.tick()
    assert job.state is S.FAILED and "did not stop" in job.reason


def test_a_job_whose_ranks_stop_advancing_is_hung_and_restarts_naming_the_stopped_rank(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml(1).replace("max_restarts: 1}", "max_restarts: 1, hang_timeout: 20}"))
    for r in range(4):
        world.report(job.id, r, "running")
    world.clock.t += 100
    for n in ("n0", "n1"):
        world.core.heartbeat(world.nodes[n].session)
    world.core.tick()
    assert job.state is S.RUNNING                     # no step reported yet: a silent script is not a hang
    for r in range(4):
        world.deliver(world.nodes[job.nodes[r // 2]].session, RankUpdate(
            job.id, 1, RankRecord(r, job.nodes[r // 2], "running", 1 if r != 2 else 0), "", 100 + r))
    stopped = RankUpdate(job.id, 1, RankRecord(2, "n1", "", 0, process="stopped"), "", 200)
    world.deliver(world.nodes["n1"].session, stopped)
    world.deliver(world.nodes["n1"].session, replace(stopped, seq=201))   # the same stop again: named once
    named = [e.message for e in world.core.events(job.id) if e.kind == "stopped"]
    assert named == ["rank 2 stopped (SIGSTOP) on n1, no counters yet, step 0: a hang if it stays stopped about "
                     "a second"], named
    world.clock.t += 15
    for n in ("n0", "n1"):
        world.core.heartbeat(world.nodes[n].session)
    world.core.tick(loop_lag=14.8)                    # 14.8 of the 15 s the coordinator itself was stalled
    assert job.state is S.RUNNING
    world.clock.t += 16
    for n in ("n0", "n1"):
        world.core.heartbeat(world.nodes[n].session)
    world.core.tick()
    assert job.state is S.RESTARTING, job.reason
    assert "hang: no rank advanced for 16 s (certain: a rank stopped for 16.5 s; a stop of about a second" in job.reason, job.reason
    assert "rank 2 stopped (SIGSTOP or a debugger) on n1" in job.reason and "slowest step 0 held by rank 2" in job.reason


def test_a_pair_whose_link_a_hang_pointed_at_is_kept_apart_until_a_pre_flight_passes_on_both(world: World) -> None:
    """After a hang named the link between n0 and n1, the next attempt goes to n0 and the spare n2; when only
    n0 and n1 fit it is placed on both (its pre-flight tests them), and a pre-flight that passes on both lets
    them meet again."""
    for n in ("n0", "n1", "n2"):
        world.connect(n)
    job = world.core.submit(job_yaml(3))
    assert job.nodes == ["n0", "n1"]
    world.core._restarts.keep_apart(job, "n0", "n1")
    world.report(job.id, 3, "failed", code=1, error="RuntimeError: boom")
    for r in (0, 1, 2):
        world.report(job.id, r, "exited", code=-15, node=job.nodes[r // 2])
    assert job.attempt == 2 and job.nodes == ["n0", "n2"], job.nodes
    world.core.disconnect(world.nodes["n2"].session)                # only n0 and n1 left: together after all
    exit_all(world, job, "n0")
    assert job.attempt == 3 and sorted(job.nodes) == ["n0", "n1"], (job.attempt, job.nodes)
    assert world.core.nodes.apart[job.id] == {("n0", "n1")}
    progress = world.core.book.progress(job)
    from rankctl.coordinator.diagnosis.preflight import Preflight

    progress.preflight = Preflight(figures={"tp": 0.1})             # rank 0's pre-flight: nothing excluded
    world.report(job.id, 0, "running")
    assert world.core.nodes.apart[job.id] == set()


# -- restarts in place: daemons that stop an older attempt's ranks before a newer Assign's start --------------

def test_a_lost_node_is_replaced_in_place_without_waiting_for_the_others_to_confirm(world: World) -> None:
    for n in ("n0", "n1", "n2"):
        world.connect(n, replaces=True)
    job = world.core.submit(job_yaml(2))
    for r in range(4):
        world.report(job.id, r, "running")
    first_port = job.rendezvous.rsplit(":", 1)[1]
    world.core.disconnect(world.nodes["n1"].session)               # n1 is lost with its ranks
    # at once: attempt 2 on n0 (kept, its ranks not confirmed gone) and the spare n2, on another port
    assert job.attempt == 2 and job.state is S.STARTING and job.nodes == ["n0", "n2"]
    assert job.rendezvous.rsplit(":", 1)[1] != first_port
    assert not cancels(world, "n0", 1)                             # no Cancel: attempt 2's Assign replaces it
    assign = [a for a in world.nodes["n0"].bodies("assign") if a.attempt == 2]
    assert len(assign) == 1 and assign[0].restart
    states = [(e.kind, e.state.value) for e in world.core.events(job.id) if e.kind == "transition"]
    assert states[-4:] == [("transition", "RESTARTING"), ("transition", "PENDING"), ("transition", "PLACED"),
                           ("transition", "STARTING")]
    assert any("in place" in e.message for e in world.core.events(job.id))
    fake = world.nodes["n0"]
    for r in (0, 1):  # attempt 1's exits, had the daemon sent them, are ignored (an older attempt's)
        fake.seq += 1
        world.deliver(fake.session, RankUpdate(job.id, 1, RankRecord(r, "n0", "exited", exited=True, exit_code=-15),
                                               "", fake.seq))
    assert job.attempt == 2 and job.state is S.STARTING
    world.run_all(job.id)
    assert job.state is S.SUCCEEDED
    attempts = world.store.attempts.listed(job.id)
    assert [a["attempt"] for a in attempts] == [1, 2] and "node n1 lost" in attempts[0]["reason"]


def test_a_failed_rank_restarts_in_place_on_the_same_nodes(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n, replaces=True)
    job = world.core.submit(job_yaml(1))
    for r in range(4):
        world.report(job.id, r, "running")
    world.report(job.id, 3, "failed", code=1, error="Traceback\nValueError: boom")
    assert job.attempt == 2 and job.state is S.STARTING and job.nodes == ["n0", "n1"]
    assert not cancels(world, "n0", 1) and not cancels(world, "n1", 1)


def test_without_a_free_node_or_with_an_older_daemon_the_stop_is_confirmed_first(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n, replaces=True)
    job = world.core.submit(job_yaml(3))
    world.core.disconnect(world.nodes["n1"].session)               # no spare: nothing to place attempt 2 on now
    assert job.state is S.RESTARTING and job.attempt == 1 and cancels(world, "n0", 1)
    exit_all(world, job, "n0")
    assert job.state is S.PENDING and job.attempt == 2
    world.connect("n2")                                            # an older daemon: it would run both attempts
    assert job.attempt == 2 and job.nodes == ["n0", "n2"]          # (a spare: it had no old ranks)
    world.core.disconnect(world.nodes["n0"].session)               # now: n2 survives, an older daemon
    world.connect("n1", replaces=True)
    assert job.state is S.RESTARTING and cancels(world, "n2", 2)   # stopped the confirmed way
    exit_all(world, job, "n2")
    assert job.attempt == 3 and job.state is S.STARTING and sorted(job.nodes) == ["n1", "n2"]


def test_a_node_excluded_for_the_job_is_stopped_the_confirmed_way(world: World) -> None:
    for n in ("n0", "n1", "n2"):
        world.connect(n, replaces=True)
    job = world.core.submit(job_yaml(3))
    for attempt in (1, 2):
        for r in range(4):
            world.report(job.id, r, "running")
        world.report(job.id, 3, "failed", code=1, error=f"Traceback\nValueError: boom {attempt}")
    # the second failure on n1 excludes it: it leaves the job, so attempt 2 is stopped and confirmed first
    assert job.attempt == 2 and job.state is S.RESTARTING and cancels(world, "n1", 2)
    exit_all(world, job, "n0")
    exit_all(world, job, "n1")
    assert job.attempt == 3 and job.nodes == ["n0", "n2"]


def test_a_pre_flight_that_excludes_a_node_ends_the_attempt_as_soon_as_it_is_reported(world: World) -> None:
    """Rank 0's outcome comes on a report that changes nothing else of it (it is running): the job advances on
    it at once. Before, it waited for the next report that did (CI: 30 s, until the ranks gave up waiting)."""
    import json

    from rankctl.proto import rankctl_pb2 as pb

    for n in ("n0", "n1", "n2"):
        world.connect(n)
    job = world.core.submit(job_yaml(2))
    for r in range(4):
        world.report(job.id, r, "running")
    outcome = json.dumps({"kinds_ms": {"tp": 0.2}, "exclude": {"1": "its link is slow"}})
    report = pb.RankReport(job_id=job.id, attempt=1, seq=999, status=pb.RankStatus(
        rank=0, node="n0", phase="running", preflight=outcome))
    world.core.rank_reports(world.nodes["n0"].session, [report])
    world.core.flush()
    assert job.state is S.RESTARTING and job.reason.startswith("attempt 1 failed: pre-flight: node n1: its link is "
                                                                "slow; it is excluded from this job"), job.reason


def test_the_ranks_of_a_lost_node_are_recorded_gone_not_running_for_ever(world: World) -> None:
    """A job failed by a lost node (or by its allocation's end, then its workers vanishing) showed the node's ranks
    `running` for good: nothing will ever report them exited (an outside probe, `ctl status` 15 s after the end)."""
    world.connect("n0"), world.connect("n1")
    job = world.core.submit(job_yaml(0))
    for r in range(4):
        world.report(job.id, r, "running")
    world.core.disconnect(world.nodes["n1"].session, "stream closed")
    assert job.state is S.FAILED
    exit_all(world, job, "n0", code=-15)                      # n0 confirms its stop
    s = world.core.summary(job.id)
    assert (s.phases, s.running, s.exited) == ({"exited": 4}, 0, 4), s
    gone = {r.rank: r for r in world.core.book.rank_page(job, 0, 4)}
    assert [gone[r].error for r in (2, 3)] == ["gone with node n1 (lost: stream closed)"] * 2
    assert {r: (x.phase, x.exited) for r, x in world.store.ranks(job.id).items() if r in (2, 3)} == \
        {2: ("exited", True), 3: ("exited", True)}            # stored: a restarted coordinator says the same
    # a job cancelled whose node is lost before it confirmed its ranks stopped
    world.connect("n1")
    second = world.core.submit(job_yaml(0))
    for r in range(4):
        world.report(second.id, r, "running")
    world.core.cancel(second.id)
    exit_all(world, second, second.nodes[0], code=-15)
    world.core.disconnect(world.nodes[second.nodes[1]].session, "stream closed")
    s = world.core.summary(second.id)
    assert s.running == 0 and s.exited == 4, s


def test_a_plan_is_stored_in_one_transaction_and_its_messages_go_once_it_committed(world: World) -> None:
    """Decisions are values carried out by one apply: the failed attempt's end, its stored fault and the next
    attempt's placement on the same nodes are one transaction, and no Cancel or Assign leaves before it commits."""
    from contextlib import contextmanager

    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml(1))
    for r in range(4):
        world.report(job.id, r, "running")
    real, seen = world.store.transaction, []

    def sent() -> int:
        return sum(len(world.nodes[n].sent) for n in ("n0", "n1"))

    @contextmanager
    def counted(what: str = "a change"):
        outer = not world.store.in_transaction
        with real(what):
            yield
            at_end = sent()
        if outer:
            seen.append((what, at_end))
    world.store.transaction = counted
    before = sent()
    world.report(job.id, 3, "failed", code=1, error="Traceback\nValueError: boom")
    world.store.transaction = real
    assert job.state in (S.RESTARTING, S.STARTING) and job.attempt in (1, 2)
    plans = [s for s in seen if "plan of job" in s[0]]
    assert [what for what, *_ in plans] == [f"the endattempt plan of job {job.id}"], seen
    assert plans[0][1] == before and sent() > before     # every message of the plan left after its commit
    assert world.store.attempts.listed(job.id)[0]["state"] == "RESTARTING"


def test_nodes_a_tick_finds_lost_are_all_lost_before_a_restart_is_placed(world: World) -> None:
    """n1 (the job's) and n2 (a spare) fall silent together: the restart in place goes to the spare n3, never to n2,
    which the same tick found lost (the turn fails the lost nodes' jobs once every node it found is LOST)."""
    for n in ("n0", "n1", "n2", "n3"):
        world.connect(n, replaces=True)
    job = world.core.submit(job_yaml(2))
    for r in range(4):
        world.report(job.id, r, "running")
    assert job.nodes == ["n0", "n1"]
    world.clock.t += 30                                             # past the heartbeat timeout for all
    for n in ("n0", "n3"):                                          # n1 and n2 stay silent
        world.core.heartbeat(world.nodes[n].session)
    world.core.tick()
    assert job.attempt == 2 and job.state is S.STARTING and job.nodes == ["n0", "n3"], (job.nodes, job.reason)
    assert "node n1 lost" in world.store.attempts.listed(job.id)[0]["reason"]


WAITS_IN_TP = '{"still_s":1.0,"groups":[{"kind":"tp","members":[2,3],"size":2,"entered":5,"completed":4,' \
              '"op":"all_reduce","in":true}]}'
ASLEEP = '{"still_s":1.0,"groups":[{"kind":"tp","members":[2,3],"size":2,"entered":4,"completed":4,' \
         '"op":"all_reduce","in":false}]}'


def _evidence(world: World, job, rank: int, text: str, seq: int, stack: str = "") -> None:  # noqa: ANN001
    node = job.nodes[rank // 2]
    world.deliver(world.nodes[node].session, RankUpdate(job.id, job.attempt, RankRecord(
        rank, node, "", 4, collectives=text, stack=stack), "", seq))


def _tick(world: World, seconds: float) -> None:
    world.clock.t += seconds
    for n in ("n0", "n1"):
        world.core.heartbeat(world.nodes[n].session)
    world.core.tick()


def test_a_rank_asleep_outside_collectives_is_named_at_once_and_acted_on_only_at_the_hang_timeout(
        world: World) -> None:
    """Issue 52: rank 3 asleep in a save while its tp peer waits: a ``stall`` event and ``JobSummary.stall`` name
    it (frame and waiting peer) at once; the attempt ends only past hang_timeout, as an uncertain hang; the
    restarted attempt is not ended again at the same step for the same uncertain reason."""
    for n in ("n0", "n1"):
        world.connect(n, replaces=True)
    job = world.core.submit(job_yaml(1).replace("max_restarts: 1}", "max_restarts: 1, hang_timeout: 20}"))
    for attempt in (1, 2):
        seq = 1000 * attempt
        for r in range(4):
            world.deliver(world.nodes[job.nodes[r // 2]].session, RankUpdate(
                job.id, attempt, RankRecord(r, job.nodes[r // 2], "running", 4), "", seq + r))
        _tick(world, 1.0)
        for r in (0, 1, 2):
            _evidence(world, job, r, WAITS_IN_TP if r == 2 else WAITS_IN_TP.replace("[2,3]", "[0,1]"), seq + 10 + r)
        _evidence(world, job, 3, ASLEEP, seq + 20, stack='Thread 9 (idle): "MainThread"\n    save_checkpoint '
                                                       '(train.py:88)\n    <module> (train.py:120)')
        _tick(world, 0.5)
        stalls = [e.message for e in world.core.events(job.id) if e.kind == "stall"]
        assert stalls and "tp group [2, 3] waits in all_reduce #5 (rank 2 entered it): rank 3 never entered it" in \
            stalls[-1] and "save_checkpoint (train.py:88)" in stalls[-1], stalls
        assert ("acted on only if still so 20 s" if attempt == 1 else "not acted on: an earlier attempt was ended at "
                "this step") in stalls[-1] and world.core.summary(job.id).stall == stalls[-1], stalls
        _tick(world, 15.0)
        assert job.state is S.RUNNING and job.attempt == attempt        # uncertain: not before hang_timeout
        _tick(world, 6.0)
        if attempt == 1:   # restarted in place
            first = world.core.attempts(job.id)[0]["reason"]
            assert job.attempt == 2 and "(uncertain: a live rank outside collectives" in first, first
    assert job.state is S.RUNNING, job.reason   # attempt 2, the same step: spared
