"""Stragglers by compute time (coordinator.skew.ComputeSkew), without processes or a network: the rule
(margin, floor, consecutive steps, hysteresis), the warm-up, the peers (pipeline stages), the cost per
report, and how a flagged rank reaches GetJob and ``ctl status``."""

from __future__ import annotations

from rankctl.cli.view.render import job_to_dict, node_to_dict, summary_text
from rankctl.coordinator.api.convert import summary_to_pb
from rankctl.coordinator.diagnosis.progress import JobProgress
from rankctl.coordinator.diagnosis.skew import (
    RECOVERED_STEPS, SHOWN, SLOW_LEAST, SLOW_STEPS, SLOW_WINDOW, WARMUP_STEPS, ComputeSkew, SlowRank, pipeline_peers,
)
from rankctl.coordinator.model.records import JobRecord
from rankctl.coordinator.model.states import JobState
from rankctl.proto import rankctl_pb2 as pb

NODES = ["node-a", "node-b"]


def node_of(rank: int) -> str:
    return NODES[rank // 2]


def run(skew: ComputeSkew, steps: list[dict[int, float]]) -> list[list[tuple[int, bool]]]:
    """Feed each step's samples (rank -> compute_s) then judge; the changes after each step."""
    out = []
    for samples in steps:
        for rank, compute in samples.items():
            skew.sample(rank, compute)
        skew.judge()
        out.append([(fig.rank, flagged) for fig, flagged in skew.take_changes()])
    return out


def steps_of(*rows: tuple[float, ...]) -> list[dict[int, float]]:
    return [dict(enumerate(row)) for row in rows]


WARM = (5.0, 5.0, 5.0, 5.0)   # a warm-up step: skipped whatever it says
WARMUP = (WARM,) * WARMUP_STEPS
QUIET = [[]] * (WARMUP_STEPS - 1)   # the changes after the warm-up steps but the last
EVEN = (0.10, 0.11, 0.10, 0.10)
SLOW3 = (0.10, 0.11, 0.10, 0.21)


def test_a_rank_is_flagged_after_three_consecutive_over_judgements_with_its_node() -> None:
    skew = ComputeSkew(4, node_of=node_of)
    assert (SLOW_WINDOW, SLOW_LEAST, SLOW_STEPS, RECOVERED_STEPS) == (5, 3, 3, 5)
    # judged from its 3rd sample (a window of 3), flagged at the 3rd over judgement in a row
    changes = run(skew, steps_of(*WARMUP, SLOW3, SLOW3, SLOW3, SLOW3, SLOW3, SLOW3))
    assert changes == QUIET + [[], [], [], [], [], [(3, True)], []]
    (slow,) = skew.worst()
    assert (slow.rank, slow.node, slow.compute_s, slow.median_s, slow.steps) == (3, "node-b", 0.21, 0.10, 4)


def test_a_rank_that_becomes_slow_is_flagged_once_most_of_its_window_is_slow() -> None:
    skew = ComputeSkew(4, node_of=node_of)
    changes = run(skew, steps_of(*WARMUP, *[EVEN] * 5, *[SLOW3] * 5))
    assert changes == QUIET + [[]] * 10 + [[(3, True)]]


def test_one_noisy_step_is_not_enough() -> None:
    skew = ComputeSkew(4, node_of=node_of)
    changes = run(skew, steps_of(*WARMUP, EVEN, EVEN, *[SLOW3, EVEN, EVEN] * 4, *[SLOW3, SLOW3, EVEN, EVEN, EVEN] * 3))
    assert all(c == [] for c in changes) and skew.slow == {}


def test_the_warm_up_samples_are_skipped() -> None:
    skew = ComputeSkew(4, node_of=node_of)
    slow_start = [(0.1, 0.1, 0.1, 9.0 / (k + 1)) for k in range(WARMUP_STEPS)]
    assert run(skew, steps_of(*slow_start, EVEN, EVEN, EVEN, EVEN)) == [[]] * (WARMUP_STEPS + 4)
    skew = ComputeSkew(4)
    for _ in range(WARMUP_STEPS):
        for rank in range(4):
            skew.sample(rank, 0.1)
    assert skew.sampled == 0 and not skew.due()


def test_a_4_rank_job_whose_last_rank_starts_slowly_is_never_flagged_but_a_later_slowdown_is() -> None:
    """Issue 23's case: 4 ranks at 0.13-0.17 s steps; rank 3 (forked last, on local-1) computes its first
    steps 2-4x slower while its peers' start-up competes for the CPU. With one warm-up step it was flagged
    at its 6th step and unflagged at its 9th; the warm-up (WARMUP_STEPS per rank) takes in its slow start."""
    skew = ComputeSkew(4, node_of=lambda r: "local-0" if r < 2 else "local-1")
    noise = (0.101, 0.098, 0.104, 0.099, 0.102)
    start = [(0.9, 0.25, 0.12, 1.9), (0.1, 0.1, 0.1, 0.42), (0.1, 0.1, 0.1, 0.38), (0.1, 0.1, 0.1, 0.35)]
    steady = [tuple(noise[(k + r) % 5] for r in range(4)) for k in range(30)]
    assert run(skew, steps_of(*start, *steady)) == [[]] * 34 and skew.judged > 20
    later = [(*row[:3], 0.3) for row in steady[:5]]   # the same rank slowed once warm: flagged
    assert [c for c in run(skew, steps_of(*later)) if c] == [[(3, True)]]
    assert skew.slow[3].node == "local-1"


def test_no_rank_is_judged_before_every_rank_of_its_stage_passed_its_warm_up() -> None:
    # pp2 over 4 ranks (stride 2): stage 0 = ranks 0, 1 (0.1 s); stage 1 = ranks 2, 3 (0.3 s: the loss)
    skew = ComputeSkew(4, stride=2, pp=2)
    staged = (0.1, 0.1, 0.3, 0.3)
    late = [dict(enumerate(staged[:3]))] * (WARMUP_STEPS + 8)   # rank 3 not heard from yet
    # rank 2 alone in its stage would be judged against the job's median (0.1) and flagged
    assert run(skew, late) == [[]] * len(late)
    assert skew.warm().tolist() == [True, True, False, False] and skew.judged > 0
    assert run(skew, steps_of(*[staged] * (WARMUP_STEPS + 8))) == [[]] * (WARMUP_STEPS + 8)
    assert skew.warm().all()
    assert run(skew, steps_of(*[(0.1, 0.1, 0.3, 0.6)] * 5))[-1] == [(3, True)]   # judged now, in its stage


def test_tiny_steps_need_the_absolute_floor_too() -> None:
    skew = ComputeSkew(4)
    tiny = (0.001, 0.001, 0.001, 0.009)   # 9x the median but 8 ms over: scheduler noise, not a straggler
    assert run(skew, steps_of(*WARMUP, *[tiny] * 8)) == QUIET + [[]] * 9
    over_floor = (0.001, 0.001, 0.001, 0.020)
    assert run(skew, steps_of(*[over_floor] * 5)) == [[]] * 4 + [[(3, True)]]


def test_unflagged_only_after_five_normal_judgements_and_not_between_the_margins() -> None:
    skew = ComputeSkew(4, node_of=node_of)
    run(skew, steps_of(*WARMUP, *[SLOW3] * 5))
    assert list(skew.slow) == [3]
    between = (0.10, 0.10, 0.10, 0.125)   # 1.25x: neither over (1.3x) nor normal (1.15x) again
    assert run(skew, steps_of(*[between] * 6)) == [[]] * 6
    assert list(skew.slow) == [3] and skew.slow[3].compute_s == 0.125   # its current figures
    # normal from the 3rd EVEN on (its window's median), unflagged at the 5th normal judgement in a row
    assert run(skew, steps_of(*[EVEN] * 7)) == [[]] * 6 + [[(3, False)]]
    assert skew.slow == {} and skew.worst() == []
    assert run(skew, steps_of(*[SLOW3] * 4)) == [[]] * 4   # counts again from zero
    assert run(skew, steps_of(SLOW3)) == [[(3, True)]]


def test_a_flagged_rank_whose_compute_dips_for_a_few_steps_stays_flagged() -> None:
    """A rank throttled by stops (SIGSTOP/SIGCONT, a co-tenant) computes normally for the steps whose stops land
    in a collective: four normal judgements in a row (four normal samples, then its window's median lagging
    two more) do not clear its flag, and nothing flaps."""
    skew = ComputeSkew(4, node_of=node_of)
    run(skew, steps_of(*WARMUP, *[SLOW3] * 5))
    assert list(skew.slow) == [3]
    assert run(skew, steps_of(*[EVEN] * 4, *[SLOW3] * 3)) == [[]] * 7
    assert list(skew.slow) == [3] and skew.slow[3].compute_s == 0.21


def _spec(world: int, parallel: dict):
    from rankctl.kinds.spec import build_spec

    return build_spec({"name": "j", "kind": "comm-check", "resources": {"nodes": 1, "slots_per_node": world},
                       "parallel": parallel})


def test_peers_are_the_ranks_of_the_same_pipeline_stage() -> None:
    # tp2 pp2 over 8 ranks (dp2): stage = rank // 4; the last stage computes the loss and is slower
    job = JobRecord(id="j", name="j", kind="train", spec=_spec(8, {"tp": 2, "pp": 2}), state=JobState.RUNNING,
                    reason="", world_size=8, slots_per_node=4, created_at=0.0, nodes=["n0", "n1"])
    assert pipeline_peers(job) == (4, 2)
    skew = ComputeSkew(8, *pipeline_peers(job))
    staged = (0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3)
    assert run(skew, steps_of(*[staged] * (WARMUP_STEPS + 8))) == [[]] * (WARMUP_STEPS + 8)
    one_slow = (0.1, 0.25, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3)   # under the job's median 0.3, 2.5x its stage's
    assert run(skew, steps_of(*[one_slow] * 5))[-1] == [(1, True)]
    flat = ComputeSkew(8)   # all ranks as peers: the whole last stage would be flagged
    assert run(flat, steps_of(*[staged] * (WARMUP_STEPS + 5)))[-1] == [(4, True), (5, True), (6, True), (7, True)]


def test_no_pipeline_or_an_unreadable_layout_makes_all_ranks_peers() -> None:
    def job(parallel) -> JobRecord:
        return JobRecord(id="j", name="j", kind="train", spec=_spec(4, parallel), state=JobState.RUNNING,
                         reason="", world_size=4, slots_per_node=2, created_at=0.0)

    assert pipeline_peers(job({"tp": 2})) == (1, 1)
    assert pipeline_peers(job({"tp": 3, "pp": 2})) == (1, 1)  # 4 ranks do not lay out as tp3 pp2


def test_judgements_cost_in_proportion_to_the_reports_at_4096_ranks() -> None:
    world, steps, slow_rank = 4096, 6 + WARMUP_STEPS, 1234
    progress = JobProgress(world)
    progress.peers = (1, 1, lambda r: f"node-{r // 8}")
    reports = 0
    for step in range(1, steps + 1):
        for rank in range(world):   # every rank's report of this step, one at a time
            progress.compute_sample(rank, 0.2 if rank == slow_rank else 0.1 + (rank % 7) * 0.001)
            progress.moved_step(rank, step - 1, step)
            reports += 1
    skew = progress.skew
    assert skew.judged == steps - WARMUP_STEPS   # once per step the slowest rank finished, after the warm-up
    assert skew.work <= 2 * reports   # each judgement scans the world once, paid for by >= world/2 reports
    assert [(s.rank, s.node) for s in progress.summary().slow] == [(slow_rank, "node-154")]


def test_coalesced_reports_judge_only_when_half_the_ranks_have_a_new_sample() -> None:
    skew = ComputeSkew(4)
    run(skew, steps_of(*WARMUP, *[EVEN] * 3))
    assert skew.judged == 3
    skew.sample(3, 0.5)
    skew.judge()   # 1 fresh of 4: not due
    assert skew.judged == 3 and skew.fresh == 1
    skew.sample(0, 0.1)
    skew.judge()
    assert skew.judged == 4 and skew.fresh == 0


def test_reported_compute_reaches_the_summary_and_ctl_status_bounded_to_the_worst() -> None:
    world = 64
    progress = JobProgress(world)
    progress.peers = (1, 1, lambda r: f"node-{r // 4}")
    for step in range(1, 6 + WARMUP_STEPS):
        for rank in range(world):
            st = pb.RankStatus(rank=rank, step=step, compute_s=0.1 + (0.01 * rank if rank >= 40 else 0.0))
            progress.step_figures(step, st)
            progress.moved_step(rank, step - 1, step)
    summary = progress.summary()
    assert len(summary.slow) == SHOWN and summary.slow[0].rank == 63   # the worst first, 24 flagged
    assert len(progress.skew.slow) == 24
    msg = summary_to_pb(summary)
    assert [s.rank for s in msg.slow] == list(range(63, 63 - SHOWN, -1))
    job = pb.Job(id="j", world_size=world, state=pb.JOB_STATE_RUNNING, summary=msg, stopping=2)
    d = job_to_dict(job)
    assert d["stopping"] == 2
    assert d["summary"]["slow"][0] == {"rank": 63, "node": "node-15", "compute_s": summary.slow[0].compute_s,
                                       "median_s": summary.slow[0].median_s, "steps": 3}
    text = summary_text(d["summary"], world).plain
    assert "straggler: rank 63 on node-15: compute 0.730 s per step vs median 0.100 s of its peers (7.3x)" in text
    assert "12 more straggler(s) by compute" in text


def test_a_slow_rank_figures_render_and_nodes_say_draining() -> None:
    assert SlowRank(3, "n", 0.2, 0.1, 4).as_dict() == {"rank": 3, "node": "n", "compute_s": 0.2, "median_s": 0.1,
                                                       "steps": 4}
    d = node_to_dict(pb.Node(name="n", draining=True, excluded_for=["j1"]))
    assert d["draining"] is True and d["excluded_for"] == ["j1"]


def test_a_flapping_rank_is_told_flagged_once_and_cleared_once() -> None:
    """Issue 53, item 14: about 20 "straggler / no longer a straggler" events in one run on a busy machine. A rank
    gets one event when first flagged and one when then cleared, at most; ``ctl status`` still shows who is slow."""
    from types import SimpleNamespace

    from rankctl.coordinator.diagnosis.progress import JobProgress
    from rankctl.coordinator.diagnosis.skew import SlowRank
    from rankctl.coordinator.jobs.reports import ReportApplier

    said: list[str] = []
    book = SimpleNamespace(event=lambda job, kind, message, **kw: said.append(message))
    reports = ReportApplier(book, clock=lambda: 0.0)  # type: ignore[arg-type]
    progress = JobProgress(4)
    slow = SlowRank(rank=3, node="n1", compute_s=0.2, median_s=0.1, steps=3)
    for step in range(10):                        # flagged, cleared, flagged, cleared ... (a throttled rank)
        reports._straggler_events(None, progress, step, [(slow, step % 2 == 0)])  # type: ignore[arg-type]
    assert [m.split(" (")[0] for m in said] == ["rank 3 on n1 is a straggler", "rank 3 on n1 is no longer a straggler"]
