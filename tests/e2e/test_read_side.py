"""The read side through a real grpc.aio server: GetJob's summary and rank pages, WatchJobBatches, WatchJob.

Nodes are registered on the core directly (sessions whose outbox only collects), so a job of
thousands of ranks needs no daemon; ranks report through the core's intake, one group commit
per call. A test pushes reports without awaiting in between, so the server sees them all at
once: what a batch holds never depends on timing.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

import grpc
import pytest

from rankctl.coordinator.api import servicer
from rankctl.coordinator.jobs.core import Coordinator
from rankctl.coordinator.fleet.nodes import NodeSession
from rankctl.coordinator.model.records import NodeHello
from rankctl.coordinator.app.server import CoordinatorServer, start_coordinator
from rankctl.coordinator.api.servicer import ClientServiceServicer
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc
from rankctl.worker.uplink.reporting import step_figures
from figured import FIGURED, figured_kind  # noqa: F401 - the module's autouse fixture

pytestmark = pytest.mark.grpc_in_process


def job_yaml(nodes: int, slots: int, name: str = "cc") -> str:
    return f"name: {name}\nkind: {FIGURED.name}\nresources: {{nodes: {nodes}, slots_per_node: {slots}}}\n"


@dataclass
class Cluster:
    coord: CoordinatorServer
    client: rankctl_pb2_grpc.ClientServiceStub
    sessions: dict[str, NodeSession] = field(default_factory=dict)

    @property
    def core(self) -> Coordinator:
        return self.coord.core

    def connect(self, nodes: int, slots: int) -> None:
        for i in range(nodes):
            hello = NodeHello(f"n{i}", f"10.0.{i // 250}.{i % 250}", slots, {}, (29500,), (), "s1")
            self.sessions[hello.name] = self.core.register(hello, lambda msg: None)

    async def submit(self, nodes: int, slots: int) -> pb.Job:
        self.connect(nodes, slots)
        return (await self.client.SubmitJob(pb.SubmitJobRequest(spec_yaml=job_yaml(nodes, slots)))).job

    def report(self, job_id: str, ranks: Iterable[int], phase: str = "running", *, step: int = 0,
               code: int | None = None, error: str = "", metrics: dict | None = None,
               result: dict | None = None) -> None:
        """One report per rank from the node that runs it, stored in one group commit."""
        job = self.core.get(job_id)
        by_node: dict[str, list[pb.RankReport]] = defaultdict(list)
        for r in ranks:
            node = job.nodes[r // job.slots_per_node]
            status = pb.RankStatus(rank=r, node=node, phase=phase, step=step, exited=code is not None,
                                   exit_code=code or 0, error=error, metrics_json=json.dumps(metrics) if metrics else "")
            step_figures(status, metrics)   # as the daemon sends it
            by_node[node].append(pb.RankReport(job_id=job_id, attempt=job.attempt, status=status,
                                               result_json=json.dumps(result) if result else ""))
        for node, updates in by_node.items():
            self.core.rank_reports(self.sessions[node], updates)
        self.core.flush()

    def steps(self, job_id: str, world: int, first: int, last: int) -> None:
        for s in range(first, last + 1):
            self.report(job_id, range(world), step=s, metrics={"loss": 1.0 / s, "step_time_s": 0.5})

    def finish(self, job_id: str, world: int) -> None:
        self.report(job_id, range(world), "done", code=0, result={"groups": []})

    async def get(self, job_id: str, **kw: Any) -> pb.Job:
        return await self.client.GetJob(pb.GetJobRequest(job_id=job_id, **kw))


def run(test: Callable[[Cluster], Awaitable[Any]], state_dir: Path, timeout: float = 60.0) -> Any:
    async def main() -> Any:
        coord = await start_coordinator("127.0.0.1:0", state_dir, heartbeat_timeout=3600.0)
        try:
            async with grpc.aio.insecure_channel(coord.address) as channel:
                cluster = Cluster(coord, rankctl_pb2_grpc.ClientServiceStub(channel))
                return await asyncio.wait_for(test(cluster), timeout)
        finally:
            await coord.stop(grace=0.1)
    return asyncio.run(main())


async def read_all(call: Any) -> list:
    """Every message left on a stream, until it ends."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


def seqs(events: Iterable[Any]) -> list[int]:
    return [e.seq for e in events]


# -- GetJob -----------------------------------------------------------------------------
def test_get_job_answers_a_summary_and_one_bounded_page_of_an_8192_rank_job(tmp_path: Path) -> None:
    async def test(c: Cluster) -> None:
        job = await c.submit(1024, 8)                                    # SubmitJob: summary and first page
        assert job.state == pb.JOB_STATE_STARTING and job.world_size == 8192
        assert dict(job.summary.phases) == {"pending": 8192} and job.summary.running == 0
        assert [r.rank for r in job.ranks] == list(range(256)) and {r.phase for r in job.ranks} == {"pending"}
        assert (job.rank_offset, job.next_rank_offset) == (0, 256)
        c.report(job.id, range(8192))
        c.report(job.id, range(8191), step=5)
        c.report(job.id, [8191], step=4)

        page = await c.get(job.id)
        s = page.summary
        assert page.state == pb.JOB_STATE_RUNNING and dict(s.phases) == {"running": 8192} and s.running == 8192
        assert (s.min_step, s.max_step, list(s.stragglers), s.failed, s.exited) == (4, 5, [8191], 0, 0)
        assert [r.rank for r in page.ranks] == list(range(256)) and page.next_rank_offset == 256
        tail = await c.get(job.id, rank_offset=8000, rank_limit=1000)  # clipped to the world
        assert [r.rank for r in tail.ranks] == list(range(8000, 8192)) and tail.rank_offset == 8000
        assert tail.next_rank_offset == 0 and tail.ranks[-1].step == 4 and tail.ranks[0].step == 5
        one = await c.get(job.id, rank_offset=100, rank_limit=1)
        assert [r.rank for r in one.ranks] == [100] and one.next_rank_offset == 101
        capped = await c.get(job.id, rank_offset=1, rank_limit=100_000)
        assert len(capped.ranks) == servicer.MAX_RANK_PAGE == 4096 and capped.next_rank_offset == 4097
        beyond = await c.get(job.id, rank_offset=9000)
        assert list(beyond.ranks) == [] and beyond.next_rank_offset == 0 and beyond.summary.running == 8192
        only = await c.get(job.id, summary_only=True)
        assert list(only.ranks) == [] and only.summary == s and only.next_rank_offset == 0

        every, offset = [], 0                   # the whole world, page by page, is many pages' worth
        while True:
            p = await c.get(job.id, rank_offset=offset, rank_limit=4096)
            every += p.ranks
            offset = p.next_rank_offset
            if not offset:
                break
        assert [r.rank for r in every] == list(range(8192))
        world_bytes = sum(r.ByteSize() for r in every)
        assert page.ByteSize() - only.ByteSize() < world_bytes / 16

        cancelled = (await c.client.CancelJob(pb.CancelJobRequest(job_id=job.id, reason="enough"))).job
        assert cancelled.state == pb.JOB_STATE_CANCELLED and cancelled.summary.running == 8192
        assert len(cancelled.ranks) == 256 and cancelled.next_rank_offset == 256
    run(test, tmp_path)


def test_a_page_of_ranks_with_long_errors_stops_near_a_mebibyte(tmp_path: Path) -> None:
    async def test(c: Cluster) -> None:
        job = await c.submit(4, 64)   # errors are cut to 8,000 characters at intake: 256 of them pass 1 MiB
        error = "Traceback (most recent call last):\n" + "  frame\n" * 8000 + "RuntimeError: boom\n"
        c.report(job.id, range(256), "failed", code=1, error=error)
        page = await c.get(job.id, rank_limit=256)
        assert page.state == pb.JOB_STATE_FAILED and 0 < len(page.ranks) < 256
        assert page.next_rank_offset == len(page.ranks) and page.ByteSize() < 2 * servicer.RANK_PAGE_BYTES
        rest = await c.get(job.id, rank_offset=page.next_rank_offset, rank_limit=256)
        assert rest.ranks[0].rank == len(page.ranks)
        s = page.summary
        assert s.failed == 256 and [r.rank for r in s.failing] == list(range(16))
        assert all(r.error.endswith("RuntimeError: boom\n") and len(r.error) < len(error) for r in s.failing)
    run(test, tmp_path)


def test_a_node_list_past_its_budget_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servicer, "NODES_BYTES", 64)  # 12 names of 2-3 characters fit, 32 do not

    async def test(c: Cluster) -> None:
        small = await c.submit(12, 1)
        assert sorted((await c.get(small.id)).nodes) == sorted(f"n{i}" for i in range(12))
        await c.client.CancelJob(pb.CancelJobRequest(job_id=small.id))
        big = await c.submit(32, 1)
        page = await c.get(big.id)
        assert page.state == pb.JOB_STATE_STARTING and list(page.nodes) == [] and len(page.ranks) == 32
        assert {r.node for r in page.ranks} == {f"n{i}" for i in range(32)}
    run(test, tmp_path)


def test_bad_read_requests_are_invalid_arguments_naming_the_field(tmp_path: Path) -> None:
    async def test(c: Cluster) -> None:
        job = await c.submit(1, 2)
        for request, field_value in ((pb.GetJobRequest(job_id=job.id, rank_offset=-1), "rank_offset=-1"),
                                     (pb.GetJobRequest(job_id=job.id, rank_limit=-5), "rank_limit=-5")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.client.GetJob(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field_value in err.value.details() and "0 or more" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_all(c.client.WatchJobBatches(pb.WatchJobRequest(job_id=job.id, min_interval=-1)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_interval=-1" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_all(c.client.WatchJobBatches(pb.WatchJobRequest(job_id="nope")))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    run(test, tmp_path)


# -- WatchJobBatches --------------------------------------------------------------------
def test_batches_replay_the_history_then_follow_live_until_terminal(tmp_path: Path) -> None:
    async def test(c: Cluster) -> None:
        job = await c.submit(2, 4)
        call = c.client.WatchJobBatches(pb.WatchJobRequest(job_id=job.id))
        first = await call.read()                                  # at once: the stored history
        assert seqs(first.events) == seqs(c.core.events(job.id)) and first.events[-1].state == pb.JOB_STATE_STARTING
        assert first.state == pb.JOB_STATE_STARTING and first.attempt == 1 and dict(first.summary.phases) == {"pending": 8}
        c.report(job.id, range(8))
        second = await call.read()                                 # every event ready, in one batch
        assert second.state == pb.JOB_STATE_RUNNING and second.summary.running == 8 and second.reason == c.core.get(job.id).reason
        assert [e.kind for e in second.events] == ["rank"] * 8 + ["transition"]
        c.steps(job.id, 8, 1, 3)
        c.finish(job.id, 8)
        rest = await read_all(call)                                # the stream ends at terminal
        assert rest[-1].state == pb.JOB_STATE_SUCCEEDED and rest[-1].summary.exited == 8
        got = [e for b in [first, second, *rest] for e in b.events]
        assert seqs(got) == seqs(c.core.events(job.id)) == list(range(1, len(got) + 1))
        steps = [(e.step, e.metrics["loss"]) for e in got if e.kind == "step"]
        assert steps == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
        last = len(got)
        tail = await read_all(c.client.WatchJobBatches(pb.WatchJobRequest(job_id=job.id, after_seq=last - 1)))
        assert [seqs(b.events) for b in tail] == [[last]] and tail[0].state == pb.JOB_STATE_SUCCEEDED
        none = await read_all(c.client.WatchJobBatches(pb.WatchJobRequest(job_id=job.id, after_seq=last)))
        assert [list(b.events) for b in none] == [[]] and none[0].state == pb.JOB_STATE_SUCCEEDED
    run(test, tmp_path)


@pytest.mark.parametrize("interval, shown_steps", [(0.0, list(range(1, 21))), (0.05, [10, 20])])
def test_min_interval_coalesces_consecutive_step_events_and_keeps_every_other(
        tmp_path: Path, interval: float, shown_steps: list[int]) -> None:
    async def test(c: Cluster) -> None:
        job = await c.submit(2, 4)
        c.report(job.id, range(8))
        after = c.core.events(job.id)[-1].seq
        call = c.client.WatchJobBatches(pb.WatchJobRequest(job_id=job.id, after_seq=after, min_interval=interval))
        assert list((await call.read()).events) == []              # the first batch: the job as it is
        c.steps(job.id, 8, 1, 10)
        c.report(job.id, [3], step=10, error="warning: slow disk")  # a rank event between two runs of steps
        c.steps(job.id, 8, 11, 20)
        c.finish(job.id, 8)
        batches = await read_all(call)
        got = [e for b in batches for e in b.events]
        assert [e.step for e in got if e.kind == "step"] == shown_steps
        stored = [e for e in c.core.events(job.id, after) if e.kind != "step"]
        assert [(e.seq, e.kind) for e in got if e.kind != "step"] == [(e.seq, e.kind) for e in stored]
        assert next(e for e in got if e.step == 20).metrics["loss"] == 1 / 20
        assert batches[-1].state == pb.JOB_STATE_SUCCEEDED and batches[-1].summary.metrics["step"] == 20
        for b in batches:                                          # never two step events in a row
            kinds = [e.kind for e in b.events]
            assert interval == 0 or ("step", "step") not in zip(kinds, kinds[1:])
    run(test, tmp_path)


@pytest.mark.parametrize("interval", [0.0, 3600.0])
def test_a_long_history_comes_in_bounded_batches_without_waiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interval: float) -> None:
    """A backlog is sent batch after batch even under a long min_interval (else this would hang)."""
    monkeypatch.setattr(servicer, "BATCH_EVENTS", 4)

    async def test(c: Cluster) -> None:
        job = await c.submit(2, 4)
        c.report(job.id, range(8))
        c.steps(job.id, 8, 1, 6)
        c.finish(job.id, 8)
        stored = c.core.events(job.id)
        batches = await read_all(c.client.WatchJobBatches(pb.WatchJobRequest(job_id=job.id, min_interval=interval)))
        assert all(len(b.events) <= 4 for b in batches) and batches[-1].state == pb.JOB_STATE_SUCCEEDED
        got = [e for b in batches for e in b.events]
        if interval == 0:
            assert seqs(got) == seqs(stored) and len(batches) == -(-len(stored) // 4)
        else:
            assert [e.seq for e in got if e.kind != "step"] == [e.seq for e in stored if e.kind != "step"]
            assert got[-1].seq == stored[-1].seq and {e.step for e in got if e.kind == "step"} >= {6}
    run(test, tmp_path)


# -- WatchJob (one event per message) ----------------------------------------------------
def test_watch_job_sends_one_event_per_message_reading_the_history_in_chunks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servicer, "EVENT_CHUNK", 3)

    async def test(c: Cluster) -> None:
        job = await c.submit(2, 4)
        c.report(job.id, range(8))
        c.steps(job.id, 8, 1, 4)
        history = c.core.events(job.id)
        call = c.client.WatchJob(pb.WatchJobRequest(job_id=job.id))
        got = [await call.read() for _ in history]                 # live: the stream stays open
        assert seqs(got) == seqs(history) and all(isinstance(e, pb.JobEvent) for e in got)
        assert [e.step for e in got if e.kind == "step"] == [1, 2, 3, 4] and got[-1].metrics
        c.finish(job.id, 8)
        got += await read_all(call)
        assert seqs(got) == seqs(c.core.events(job.id)) and got[-1].state == pb.JOB_STATE_SUCCEEDED
    run(test, tmp_path)


# -- ctl against a coordinator on its own thread ------------------------------------------
class ThreadedCoordinator:
    """A coordinator serving from a thread of its own, so that ``ctl`` (synchronous) can run here."""

    def __init__(self, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.coord = self.call(start_coordinator("127.0.0.1:0", state_dir, heartbeat_timeout=3600.0))
        self.cluster = Cluster(self.coord, None)

    def call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def do(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` on the coordinator's loop (the core is single-threaded)."""
        async def call() -> Any:
            return fn(*args, **kw)
        return self.call(call())

    def stop(self) -> None:
        self.call(self.coord.stop(grace=0.1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """A threaded coordinator whose client calls are counted by name; param False: no WatchJobBatches."""
    calls: Counter[str] = Counter()
    for name in ("GetJob", "WatchJob", "WatchJobBatches"):
        monkeypatch.setattr(ClientServiceServicer, name, _counted(getattr(ClientServiceServicer, name), calls))
    if getattr(request, "param", True) is False:
        async def unknown(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            calls["WatchJobBatches"] += 1
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            yield
        monkeypatch.setattr(ClientServiceServicer, "WatchJobBatches", unknown)
    server = ThreadedCoordinator(tmp_path)  # handlers are bound here: patch before
    server.calls, server.batches = calls, getattr(request, "param", True)
    yield server
    server.stop()


def _counted(method: Callable, calls: Counter) -> Callable:
    if inspect.isasyncgenfunction(method):
        async def stream(self: Any, request: Any, context: Any) -> Any:
            calls[method.__name__] += 1
            async for msg in method(self, request, context):
                yield msg
        return stream

    async def unary(self: Any, request: Any, context: Any) -> Any:
        calls[method.__name__] += 1
        return await method(self, request, context)
    return unary


def ctl(server: ThreadedCoordinator, *args: str) -> Any:
    from click.testing import CliRunner

    from rankctl.cli.main import cli

    return CliRunner().invoke(cli, ["--coordinator", server.coord.address, *args], catch_exceptions=False)


def json_doc(out: Any) -> Any:
    """The JSON document ``ctl --json`` printed (the coordinator's thread logs to the same captured stdout)."""
    lines = out.stdout.splitlines()
    return json.loads("\n".join(lines[lines.index("{"):len(lines) - lines[::-1].index("}")]))


def test_ctl_status_shows_a_summary_and_pages_of_a_large_job(served: ThreadedCoordinator) -> None:
    c = served.cluster
    served.do(c.connect, 1024, 8)
    job = served.do(c.core.submit, job_yaml(1024, 8))
    served.do(c.report, job.id, range(8192))
    served.do(c.report, job.id, range(8190), step=7)
    served.do(c.report, job.id, [8190, 8191], step=6)
    doc = json_doc(ctl(served, "status", job.id, "--json"))
    assert len(doc["ranks"]) == 256 and doc["ranks_shown"] == {"first": 0, "last": 255}
    assert doc["next_rank_offset"] == 256 and doc["world_size"] == 8192 and doc["state"] == "RUNNING"
    assert doc["summary"]["phases"] == {"running": 8192} and doc["summary"]["stragglers"] == [8190, 8191]
    assert (doc["summary"]["min_step"], doc["summary"]["max_step"]) == (6, 7)
    text = ctl(served, "status", job.id).stdout
    assert f"showing ranks 0-63 of 8192; `ctl status {job.id} --ranks A-B` for more" in text
    assert "stragglers at step 6: 8190, 8191" in text and "running 8192" in text
    assert "│   64 │" not in text and "│   63 │" in text
    part = json_doc(ctl(served, "status", job.id, "--ranks", "8000-8191", "--json"))
    assert [r["rank"] for r in part["ranks"]] == list(range(8000, 8192))
    assert part["ranks_shown"] == {"first": 8000, "last": 8191} and part["next_rank_offset"] is None
    every = json_doc(ctl(served, "status", job.id, "--ranks", "0-9999", "--json"))  # three pages
    assert [r["rank"] for r in every["ranks"]] == list(range(8192)) and "ranks_shown" not in every
    assert served.calls["GetJob"] == 3 + 2


def test_ctl_watch_reads_the_job_once_then_follows_events(served: ThreadedCoordinator) -> None:
    """GetJob at the start and at the end only, whatever the events; one WatchJobBatches stream between."""
    c = served.cluster
    served.do(c.connect, 2, 4)
    job = served.do(c.core.submit, job_yaml(2, 4))

    async def drive() -> None:  # once ctl watches (or after a bounded wait: then the counts fail): 30 steps, the end
        for _ in range(1000):
            if served.calls["WatchJobBatches"] == 1:
                break
            await asyncio.sleep(0.01)
        c.report(job.id, range(8))
        c.steps(job.id, 8, 1, 30)
        c.finish(job.id, 8)
    driving = asyncio.run_coroutine_threadsafe(drive(), served.loop)
    out = ctl(served, "watch", job.id, "--json")
    driving.result(10)
    assert out.exit_code == 0, out.output
    doc = json_doc(out)
    assert doc["state"] == "SUCCEEDED" and doc["summary"]["min_step"] == 30 and len(doc["ranks"]) == 8
    assert served.calls["GetJob"] == 2 and served.calls["WatchJobBatches"] == 1 and served.calls["WatchJob"] == 0


@pytest.mark.parametrize("served", [False], indirect=True, ids=["no-batches"])
def test_ctl_watch_says_so_when_the_coordinator_lacks_a_call(served: ThreadedCoordinator) -> None:
    """No fallback to WatchJob (no coordinator without batches ever shipped): a clear error, no traceback."""
    c = served.cluster
    served.do(c.connect, 2, 4)
    job = served.do(c.core.submit, job_yaml(2, 4))
    out = ctl(served, "watch", job.id)
    assert out.exit_code == 1 and "does not implement this call" in out.output, out.output
    assert "Traceback" not in out.output and served.calls["WatchJob"] == 0


# -- what ctl makes of the messages (no server) -------------------------------------------
def test_a_followed_job_takes_ranks_steps_and_summary_from_events_and_batches() -> None:
    from rankctl.cli.view.render import apply_batch

    job = pb.Job(id="j", state=pb.JOB_STATE_STARTING, attempt=1, world_size=512, rank_offset=256,
                 ranks=[pb.RankStatus(rank=r, phase="starting") for r in range(256, 320)])
    summary = pb.JobSummary(phases={"running": 512}, running=512, min_step=7, max_step=9,
                            metrics={"step": 7, "loss": 2.5})
    batch = pb.JobEventBatch(state=pb.JOB_STATE_RUNNING, reason="all 512 ranks running", attempt=1, summary=summary, events=[
        pb.JobEvent(seq=5, kind="rank", state=pb.JOB_STATE_STARTING, rank=pb.RankStatus(rank=300, phase="running", step=2)),
        pb.JobEvent(seq=6, kind="rank", state=pb.JOB_STATE_STARTING, rank=pb.RankStatus(rank=3, phase="running")),  # not shown
        pb.JobEvent(seq=7, kind="transition", state=pb.JOB_STATE_RUNNING, message="all 512 ranks running"),
        pb.JobEvent(seq=8, kind="step", state=pb.JOB_STATE_RUNNING, step=7, metrics={"step": 7, "loss": 2.5})])
    apply_batch(job, batch)
    assert (job.state, job.reason, job.summary) == (pb.JOB_STATE_RUNNING, "all 512 ranks running", summary)
    assert job.ranks[300 - 256].phase == "running" and {r.step for r in job.ranks} == {7}
    assert {r.phase for r in job.ranks if r.rank != 300} == {"starting"} and len(job.ranks) == 64


def test_progress_comes_from_the_summary_and_before_any_step_is_finished_by_all_from_the_ranks() -> None:
    from rankctl.kinds.python import render as python_render
    from rankctl.kinds.common import latest_metrics

    ranks = [pb.RankStatus(rank=1, step=4, metrics_json=json.dumps({"loss": 3.0})),
             pb.RankStatus(rank=0, step=4, metrics_json=json.dumps({"lr": 0.1}))]
    old = pb.Job(kind="python", ranks=ranks)                                 # no summary field at all
    assert latest_metrics(old) == (4, {"loss": 3.0})
    new = pb.Job(kind="python", ranks=ranks, summary=pb.JobSummary(
        min_step=6, metrics={"step": 5, "loss": 1.5, "tokens_per_s": 10.0}))
    assert latest_metrics(new) == (5, {"step": 5, "loss": 1.5, "tokens_per_s": 10.0})
    assert python_render.progress(new) == "step 5  loss 1.5000  tokens_per_s 10"
    new.summary.metrics.clear()                                              # no step finished by all yet
    assert latest_metrics(new) == (4, {"loss": 3.0})


def test_ctl_json_keeps_its_shape_with_times_from_the_timestamps_and_the_result_from_its_struct() -> None:
    from rankctl.cli.view.render import job_to_dict
    from rankctl.coordinator.api import convert
    from rankctl.coordinator.model.records import JobRecord
    from rankctl.coordinator.model.states import JobState

    result = {"comm": [{"kind": "tp", "groups": 2, "mean_us": 12.5}], "losses": [{"step": 1, "loss": 2.25}]}
    from rankctl.kinds.spec import build_spec

    spec = build_spec({"name": "cc", "kind": "comm-check", "resources": {"nodes": 1, "slots_per_node": 2}})
    record = JobRecord(id="cc-1", name="cc", kind="comm-check", spec=spec,
                       state=JobState.RUNNING, reason="", world_size=2, slots_per_node=2, created_at=1_700_000_000.25,
                       result=result)
    running = job_to_dict(pb.Job.FromString(convert.job_to_pb(record).SerializeToString()))
    assert running["created_at"] == 1_700_000_000.25 and running["finished_at"] is None
    assert running["result"] == result and isinstance(running["result"]["comm"][0]["groups"], int)
    record.state, record.finished_at, record.result = JobState.SUCCEEDED, 1_700_000_100.5, None
    msg = convert.job_to_pb(record)
    msg.attempts.extend(convert.attempts_to_pb([{"attempt": 1, "state": "SUCCEEDED", "reason": "",
                                                  "started_at": 1_700_000_001.0, "finished_at": 1_700_000_100.5,
                                                  "nodes": record.nodes_needed}], record))
    done = job_to_dict(msg)
    assert (done["state"], done["finished_at"], done["result"]) == ("SUCCEEDED", 1_700_000_100.5, None)
    assert done["attempts"] == [{"attempt": 1, "state": "SUCCEEDED", "reason": None, "started_at": 1_700_000_001.0,
                                 "finished_at": 1_700_000_100.5, "nodes": record.nodes_needed,
                                 "world_size": record.world_size,
                                 "layout": convert.layout_words(record.spec.parallel, record.world_size),
                                 "failure": None}]
    failed = convert.attempts_to_pb([{"attempt": 2, "state": "FAILED", "reason": "r", "started_at": 1.0,
                                      "finished_at": 2.0, "fault_json": '{"cause":"rank-exit","reason":"r",'
                                      '"node":"n1","rank":5,"code":-9,"step":null,"detail":"x"}'}], record)
    msg.ClearField("attempts")
    msg.attempts.extend(failed)
    assert job_to_dict(msg)["attempts"][0]["failure"] == {"cause": "rank-exit", "node": "n1", "rank": 5,
                                                          "exit_code": -9, "step": None}
