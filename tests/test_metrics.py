"""Prometheus metrics: the coordinator's collector on an in-process core (fake clock, fake nodes), and one
worker daemon's /metrics endpoint over HTTP on loopback. Parsed with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rankctl.coordinator.histogram import Histogram
from rankctl.coordinator.metrics import CoordinatorMetrics
from rankctl.coordinator.states import JobState
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.daemon import WorkerDaemon
from rankctl.worker.metrics import WorkerMetrics, serve_metrics
from test_core import World, make_world
from test_defects_worker import FakeCoordinator, RecordingLauncher, config, serve, until

S = JobState
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def job_yaml(name: str = "tr", nodes: int = 2, slots: int = 2, tp: int = 2, restarts: int = 0) -> str:
    return (f"name: {name}\nkind: comm-check\nresources: {{nodes: {nodes}, slots_per_node: {slots}}}\n"
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


def send(world: World, job, phase: str, step: int = 0, figures=lambda rank: {}) -> None:  # noqa: ANN001
    """One ReportBatch per node of ``job`` (every rank of it), then one group commit."""
    for k, name in enumerate(job.nodes):
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
    job = world.core.submit(job_yaml(nodes=nodes, slots=slots, tp=min(slots, 8)))
    send(world, job, "running")
    assert job.state is S.RUNNING
    for step in range(1, steps + 1):
        send(world, job, "running", step, lambda r, step=step: {
            "loss": 3.0 - step / 10, "tokens_per_s": 1000.0 + r, "step_time_s": 0.5 + r / 100,
            "compute_s": 0.5 if r == slow_rank else 0.1, **({"val_loss": 2.5} if step == 1 else {})})
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
    assert get(s, "rankctl_job_info", job=job.id, name="tr", kind="comm-check", state="RUNNING") == 1
    assert get(s, "rankctl_job_ranks", job=job.id, phase="running") == 4
    assert get(s, "rankctl_job_step", job=job.id) == 2 and get(s, "rankctl_job_attempt", job=job.id) == 1
    assert get(s, "rankctl_job_loss", job=job.id) == pytest.approx(2.8)
    assert get(s, "rankctl_job_val_loss", job=job.id) == 2.5             # step 1's, the last that had one
    assert get(s, "rankctl_job_tokens_per_second", job=job.id) == 1000.0  # the slowest rank's
    assert get(s, "rankctl_job_step_time_seconds", job=job.id, stat="min") == 0.5
    assert get(s, "rankctl_job_step_time_seconds", job=job.id, stat="mean") == pytest.approx(0.515)
    assert get(s, "rankctl_job_step_time_seconds", job=job.id, stat="max") == pytest.approx(0.53)
    assert get(s, "rankctl_job_step_duration_seconds_count", job=job.id) == 2   # one per completed step
    assert get(s, "rankctl_job_step_duration_seconds_bucket", job=job.id, le="0.5") == 0   # each step's max: 0.53
    assert get(s, "rankctl_job_step_duration_seconds_bucket", job=job.id, le="1.0") == 2
    assert get(s, "rankctl_job_step_duration_seconds_sum", job=job.id) == pytest.approx(1.06)
    assert get(s, "rankctl_job_stragglers", job=job.id) == 0
    assert not any(n.startswith("rankctl_rank_straggler") or n.startswith("rankctl_rank_step") for n in names(s))
    assert not any(dict(labels).get("job") == queued.id for _, labels in s)   # pending jobs: no per-job series


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
    assert get(s, "rankctl_job_attempt", job=job.id) == 2


def test_stragglers_are_counted_per_job_and_flagged_per_rank_only_when_asked(world: World) -> None:
    job = training(world, steps=8, slow_rank=3)
    plain, ranked = scrape(world), scrape(world, per_rank=True)
    assert get(plain, "rankctl_job_stragglers", job=job.id) == 1
    flags = {dict(labels)["rank"]: v for (name, labels), v in ranked.items() if name == "rankctl_rank_straggler"}
    assert flags == {"0": 0, "1": 0, "2": 0, "3": 1}
    assert get(ranked, "rankctl_rank_step", job=job.id, rank="3") == 8


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


def test_worker_metrics_over_http(tmp_path: Path) -> None:
    async def main() -> Series:
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
            return parse(await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read()))
        finally:
            daemon.stop()
            await asyncio.gather(task, return_exceptions=True)
            await runner.cleanup()
            await server.stop(0)

    s = asyncio.run(main())
    assert get(s, "rankctl_worker_connected") == 1 and get(s, "rankctl_worker_registrations_total") == 1
    assert get(s, "rankctl_worker_reconnects_total") == 0 and get(s, "rankctl_worker_slots") == 2
    assert get(s, "rankctl_worker_launcher_alive") == 1 and get(s, "rankctl_worker_ranks", phase="running") == 0
    assert get(s, "rankctl_worker_log_lines_shipped_total") == 0 and get(s, "rankctl_worker_reports_sent_total") == 0
