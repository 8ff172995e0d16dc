"""Prometheus metrics: the coordinator's collector on an in-process core (fake clock, fake nodes), and one
worker daemon's /metrics endpoint over HTTP on loopback. Parsed with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rankctl.coordinator.model.histogram import Histogram, exponential_bounds
from rankctl.coordinator.web.metrics import FINISHED_KEPT, FINISHED_KEPT_S, CoordinatorMetrics
from rankctl.coordinator.diagnosis.progress import STEP_TIME_BUCKETS, JobProgress
from rankctl.coordinator.model.states import JobState
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.daemon.daemon import WorkerDaemon
from rankctl.worker.daemon.metrics import WorkerMetrics, serve_metrics
from figured import FIGURED, figured_kind  # noqa: F401 - the module's autouse fixture
from test_core import World, make_world
from test_defects_worker import FakeCoordinator, RecordingLauncher, config, serve, until

S = JobState
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def job_yaml(name: str = "tr", nodes: int = 2, slots: int = 2, tp: int = 2, restarts: int = 0,
             kind: str = "comm-check") -> str:
    return (f"name: {name}\nkind: {kind}\nresources: {{nodes: {nodes}, slots_per_node: {slots}}}\n"
            f"parallel: {{tp: {tp}}}\nrestart: {{max_restarts: {restarts}}}\n")


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    yield w
    w.store.close()


def parse(body: bytes) -> Series:
    """(sample name, sorted labels) -> value of every sample."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def scrape(world: World, **kw) -> Series:
    body, content_type = CoordinatorMetrics(world.core, **kw).render()
    assert content_type.startswith("text/plain; version=")
    return parse(body)


def get(series: Series, sample: str, /, **labels: str) -> float:
    return series[(sample, tuple(sorted(labels.items())))]


def names(series: Series) -> set[str]:
    return {name for name, _ in series}


def send(world: World, job, phase: str, step: int = 0, figures=lambda rank: {}, nodes=None) -> None:  # noqa: ANN001
    """One ReportBatch per node of ``job`` (every rank of it; of the node indexes ``nodes`` only when
    given), then one group commit."""
    for k, name in enumerate(job.nodes):
        if nodes is not None and k not in nodes:
            continue
        fake, spn = world.nodes[name], job.slots_per_node
        reports = []
        for r in range(k * spn, (k + 1) * spn):
            fake.seq += 1
            status = pb.RankStatus(rank=r, node=name, phase=phase, step=step, **figures(r))
            reports.append(pb.RankReport(job_id=job.id, attempt=job.attempt, status=status, seq=fake.seq))
        world.core.rank_reports(fake.session, reports)
    assert world.core.flush()


def training(world: World, nodes: int = 2, slots: int = 2, steps: int = 2, slow_rank: int = -1):  # noqa: ANN201
    """A RUNNING job that finished ``steps`` steps; rank ``slow_rank`` computes 5x slower than its peers."""
    for i in range(nodes):
        world.connect(f"n{i}", slots=slots)
    job = world.core.submit(job_yaml(nodes=nodes, slots=slots, tp=min(slots, 8), kind=FIGURED.name))
    send(world, job, "running")
    assert job.state is S.RUNNING
    for step in range(1, steps + 1):
        send(world, job, "running", step, lambda r, step=step: {
            "figures": {"loss": 3.0 - step / 10, "tokens_per_s": 1000.0 + r, "lr": 0.1,
                        **({"val_loss": 2.5} if step == 1 else {})},
            "step_time_s": 0.5 + r / 100, "compute_s": 0.5 if r == slow_rank else 0.1})
    return job


def test_coordinator_series_describe_jobs_queue_nodes_and_a_running_job(world: World) -> None:
    job = training(world)
    queued = world.core.submit(job_yaml("later"))
    assert queued.state is S.PENDING
    world.clock.t += 30
    s = scrape(world)
    assert get(s, "rankctl_jobs", state="RUNNING") == 1 and get(s, "rankctl_jobs", state="PENDING") == 1
    assert get(s, "rankctl_jobs", state="SUCCEEDED") == 0
    assert get(s, "rankctl_job_queue_length") == 1 and get(s, "rankctl_job_queue_oldest_wait_seconds") == 30
    assert get(s, "rankctl_job_queue_wait_seconds_count") == 1          # the running job, placed at once
    assert get(s, "rankctl_job_queue_wait_seconds_bucket", le="1.0") == 1
    assert get(s, "rankctl_nodes", state="READY") == 2 and get(s, "rankctl_nodes", state="LOST") == 0
    assert get(s, "rankctl_node_heartbeat_age_seconds", node="n0") == 30
    assert get(s, "rankctl_slots", state="total") == 4 and get(s, "rankctl_slots", state="free") == 0
    assert get(s, "rankctl_rank_reports_total") == 4 * 3                # running + 2 steps, 4 ranks
    assert get(s, "rankctl_job_restarts_total", cause="failure") == 0
    assert get(s, "rankctl_job_info", job_id=job.id, job_name="tr", kind="figured", state="RUNNING") == 1
    assert get(s, "rankctl_job_ranks", job_id=job.id, phase="running") == 4
    assert get(s, "rankctl_job_step", job_id=job.id) == 2 and get(s, "rankctl_job_attempt", job_id=job.id) == 1
    assert get(s, "rankctl_job_loss", job_id=job.id) == pytest.approx(2.8)
    assert get(s, "rankctl_job_val_loss", job_id=job.id) == 2.5             # step 1's, the last that had one
    assert get(s, "rankctl_job_tokens_per_second", job_id=job.id) == 1000.0  # the slowest rank's
    assert get(s, "rankctl_job_step_time_seconds", job_id=job.id, stat="min") == 0.5
    assert get(s, "rankctl_job_step_time_seconds", job_id=job.id, stat="mean") == pytest.approx(0.515)
    assert get(s, "rankctl_job_step_time_seconds", job_id=job.id, stat="max") == pytest.approx(0.53)
    assert get(s, "rankctl_job_step_duration_seconds_count", job_id=job.id) == 2   # one per completed step
    assert get(s, "rankctl_job_step_duration_seconds_bucket", job_id=job.id, le="0.512") == 0   # each step's max: 0.53
    assert get(s, "rankctl_job_step_duration_seconds_bucket", job_id=job.id, le="0.645") == 2
    assert get(s, "rankctl_job_step_duration_seconds_sum", job_id=job.id) == pytest.approx(1.06)
    assert get(s, "rankctl_job_stragglers", job_id=job.id) == 0
    assert not any(n.startswith("rankctl_rank_straggler") or n.startswith("rankctl_rank_step") for n in names(s))
    assert not any(dict(labels).get("job_id") == queued.id for _, labels in s)   # pending jobs: no per-job series
    assert not any("job" in dict(labels) for _, labels in s)   # the scraper's label: Prometheus would rename it


def test_restarts_and_every_attempts_queue_wait_are_counted(world: World) -> None:
    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml(restarts=1))
    world.clock.t += 7
    world.report(job.id, 3, "failed", code=1, error="boom")
    for r in range(3):
        world.report(job.id, r, "exited", code=-9)
    assert job.attempt == 2 and job.state is S.STARTING
    s = scrape(world)
    assert get(s, "rankctl_job_restarts_total", cause="failure") == 1
    assert get(s, "rankctl_job_restarts_total", cause="drain") == 0
    assert get(s, "rankctl_job_queue_wait_seconds_count") == 2
    assert get(s, "rankctl_job_attempt", job_id=job.id) == 2


def test_stragglers_are_counted_per_job_and_flagged_per_rank_only_when_asked(world: World) -> None:
    job = training(world, steps=8, slow_rank=3)
    plain, ranked = scrape(world), scrape(world, per_rank=True)
    assert get(plain, "rankctl_job_stragglers", job_id=job.id) == 1
    flags = {dict(labels)["rank"]: v for (name, labels), v in ranked.items() if name == "rankctl_rank_straggler"}
    assert flags == {"0": 0, "1": 0, "2": 0, "3": 1}
    assert get(ranked, "rankctl_rank_step", job_id=job.id, rank="3") == 8


def test_series_without_per_rank_do_not_grow_with_the_world(tmp_path: Path) -> None:
    counts = []
    for slots in (1, 1024):   # 4 ranks, then 4096, on the same 4 nodes
        world = make_world(tmp_path / str(slots))
        training(world, nodes=4, slots=slots, steps=3)
        counts.append(len(scrape(world)))
        world.store.close()
    assert counts[0] == counts[1]


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    h = Histogram((1.0, 5.0))
    for v in (0.5, 1.0, 3.0, 9.0):
        h.observe(v)
    assert h.buckets() == [("1.0", 2), ("5.0", 3), ("+Inf", 4)] and h.total == 13.5


def timed(dt: float):  # noqa: ANN201
    return lambda rank: {"step_time_s": dt + rank / 1000}


def test_every_completed_step_is_observed_once_when_a_daemon_coalesces_step_reports(world: World) -> None:
    """Issue 23: 348 observations for a 400-step job. A node's backlog coalesces its ranks' step reports
    (the newest per rank), so the slowest rank can jump several steps: each of them is observed once."""
    for n in ("n0", "n1"):
        world.connect(n)
    job = world.core.submit(job_yaml())
    send(world, job, "running")
    seen = {0: [1, 2, 3, 4, 7, 8, 9, 12], 1: [1, 3, 4, 5, 6, 9, 10, 12]}   # steps each node's reports carry
    for step in range(1, 13):
        for k, steps in seen.items():
            if step in steps:
                send(world, job, "running", step, timed(0.1 * step), nodes={k})
    s = scrape(world)
    assert get(s, "rankctl_job_step", job_id=job.id) == 12
    assert get(s, "rankctl_job_step_duration_seconds_count", job_id=job.id) == 12
    # each step's slowest reporting rank (rank 3 of n1: +3 ms, else rank 1 of n0: +1 ms); step 11, which no
    # node reported, with the mean of its jump's known durations (step 12's)
    durations = [0.103, 0.201, 0.303, 0.403, 0.503, 0.603, 0.701, 0.801, 0.903, 1.003, 1.203, 1.203]
    assert get(s, "rankctl_job_step_duration_seconds_sum", job_id=job.id) == pytest.approx(sum(durations))
    assert get(s, "rankctl_job_step_duration_seconds_bucket", job_id=job.id, le="1.02") == 10


def test_a_jump_observes_known_durations_and_fills_the_unknown_ones() -> None:
    p = JobProgress(1)
    p.step_figures(1, pb.RankStatus(rank=0, step=1, step_time_s=0.1))
    assert p.moved_step(0, 0, 1) == 1 and p.step_times.count == 1
    p.step_figures(5, pb.RankStatus(rank=0, step=5, step_time_s=0.3))
    assert p.moved_step(0, 1, 5) == 5                       # steps 2-4 never reported: 0.3 each
    assert p.step_times.count == 5 and p.step_times.total == pytest.approx(0.1 + 4 * 0.3)
    assert p.moved_step(0, 5, 8) == 8                       # nothing known in the jump: the last duration
    assert p.step_times.count == 8 and p.step_times.total == pytest.approx(0.1 + 7 * 0.3)


def test_a_resumed_attempt_or_a_rebuild_observes_only_the_steps_it_saw() -> None:
    resumed = JobProgress(2)
    for rank in range(2):
        resumed.step_figures(41, pb.RankStatus(rank=rank, step=41, step_time_s=0.2))
        resumed.moved_step(rank, 0, 41)                     # the attempt resumed from step 40's checkpoint
    assert resumed.min_step == 41 and resumed.step_times.count == 1
    rebuilt = JobProgress(2)
    for rank in range(2):
        rebuilt.moved_step(rank, 0, 500)                    # a coordinator restart: no figures of the past
    assert rebuilt.step_times.count == 0


def test_step_duration_buckets_are_exponential_from_milliseconds_to_minutes() -> None:
    b = STEP_TIME_BUCKETS
    assert b[0] == 0.001 and 600 <= b[-1] < 700 and list(b) == sorted(set(b))
    ratios = [hi / lo for lo, hi in zip(b, b[1:])]
    assert max(ratios) < 1.27 and min(ratios) > 1.24           # 2**(1/3) each, to 3 significant digits
    assert [x for x in b if 0.1 < x < 0.2] == [0.102, 0.128, 0.161]   # the 0.13-0.17 s steps: 2 buckets
    with pytest.raises(ValueError, match="low=0"):
        exponential_bounds(0, 1, 3)
    h = Histogram((1.0,))
    h.observe(0.5, 3)
    assert h.buckets() == [("1.0", 3), ("+Inf", 3)] and h.total == 1.5


def test_an_ended_jobs_last_series_stay_for_a_while_and_are_bounded(world: World) -> None:
    metrics = CoordinatorMetrics(world.core)
    job = training(world, steps=3)
    assert get(parse(metrics.render()[0]), "rankctl_job_step", job_id=job.id) == 3
    send(world, job, "running", 4, timed(0.4))              # its last step, then it ends before a scrape
    send(world, job, "done")
    for r in range(4):
        world.report(job.id, r, "exited", code=0)
    assert job.state is S.SUCCEEDED
    s = parse(metrics.render()[0])
    assert get(s, "rankctl_job_info", job_id=job.id, job_name="tr", kind="figured", state="SUCCEEDED") == 1
    assert get(s, "rankctl_job_step", job_id=job.id) == 4
    assert get(s, "rankctl_job_step_duration_seconds_count", job_id=job.id) == 4
    world.clock.t += FINISHED_KEPT_S + 1
    s = parse(metrics.render()[0])
    assert not any(dict(labels).get("job_id") == job.id for _, labels in s)
    assert get(s, "rankctl_jobs", state="SUCCEEDED") == 1


def test_at_most_the_last_ended_jobs_keep_their_series(world: World) -> None:
    metrics = CoordinatorMetrics(world.core)
    world.connect("n0", slots=1)
    ids = []
    for i in range(FINISHED_KEPT + 3):
        job = world.core.submit(f"name: j{i}\nkind: comm-check\nresources: {{nodes: 1, slots_per_node: 1}}\n")
        metrics.render()                                     # seen active
        world.report(job.id, 0, "exited", code=0)
        assert job.state is S.SUCCEEDED
        ids.append(job.id)
    shown = {dict(labels)["job_id"] for name, labels in parse(metrics.render()[0]) if name == "rankctl_job_info"}
    assert shown == set(ids[-FINISHED_KEPT:])


def test_worker_metrics_over_http(tmp_path: Path) -> None:
    async def main() -> tuple[Series, str]:
        fake = FakeCoordinator()
        server, address = await serve(fake)
        daemon = WorkerDaemon(config(tmp_path, address), RecordingLauncher())
        runner, port = await serve_metrics("127.0.0.1:0", WorkerMetrics(daemon))
        task = asyncio.create_task(daemon.run())
        try:
            await until(lambda: daemon.online, 10, "the daemon registered")
            await fake.outbox.put(pb.CoordinatorMessage(fetch_logs=pb.FetchLogs(request_id=1, job_id="j", attempt=1)))
            await until(lambda: any(m.WhichOneof("body") == "log_chunk" for m in fake.inbox), 10, "a log chunk")
            url = f"http://127.0.0.1:{port}/metrics"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
            return parse(body), daemon.cfg.name
        finally:
            daemon.stop()
            await asyncio.gather(task, return_exceptions=True)
            await runner.cleanup()
            await server.stop(0)

    s, node = asyncio.run(main())
    assert all(dict(labels).get("node") == node for _, labels in s)   # every series names its node
    assert get(s, "rankctl_worker_connected", node=node) == 1
    assert get(s, "rankctl_worker_registrations_total", node=node) == 1
    assert get(s, "rankctl_worker_reconnects_total", node=node) == 0 and get(s, "rankctl_worker_slots", node=node) == 2
    assert get(s, "rankctl_worker_launcher_alive", node=node) == 1
    assert get(s, "rankctl_worker_ranks", node=node, phase="running") == 0
    assert get(s, "rankctl_worker_log_lines_shipped_total", node=node) == 0
    assert get(s, "rankctl_worker_reports_sent_total", node=node) == 0


def test_the_gauges_hold_the_newest_step_that_reported_figures() -> None:
    """A step whose every report a loaded daemon coalesced away leaves the loss gauge at the newest step that
    reported one (it vanished from /metrics until the next; CI's dashboard check scraped in such a gap)."""
    p = JobProgress(1)
    p.folds = {"loss": "last"}
    p.step_figures(1, pb.RankStatus(rank=0, step=1, step_time_s=0.1, figures={"loss": 2.5}))
    assert p.moved_step(0, 0, 1) == 1
    assert p.last_step.figures == {"loss": 2.5} and p.metrics["loss"] == 2.5
    assert p.moved_step(0, 1, 2) == 2                        # step 2: no figures reached the coordinator
    assert p.last_step.figures == {"loss": 2.5} and "loss" not in p.metrics   # the step event has none of its own


def test_a_kind_that_describes_a_figure_of_its_own_gets_its_gauge_and_its_chart(world: World) -> None:
    """Issue 44 item 3: the views iterate over the figures a kind describes (``kinds.figures``): a kind's own
    ``reward`` gets its Prometheus gauge, its dashboard chart and its line in the job's figures; the coordinator
    names none of them, and a job of it shows no training loss chart."""
    from rankctl.coordinator.web import jobview
    from rankctl.coordinator.web.series import SeriesCache, snapshot
    from rankctl.kinds import registry
    from rankctl.kinds.figures import Figure
    from rankctl.kinds.registry import JobKind

    registry.register(JobKind(name="rewarded", figures={"reward": Figure(
        "max", label="reward", chart="reward-curve", metric="rankctl_job_reward",
        help="The best rank's reward of the last completed step.")}))
    try:
        for i in range(2):
            world.connect(f"n{i}", slots=2)
        job = world.core.submit(job_yaml(kind="rewarded"))
        send(world, job, "running")
        send(world, job, "running", 1, lambda r: {"figures": {"reward": float(r)}, "step_time_s": 0.1})
        s = scrape(world)
        assert get(s, "rankctl_job_reward", job_id=job.id) == 3.0                  # folded max over the ranks
        assert not any(name == "rankctl_job_loss" and ("job_id", job.id) in labels for name, labels in s)
        series = snapshot(SeriesCache(lambda j, after, limit: world.core.events(j, after, limit, ranks=False))
                          .get(job.id))
        html = jobview.live_fragment(job, world.core.summary(job.id), series, "", [], "", 0.0)
        assert '<svg id="reward-curve"' in html and "<dt>reward</dt><dd>3" in html, html
        assert 'id="loss-curve"' not in html and "tokens/s" not in html
    finally:
        registry.unregister("rewarded")
