"""Hang attribution (issue 13): the daemon's evidence of a stalled rank (``worker.runs.hangwatch``) and the
coordinator's reason built from it (``coordinator.diagnosis.hangs``), on constructed evidence of a tp2·pp2 job
(tp groups [0, 1], [2, 3]; pp groups [0, 2], [1, 3]; the world [0..3] is named ``mp``)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from rankctl.coordinator.diagnosis.hangs import REASON_CHARS, compact_stack, hang_reason
from rankctl.coordinator.model.records import RankRecord
from rankctl.worker.runs import hangwatch
from rankctl.worker.runs.hangwatch import MOVED, MOVED_JSON, STALLED, HangWatch, evidence_json

TP = "tp,tp_cp,tp_dp,tp_dp_cp,expt_tp,tp_ep"
PP = "pp,embd"
MP = "mp,tp_ep_pp"
PYSPY = """Thread 4242 (idle): "MainThread"
    _wait (torch/distributed/distributed_c10d.py:3021)
    exchange (rankctl/parallel/pipeline.py:148)
    run_schedule (rankctl/parallel/schedules.py:210)
    train_step (rankctl/kinds/train/loop.py:120)
Thread 4250 (idle): "pin_memory"
    loop (threading.py:320)"""


def tp(rank: int) -> list[int]:
    return [0, 1] if rank < 2 else [2, 3]


def pp(rank: int) -> list[int]:
    return [rank % 2, rank % 2 + 2]


def counters(rank: int, *, tp_n: tuple[int, int], pp_n: tuple[int, int], mp_n: tuple[int, int] = (1, 1),
             blocked: str = "", op: dict[str, str] | None = None) -> dict:
    """``contract.files.collfiles.read_counters``'s shape: (entered, completed) per group, ``blocked`` the kind it is in."""
    op = op or {}
    groups = [{"kind": TP, "members": tp(rank), "size": 2, "entered": tp_n[0], "completed": tp_n[1],
               "op": op.get("tp", "all_reduce"), "since": 1000.0, "wait_s": 1.0},
              {"kind": PP, "members": pp(rank), "size": 2, "entered": pp_n[0], "completed": pp_n[1],
               "op": op.get("pp", "batch_isend_irecv"), "since": 1000.0, "wait_s": 1.0},
              {"kind": MP, "members": [0, 1, 2, 3], "size": 4, "entered": mp_n[0], "completed": mp_n[1],
               "op": op.get("mp", "barrier"), "since": 1000.0, "wait_s": 0.1},
              {"kind": "dp,cp,dp_cp", "members": [rank], "size": 1, "entered": 7, "completed": 7,
               "op": "all_reduce", "since": 999.0, "wait_s": 0.0}]
    slot = {"": -1, "tp": 0, "pp": 1, "mp": 2}[blocked]
    return {"in": slot, "wait_s": 2.1, "groups": groups}


def rec(rank: int, c: dict | None, *, process: str = "", stack: str = PYSPY, step: int = 7) -> RankRecord:
    return RankRecord(rank=rank, node=f"node-{rank // 2}", phase="running", step=step, process=process,
                      collectives=evidence_json(c, 10.0) if c is not None else "", stack=stack if c is not None else "")


SUMMARY = SimpleNamespace(min_step=7, stragglers=[])


def test_a_stopped_rank_is_named_with_the_pipeline_and_tensor_groups_that_wait_for_it() -> None:
    ranks = {
        0: rec(0, counters(0, tp_n=(21, 20), pp_n=(10, 10), blocked="tp")),
        1: rec(1, counters(1, tp_n=(20, 20), pp_n=(11, 10), blocked="pp")),
        2: rec(2, counters(2, tp_n=(21, 20), pp_n=(10, 10), blocked="tp")),
        3: rec(3, counters(3, tp_n=(20, 20), pp_n=(10, 10)), process="stopped"),
    }
    reason = hang_reason(ranks, SUMMARY, 21.4, "restart.hang_timeout=20")
    print(reason)
    assert reason.startswith("hang: no rank advanced for 21 s (restart.hang_timeout=20); "
                             "rank 3 stopped (SIGSTOP or a debugger) on node-1; ")
    assert "pp group [1, 3] waits in batch_isend_irecv #11 (rank 1 in it): rank 3 not in it" in reason
    assert "tp group [2, 3] waits in all_reduce #21 (rank 2 entered it): rank 3 never entered it" in reason
    # rank 1 (in pp, waiting for rank 3) never entered rank 0's tp all_reduce: named after rank 3's groups
    assert "tp group [0, 1] waits in all_reduce #21 (rank 0 entered it): rank 1 never entered it" in reason
    assert reason.index("rank 3 never entered") < reason.index("rank 1 never entered")
    assert ("rank 3 last seen on node-1: phase running, step 7, process stopped (SIGSTOP or a debugger), "
            "in no collective, counters still for 10 s when sent; stack: _wait (distributed_c10d.py:3021) <- "
            "exchange (pipeline.py:148) <- run_schedule (schedules.py:210) <- train_step (loop.py:120)") in reason
    assert "every rank at step 7" in reason and len(reason) <= REASON_CHARS


def test_a_rank_spinning_outside_any_collective_is_named() -> None:
    ranks = {
        0: rec(0, counters(0, tp_n=(5, 4), pp_n=(3, 3), blocked="tp")),
        1: rec(1, counters(1, tp_n=(5, 4), pp_n=(4, 3), blocked="pp")),
        2: rec(2, counters(2, tp_n=(4, 4), pp_n=(3, 3)), stack="Thread 7 (active): \"MainThread\"\n"
                                                                "    busy (user.py:3)\n    main (user.py:9)"),
        3: rec(3, counters(3, tp_n=(5, 4), pp_n=(3, 3), blocked="tp")),
    }
    reason = hang_reason(ranks, SimpleNamespace(min_step=3, stragglers=[2]), 30, "restart.hang_timeout=20")
    print(reason)
    assert "rank 2 in no collective while no rank advanced (process running)" in reason
    assert "tp group [2, 3] waits in all_reduce #5 (rank 3 entered it): rank 2 never entered it" in reason
    assert "stopped" not in reason
    assert "rank 2 last seen on node-1: phase running, step 7, process running, in no collective" in reason
    assert "stack: busy (user.py:3) <- main (user.py:9)" in reason and "slowest step 3 held by rank 2" in reason


def test_a_tp_all_reduce_one_rank_never_entered_because_it_waits_elsewhere() -> None:
    """Mismatched order: rank 0 waits in tp all_reduce #7, rank 1 in the world barrier #3 rank 0 never entered."""
    ranks = {
        0: rec(0, counters(0, tp_n=(7, 6), pp_n=(2, 2), mp_n=(2, 2), blocked="tp")),
        1: rec(1, counters(1, tp_n=(6, 6), pp_n=(2, 2), mp_n=(3, 2), blocked="mp")),
        2: rec(2, counters(2, tp_n=(6, 6), pp_n=(2, 2), mp_n=(3, 2), blocked="mp")),
        3: rec(3, counters(3, tp_n=(6, 6), pp_n=(2, 2), mp_n=(3, 2), blocked="mp")),
    }
    reason = hang_reason(ranks, SUMMARY, 25, "restart.hang_timeout=20")
    print(reason)
    assert "tp group [0, 1] waits in all_reduce #7 (rank 0 entered it): rank 1 never entered it" in reason
    assert "mp group [0, 1, 2, 3] waits in barrier #3 (ranks 1-3 entered it): rank 0 never entered it" in reason
    assert "rank 0 last seen on node-0: phase running, step 7, process running, waits in tp all_reduce #7" in reason


def test_a_rank_stopped_inside_the_collective_and_ranks_without_evidence() -> None:
    ranks = {
        0: rec(0, None),
        1: rec(1, counters(1, tp_n=(9, 9), pp_n=(4, 3), blocked="pp")),
        2: rec(2, counters(2, tp_n=(21, 20), pp_n=(4, 4), blocked="tp")),
        3: rec(3, counters(3, tp_n=(21, 20), pp_n=(3, 3), blocked="tp"), process="stopped",
               stack="stopped, no stack (py-spy is not installed)"),
    }
    reason = hang_reason(ranks, SUMMARY, 22, "restart.hang_timeout=20")
    print(reason)
    assert "tp group [2, 3] waits in all_reduce #21 (ranks 2-3 entered it): rank 3 stopped inside it" in reason
    assert "pp group [1, 3] waits in batch_isend_irecv #4 (rank 1 in it): rank 3 not in it" in reason
    assert "stack: stopped, no stack (py-spy is not installed)" in reason


def test_a_rank_stopped_inside_an_earlier_operation_never_entered_the_one_its_peer_waits_in() -> None:
    """Gloo lets rank 2 finish tp all_reduce #20 and enter #21 while rank 3, stopped, never returned from #20."""
    ranks = {
        0: rec(0, counters(0, tp_n=(9, 9), pp_n=(4, 3), blocked="pp")),
        1: rec(1, counters(1, tp_n=(9, 9), pp_n=(4, 3), blocked="pp")),
        2: rec(2, counters(2, tp_n=(21, 20), pp_n=(4, 4), blocked="tp")),
        3: rec(3, counters(3, tp_n=(20, 19), pp_n=(3, 3), blocked="tp"), process="stopped"),
    }
    reason = hang_reason(ranks, SUMMARY, 22, "restart.hang_timeout=20")
    print(reason)
    assert "tp group [2, 3] waits in all_reduce #21 (rank 2 entered it): rank 3 never entered it" in reason
    assert "stopped inside it" not in reason
    assert "rank 3 last seen on node-1: phase running, step 7, process stopped (SIGSTOP or a debugger), " \
           "waits in tp all_reduce #20" in reason


def test_without_evidence_the_reason_is_what_the_coordinator_knows() -> None:
    ranks = {r: RankRecord(rank=r, node=f"n{r // 2}", phase="running", step=1 if r != 2 else 0,
                           process="stopped" if r == 2 else "") for r in range(4)}
    reason = hang_reason(ranks, SimpleNamespace(min_step=0, stragglers=[2]), 21, "restart.hang_timeout=20")
    assert reason == ("hang: no rank advanced for 21 s (restart.hang_timeout=20); rank 2 stopped (SIGSTOP or a "
                      "debugger) on n1; slowest step 0 held by rank 2; rank 2 last seen on n1: phase running, step 0, "
                      "process stopped (SIGSTOP or a debugger), no counters reported; stack: none"), reason
    # evidence withdrawn (the rank moved again after its stall was sent) counts as none
    ranks = {r: RankRecord(rank=r, node="n0", phase="running", step=1, collectives=MOVED_JSON) for r in range(4)}
    reason = hang_reason(ranks, SimpleNamespace(min_step=1, stragglers=[]), 21, "restart.hang_timeout=20")
    assert reason.endswith("; no rank sent collective counters; every rank at step 1"), reason


def test_the_reason_stays_bounded_for_a_large_job() -> None:
    """8,192 ranks, tp 8: every rank waits in its tp all_reduce #100 but rank 5000 (stopped at #99)."""
    world, size = 8192, 8
    ranks = {}
    for r in range(world):
        members = list(range(r - r % size, r - r % size + size))
        blocked = r != 5000
        c = {"in": 0 if blocked else -1, "wait_s": 1.0, "groups": [
            {"kind": TP, "members": members, "size": size, "entered": 100 if blocked else 99, "completed": 99,
             "op": "all_reduce", "since": 1.0, "wait_s": 1.0},
            {"kind": "dp", "members": list(range(r % size, world, size)), "size": world // size, "entered": 50,
             "completed": 50, "op": "all_reduce", "since": 1.0, "wait_s": 1.0}]}
        ranks[r] = rec(r, c, process="stopped" if r == 5000 else "")
    reason = hang_reason(ranks, SimpleNamespace(min_step=12, stragglers=[]), 40, "restart.hang_timeout=30")
    print(reason)
    assert len(reason) <= REASON_CHARS
    assert "rank 5000 stopped" in reason
    assert ("tp group [5000, 5001, 5002, 5003, 5004, 5005, 5006, 5007] waits in all_reduce #100 "
            "(ranks 5001-5007 entered it): rank 5000 never entered it") in reason


def test_every_member_waiting_inside_across_two_nodes_points_at_their_link() -> None:
    """A link cut between node-0 and node-1: every rank entered the mp all-reduce #5 and waits inside it;
    nobody is missing, stopped or spinning, so the two nodes wait for each other: the pair is named (and handed
    back, for the restart to keep them apart)."""
    ranks = {r: rec(r, counters(r, tp_n=(9, 9), pp_n=(4, 4), mp_n=(5, 4), blocked="mp", op={"mp": "all_reduce"}))
             for r in range(4)}
    links: list[tuple[str, str]] = []
    reason = hang_reason(ranks, SUMMARY, 7, "judged on its pace", links)
    assert links == [("node-0", "node-1")], reason
    assert ("mp group [0, 1, 2, 3] waits in all_reduce #5 with every member inside it, on nodes node-0 and node-1: "
            "each waits for the other; the link between node-0 and node-1 may be cut or failing") in reason, reason
    assert "every shown member in them" not in reason
    one_node = {r: dataclasses.replace(ranks[r], node="node-0") for r in range(4)}
    links = []
    assert "may be cut" not in hang_reason(one_node, SUMMARY, 7, "x", links) and links == []   # no link to blame


def test_a_link_cut_as_some_members_finished_the_operation_still_points_at_the_link() -> None:
    """The cut in CI: ranks 0 and 2 finished the mp all-reduce #5 (a ring lets a member finish before its peer has
    the last chunk) and wait in their tp all-reduce #10 for ranks 1 and 3, which are still inside #5 across the cut
    link. No member is missing from #5: the link is named beside the tp groups the stuck ranks never entered."""
    done = dict(tp_n=(10, 9), pp_n=(4, 4), mp_n=(5, 5), blocked="tp")
    stuck = dict(tp_n=(9, 9), pp_n=(4, 4), mp_n=(5, 4), blocked="mp", op={"mp": "all_reduce"})
    ranks = {r: rec(r, counters(r, **(done if r % 2 == 0 else stuck))) for r in range(4)}
    links: list[tuple[str, str]] = []
    reason = hang_reason(ranks, SUMMARY, 2, "judged on its pace", links)
    assert links == [("node-0", "node-1")], reason
    assert ("mp group [0, 1, 2, 3] waits in all_reduce #5 with every member inside it or past it, on nodes node-0 "
            "and node-1: each waits for the other; the link between node-0 and node-1 may be cut or failing") in reason
    assert "tp group [0, 1] waits in all_reduce #10 (rank 0 entered it): rank 1 never entered it" in reason


def test_compact_stack_reads_py_spy_and_faulthandler() -> None:
    fault = ('Thread 0x00007f01 (most recent call first):\n  File "/x/threading.py", line 320 in wait\n\n'
             'Current thread 0x00007f00 (most recent call first):\n  File "/a/b/loop.py", line 12 in step\n')
    assert compact_stack(fault) == "wait (threading.py:320)"
    assert compact_stack(PYSPY).startswith("_wait (distributed_c10d.py:3021) <- exchange (pipeline.py:148)")
    assert compact_stack("") == "none"


# -- the daemon's side ------------------------------------------------------------------------
def test_hang_watch_reports_a_stall_once_and_its_end_once() -> None:
    now = [0.0]
    w = HangWatch(10.0, clock=lambda: now[0])
    assert w.observe(3, b"a") == ""
    for t in (0.5, 0.99):
        now[0] = t
        assert w.observe(3, b"a") == ""
    now[0] = 1.0                                          # before it knows its pace: FIRST_STALL_S
    assert w.observe(3, b"a") == STALLED and w.stalled(3) == 1.0
    now[0] = 30.0
    assert w.observe(3, b"a") == ""                       # one report per stall
    now[0] = 31.0
    assert w.observe(3, b"b") == MOVED and w.stalled(3) is None
    assert w.observe(3, b"b") == ""
    now[0] = 38.0
    w.touch(3)                                            # a status record (step) moves it too
    now[0] = 38.9
    assert w.observe(3, b"b") == ""
    now[0] = 39.0
    assert w.observe(3, b"b") == STALLED
    assert hangwatch.stall_cap(20) == 10.0
    assert hangwatch.stall_cap(None) == hangwatch.STALL_MAX_S


def test_steps_read_before_the_first_look_at_the_counters_count() -> None:
    """A fast job's ranks report all their steps, then stall, between two looks (0.5 s): judged on the floor, not
    on the cap for ranks that never stepped."""
    now = [0.0]
    w = HangWatch(30.0, clock=lambda: now[0])
    for _ in range(7):                                    # steps 1-7 in 0.35 s, read before any look
        now[0] += 0.05
        w.touch(2, stepped=True)
    assert w.stall_after(2) == hangwatch.STALL_FLOOR_S
    now[0] += 0.5
    assert w.observe(2, b"in all_reduce #8") == ""        # the first look: its counters as they stay
    now[0] += hangwatch.STALL_FLOOR_S
    assert w.observe(2, b"in all_reduce #8") == STALLED


def test_hang_watch_adapts_its_stall_time_to_the_rank_once_it_stepped() -> None:
    now = [0.0]
    w = HangWatch(30.0, clock=lambda: now[0])
    w.observe(0, b"a")
    assert w.stall_after(0) == hangwatch.FIRST_STALL_S    # before it knows its pace: a second
    w.touch(0, stepped=True)
    for i in range(10):                                   # collectives every 0.1 s
        now[0] += 0.1
        assert w.observe(0, bytes([i])) == ""
    assert w.stall_after(0) == hangwatch.STALL_FLOOR_S    # 3 x 0.1 s is under the floor
    now[0] += 0.4
    assert w.observe(0, bytes([9])) == ""                 # still 0.4 s: not yet
    now[0] += 0.2
    assert w.observe(0, bytes([9])) == STALLED            # still 0.6 s: stalled
    now[0] += 1.0
    assert w.observe(0, b"z") == MOVED                    # a reported stall is no usual stretch:
    assert w.stall_after(0) == hangwatch.STALL_FLOOR_S    # the pause did not raise the stall time
    w2 = HangWatch(30.0, clock=lambda: now[0])            # a rank whose stretches are 8 s of compute
    w2.observe(1, b"a")
    w2.touch(1, stepped=True)
    for i in range(5):
        now[0] += 8.0
        w2.touch(1, stepped=True)
    assert w2.stall_after(1) == 24.0
    now[0] += 20.0
    assert w2.observe(1, b"a") == ""
    now[0] += 5.0
    assert w2.observe(1, b"a") == STALLED
    w3 = HangWatch(30.0, clock=lambda: now[0])            # a plain script: its counters' moves are its pace
    w3.observe(4, b"a")
    for i in range(hangwatch.MOVES_KNOWN + 3):
        now[0] += 2.0
        w3.observe(4, bytes([i]))
    assert w3.stall_after(4) == 6.0


def test_cpu_time_outside_collectives_is_computing_and_a_throttled_rank_is_not_stopped() -> None:
    """The daemon's CPU evidence (``HangWatch.sample``): CPU time that advanced within COMPUTE_S while the rank
    was in no collective is computing (said in its stall's evidence, re-sent as CHANGED when that changes); CPU
    time inside a collective is not (NCCL spins while it waits); a process seen stopped is reported stopped only
    once its CPU time has been still for CPU_STILL_S (a rank SIGSTOPped and SIGCONTed in turn runs, slowly), and
    is stalled at once."""
    now = [0.0]
    w = HangWatch(10.0, clock=lambda: now[0])
    assert w.observe(1, b"a") == ""
    w.touch(1, stepped=True)
    ticks = 100
    for _ in range(30):                                   # 3 s of compute, counters still
        now[0] += 0.1
        ticks += 1000                                     # a microsecond a look: a CPU throttled hard
        w.sample(1, ticks, in_collective=False)
        assert w.process(1, "stopped") == ""              # stopped at this look, but it ran within CPU_STILL_S
    assert w.computing(1) and w.observe(1, b"a") == STALLED
    assert '"computing":true' in evidence_json(None, 2.0, computing=w.computing(1))
    now[0] += 0.5
    w.sample(1, ticks + 1, in_collective=False)
    assert w.observe(1, b"a") == ""                       # still computing: nothing new to say
    now[0] += hangwatch.CPU_STILL_S + 0.01
    w.sample(1, ticks + 1, in_collective=False)           # no CPU time for CPU_STILL_S: stopped for good, but
    assert w.process(1, "stopped") == "stopped" and w.computing(1) and w.observe(1, b"a") == ""  # computing still
    now[0] += hangwatch.COMPUTE_S - hangwatch.CPU_STILL_S
    w.sample(1, ticks + 1, in_collective=False)           # its CPU time still for COMPUTE_S: hung or asleep
    assert not w.computing(1) and w.observe(1, b"a") == hangwatch.CHANGED
    assert w.observe(1, b"a") == ""
    w.sample(1, ticks + 50, in_collective=True)           # CPU inside a collective: waiting, not computing
    assert not w.computing(1) and w.process(1, "stopped") == "" and w.observe(1, b"a") == ""
    assert w.keep(1, '{"x":1}') == ('{"x":1}', "") and w.keep(1, stack="s") == ('{"x":1}', "s")
    assert w.observe(1, b"b") == MOVED and w.keep(1) == ("", "")
    assert '"computing"' not in evidence_json(None, 2.0)
    assert w.observe(2, b"x") == "" and w.observe(2, b"x", stopped=True) == STALLED   # stopped: stalled at once


def test_the_counter_file_says_whether_the_rank_waits_in_an_operation(tmp_path) -> None:
    from rankctl.contract.files import collfiles
    from rankctl.runtime.collectives import CollectiveCounters

    c = CollectiveCounters(str(tmp_path), 0, 2, {"tp": [0, 1]})
    slot = c.slot(None)
    assert not collfiles.in_collective(hangwatch.signature(str(tmp_path), 0))
    since = c.enter(slot, "all_reduce", blocking=True)
    assert collfiles.in_collective(hangwatch.signature(str(tmp_path), 0))
    c.leave(slot, since)
    assert not collfiles.in_collective(hangwatch.signature(str(tmp_path), 0))
    assert not collfiles.in_collective(None) and not collfiles.in_collective(b"RKCL")
    c.close()


def test_a_process_sample_reads_the_main_threads_cpu_time_and_a_stop(spinner) -> None:
    """``worker.runs.procstat.sample``: a spinning process is runnable and its CPU nanoseconds advance; stopped
    (SIGSTOP) it is "stopped" and they do not; a gone process is ``GONE``."""
    from rankctl.worker.runs.procstat import GONE, sample

    p, _ = spinner
    first = sample(p.pid)
    assert first.word == "" and isinstance(first.cpu_ns, int)
    time.sleep(0.05)
    assert sample(p.pid).cpu_ns > first.cpu_ns
    os.kill(p.pid, signal.SIGSTOP)
    try:
        assert wait_state(p.pid, "stopped")
        held = sample(p.pid)
        time.sleep(0.05)
        assert sample(p.pid).cpu_ns == held.cpu_ns and not held.runnable
    finally:
        os.kill(p.pid, signal.SIGCONT)
    assert sample(2 ** 22 + 12345) == GONE


def wait_state(pid: int, want: str) -> bool:
    from rankctl.worker.runs.procstat import sample

    for _ in range(200):
        if sample(pid).word == want:
            return True
        time.sleep(0.01)
    return False


def test_evidence_is_bounded_and_puts_the_waited_group_first() -> None:
    c = counters(1, tp_n=(20, 20), pp_n=(11, 10), blocked="pp")
    c["groups"] += [{"kind": f"k{i}", "members": list(range(1000)), "size": 1000, "entered": 1, "completed": 1,
                     "op": "all_reduce", "since": 1.0, "wait_s": 0.0} for i in range(28)]
    text = evidence_json(c, 12.34, limit=1500)
    assert len(text) <= 1500 and '"more":' in text
    doc = __import__("json").loads(text)
    assert doc["groups"][0]["kind"] == PP and doc["groups"][0]["in"] is True and doc["still_s"] == 12.3
    assert all(len(g["members"]) <= hangwatch.MEMBERS_OTHER for g in doc["groups"][1:])
    assert __import__("json").loads(evidence_json(None, 3.0)) == {"still_s": 3.0, "groups": [], "counters": False}


SPIN = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
def spin_here():
    print("up", flush=True)  # inside: a stack taken after "up" shows spin_here (CI caught it at <module>)
    while True:
        time.sleep(0.05)
spin_here()
"""


@pytest.fixture
def spinner(tmp_path):
    log = tmp_path / "rank-0.log"
    with open(log, "wb") as out:
        p = subprocess.Popen([sys.executable, "-c", SPIN], stdout=out, stderr=out)
    deadline = time.monotonic() + 30
    while "up" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield p, str(log)
    p.kill()
    p.wait()


def test_stack_of_a_running_and_a_stopped_process(spinner) -> None:
    p, log = spinner
    py_spy = hangwatch.find_py_spy()
    fault = asyncio.run(hangwatch.stack_of(p.pid, False, log, None))  # the faulthandler path
    assert "spin_here" in compact_stack(fault), fault
    os.kill(p.pid, signal.SIGSTOP)
    try:
        assert asyncio.run(hangwatch.stack_of(p.pid, True, log, None)).startswith("stopped, no stack")
        if py_spy is None:
            pytest.skip("py-spy is not installed")
        stack = asyncio.run(hangwatch.stack_of(p.pid, True, log, py_spy))
        assert "spin_here" in compact_stack(stack), stack  # --nonblocking reads a stopped process
    finally:
        os.kill(p.pid, signal.SIGCONT)


def test_a_spin_in_python_is_the_same_main_thread_stack_twice_holding_the_gil() -> None:
    """``hangwatch.spins`` reads two ``py-spy dump`` answers: the main thread holding the GIL at the same frames
    both times spins; torch computing (the GIL released: ``(active)``), another frame, or another thread's
    change is not (or, for the last, still is). ``HangWatch.spin`` makes a computing stall a spin until the rank
    moves."""
    spin = 'Thread 7 (active+gil): "MainThread"\n    spin (job.py:5)\n    <module> (job.py:13)\n'
    other = 'Thread 8 (idle): "Thread-1"\n    wait (threading.py:320)\n'
    assert hangwatch.spins(spin + other, spin + other.replace("320", "331"))
    assert not hangwatch.spins(spin, spin.replace("job.py:5", "job.py:6"))
    assert not hangwatch.spins(spin, spin.replace("active+gil", "active"))
    assert not hangwatch.spins("no stack: py-spy failed: x", "no stack: py-spy failed: x")
    now = [0.0]
    w = HangWatch(10.0, clock=lambda: now[0])
    w.observe(1, b"a")
    w.touch(1, stepped=True)
    for i in range(1, 8):
        now[0] += 0.1
        w.sample(1, i * 10 ** 6, in_collective=False)
    assert w.observe(1, b"a") == STALLED and w.computing(1)
    w.spin(1)
    assert not w.computing(1) and w.spinning(1) and w.observe(1, b"a") == ""
    assert '"spinning":true' in evidence_json(None, 1.0, spinning=True)
    now[0] += 0.1
    assert w.observe(1, b"b") == MOVED and not w.spinning(1)


# -- issue 52: when every rank waits, is it certain? -------------------------------------------------------------
from rankctl.coordinator.diagnosis.deadlock import blocked  # noqa: E402
from rankctl.coordinator.diagnosis.hangs import waiting_line  # noqa: E402


def test_a_cycle_of_waits_or_a_mismatch_is_a_deadlock_and_a_group_all_inside_is_a_link() -> None:
    """Ranks 0, 1 wait in their tp all-reduce #9, which rank 1 has entered only 8 times: rank 1 waits in the world
    barrier #2 that ranks 2, 3 ... never entered, and they wait in their own tp all-reduce for each other:
    following whom each waits for ends in a group every member of which is inside it (a link, or a slow transfer);
    a cycle (rank 1 waits in the barrier for rank 0, which waits in tp for rank 1) is a deadlock, and so are two
    members of one group at the same count in different operations."""
    cycle = {0: rec(0, counters(0, tp_n=(9, 8), pp_n=(3, 3), mp_n=(1, 1), blocked="tp")),
             1: rec(1, counters(1, tp_n=(8, 8), pp_n=(3, 3), mp_n=(2, 1), blocked="mp")),
             2: rec(2, counters(2, tp_n=(8, 8), pp_n=(3, 3), mp_n=(2, 1), blocked="mp")),
             3: rec(3, counters(3, tp_n=(8, 8), pp_n=(3, 3), mp_n=(2, 1), blocked="mp"))}
    assert blocked(cycle, [0]) == "deadlock"
    inside = {0: rec(0, counters(0, tp_n=(9, 8), pp_n=(3, 3), blocked="tp")),
              1: rec(1, counters(1, tp_n=(9, 8), pp_n=(3, 3), blocked="tp"))}
    assert blocked(inside, [0]) == ""        # one node: nothing between nodes to be cut
    across = {r: dataclasses.replace(inside[r], node=f"node-{r}") for r in inside}
    assert blocked(across, [0]) == "link"
    mismatch = {0: rec(0, counters(0, tp_n=(9, 8), pp_n=(3, 3), blocked="tp")),
                1: rec(1, counters(1, tp_n=(9, 8), pp_n=(3, 3), blocked="tp", op={"tp": "barrier"}))}
    assert blocked(mismatch, [0]) == "deadlock"
    named: list[int] = []
    line = waiting_line(mismatch, named)
    assert "at #9 in different operations: rank 0 in all_reduce, rank 1 in barrier: a mismatch" in line, line
    assert named == [0, 1]
    unknown = {0: cycle[0]}                  # rank 1 sent nothing: it may be moving
    assert blocked(unknown, [0]) == ""


def test_a_healthy_connection_loses_no_data() -> None:
    """``tcpstat.unacked`` on this process's own loopback connection, busy and idle: nothing unanswered."""
    import socket

    from rankctl.worker.runs import tcpstat

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        client.sendall(b"x" * 65536)
        assert tcpstat.unacked(os.getpid()) == 0
        peer.recv(65536)
        assert tcpstat.unacked(os.getpid()) == 0 and tcpstat.unacked(2 ** 22 + 7) == 0   # (no such process)
    finally:
        for s in (client, peer, server):
            s.close()
