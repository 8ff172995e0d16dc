"""The coordinator over a real grpc.aio server on 127.0.0.1:0, with a fake daemon (raw stub)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rankctl.coordinator.api import convert
from rankctl.coordinator.api.node_service import NodeServiceServicer
from rankctl.coordinator.fleet.nodes import NodeSession, NodeStatus
from rankctl.coordinator.model.records import NodeRecord
from rankctl.coordinator.app.server import CoordinatorServer, start_coordinator
from rankctl.proto import from_struct
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc

pytestmark = pytest.mark.grpc_in_process
JOB = "name: cc\nkind: comm-check\nresources: {nodes: 1, slots_per_node: 2}\n"


def run(test: Callable[[CoordinatorServer, grpc.aio.Channel], Awaitable[Any]], state_dir: Path,
        timeout: float = 10.0) -> Any:
    """Start a coordinator, open a channel, run ``test``, stop everything (bounded in time)."""
    async def main() -> Any:
        coord = await start_coordinator("127.0.0.1:0", state_dir, heartbeat_timeout=timeout)
        try:
            async with grpc.aio.insecure_channel(coord.address) as channel:
                return await asyncio.wait_for(test(coord, channel), 10)
        finally:
            await coord.stop(grace=0.1)
    return asyncio.run(main())


class FakeDaemon:
    """A node session driven by hand: queue NodeMessages, read CoordinatorMessages."""

    def __init__(self, channel: grpc.aio.Channel, name: str = "n0", slots: int = 2, session: str = "s1",
                 running: tuple[pb.RunningJob, ...] = ()) -> None:
        self.name, self.seq = name, 0
        self._out: asyncio.Queue[pb.NodeMessage | None] = asyncio.Queue()
        self.call = rankctl_pb2_grpc.NodeServiceStub(channel).Connect(self._messages())
        register = pb.Register(name=name, address="127.0.0.1", slots=slots, free_ports=[29555], session=session,
                               running=list(running))
        self.send(register=register)

    async def _messages(self):
        while (msg := await self._out.get()) is not None:
            yield msg

    def send(self, **body: Any) -> None:
        self._out.put_nowait(pb.NodeMessage(**body))

    def report(self, job: str, rank: int, phase: str, *, code: int | None = None, result: dict | None = None,
               seq: int | None = None) -> None:
        self.seq = seq if seq is not None else self.seq + 1
        status = pb.RankStatus(rank=rank, node=self.name, phase=phase, exited=code is not None, exit_code=code or 0)
        self.send(batch=pb.ReportBatch(reports=[pb.RankReport(job_id=job, attempt=1, status=status, seq=self.seq,
                                                             result_json=json.dumps(result) if result else "")]))

    async def expect(self, kind: str) -> Any:
        while True:
            msg = await self.call.read()
            assert msg is not grpc.aio.EOF, f"stream ended while waiting for {kind}"
            if msg.WhichOneof("body") == kind:
                return getattr(msg, kind)

    def close(self) -> None:
        self._out.put_nowait(None)


async def wait_state(client: rankctl_pb2_grpc.ClientServiceStub, job_id: str, state: int) -> pb.Job:
    for _ in range(200):
        job = await client.GetJob(pb.GetJobRequest(job_id=job_id))
        if job.state == state:
            return job
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id} stayed {pb.JobState.Name(job.state)}: {job.reason}")


def test_health_reports_serving(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "rankctl.v1.ClientService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert coord.port > 0 and coord.address == f"127.0.0.1:{coord.port}"
    run(test, tmp_path)


def test_invalid_and_unknown_map_to_status_codes(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, channel: grpc.aio.Channel) -> None:
        client = rankctl_pb2_grpc.ClientServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=JOB + "parallel: {tp: 3}\n", source="cc.yaml"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tp" in err.value.details()
        assert "Traceback" not in err.value.details()
        for call in (client.GetJob(pb.GetJobRequest(job_id="nope")),
                     client.CancelJob(pb.CancelJobRequest(job_id="nope"))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await client.ListJobs(pb.ListJobsRequest())).jobs == []
        for bad in (pb.ListJobsRequest(page_size=-1), pb.ListJobsRequest(page_token="../x")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.ListJobs(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        plan = await client.PlanJob(pb.PlanJobRequest(spec_yaml=JOB, overrides=["parallel.tp=2"]))
        assert from_struct(plan.layout)["groups"]["tp"] == [[0, 1]] and from_struct(plan.spec)["parallel"]["tp"] == 2
        assert (await client.ListJobs(pb.ListJobsRequest())).jobs == []
        for bad in (pb.ListJobsRequest(page_size=-1), pb.ListJobsRequest(page_token="../x"),
                    pb.ListJobsRequest(page_token="\u00b2"), pb.ListJobsRequest(page_token="\u0663\u0663"),
                    pb.ListJobsRequest(states=[99]), pb.ListJobsRequest(states=[0])):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.ListJobs(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "states: 0 is not a job state; one of PENDING, PLACED" in err.value.details()
    run(test, tmp_path)


def test_submit_assign_report_succeed_and_watch(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, channel: grpc.aio.Channel) -> None:
        client = rankctl_pb2_grpc.ClientServiceStub(channel)
        job = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=JOB, queue_anyway=True))).job
        assert job.state == pb.JOB_STATE_PENDING and "no nodes connected" in job.reason
        watch = client.WatchJob(pb.WatchJobRequest(job_id=job.id))
        daemon = FakeDaemon(channel)
        registered = await daemon.expect("registered")
        assert registered.node == "n0" and registered.last_seq == 0
        assign = await daemon.expect("assign")
        assert (assign.job_id, assign.first_rank, assign.rank_count, assign.world_size) == (job.id, 0, 2, 2)
        assert assign.rendezvous == "127.0.0.1:29555"
        daemon.send(heartbeat=pb.Heartbeat(ts=1.0, free_ports=[29555]))
        for rank in (0, 1):
            daemon.report(job.id, rank, "running")
        await wait_state(client, job.id, pb.JOB_STATE_RUNNING)
        for rank in (0, 1):
            daemon.report(job.id, rank, "done", code=0, result={"groups": []})
        done = await wait_state(client, job.id, pb.JOB_STATE_SUCCEEDED)
        assert [r.exited for r in done.ranks] == [True, True] and from_struct(done.result)["comm"] == []
        events = [ev async for ev in watch]
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[-1].state == pb.JOB_STATE_SUCCEEDED and "rank" in {e.kind for e in events}
        replay = [ev async for ev in client.WatchJob(pb.WatchJobRequest(job_id=job.id, after_seq=len(events) - 1))]
        assert [e.seq for e in replay] == [len(events)]
        nodes = (await client.ListNodes(pb.ListNodesRequest())).nodes
        assert [(n.name, n.state, n.free_slots) for n in nodes] == [("n0", pb.NODE_STATE_READY, 2)]
        daemon.close()
    run(test, tmp_path)


async def node_when(client: rankctl_pb2_grpc.ClientServiceStub, ok: Callable[[pb.Node], bool]) -> pb.Node:
    """The first node of ListNodes once ``ok`` holds for it (polled; the test's timeout bounds it)."""
    while True:
        nodes = (await client.ListNodes(pb.ListNodesRequest())).nodes
        if nodes and ok(nodes[0]):
            return nodes[0]
        await asyncio.sleep(0.02)


def test_the_node_usage_a_heartbeat_carries_is_shown_by_list_nodes(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, channel: grpc.aio.Channel) -> None:
        client = rankctl_pb2_grpc.ClientServiceStub(channel)
        daemon = FakeDaemon(channel)
        await daemon.expect("registered")
        daemon.send(heartbeat=pb.Heartbeat(free_ports=[29555]))
        node = await node_when(client, lambda n: n.last_seen_time.seconds > 0)
        assert not node.HasField("usage")                                   # none sampled yet
        gpu = pb.GpuUsage(index=0, utilization=87.5, memory_used_bytes=3 << 30, memory_total_bytes=80 << 30)
        usage = pb.NodeUsage(cpu_percent=42.0, memory_used_bytes=5 << 30, memory_total_bytes=64 << 30, gpus=[gpu])
        usage.sample_time.FromSeconds(1_700_000_000)
        daemon.send(heartbeat=pb.Heartbeat(free_ports=[29555], usage=usage))
        node = await node_when(client, lambda n: n.HasField("usage"))
        assert node.usage == usage
        daemon.send(heartbeat=pb.Heartbeat(free_ports=[29556], usage=pb.NodeUsage(cpu_percent=7.0)))
        node = await node_when(client, lambda n: n.usage.cpu_percent != 42.0)
        assert node.usage == pb.NodeUsage(cpu_percent=7.0)                  # the newest sample replaces the last
        daemon.close()
    run(test, tmp_path)


def test_a_broken_node_stream_fails_its_job(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, channel: grpc.aio.Channel) -> None:
        client = rankctl_pb2_grpc.ClientServiceStub(channel)
        daemon = FakeDaemon(channel)
        await daemon.expect("registered")
        job = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=JOB))).job
        await daemon.expect("assign")
        daemon.call.cancel()
        failed = await wait_state(client, job.id, pb.JOB_STATE_FAILED)
        assert failed.reason == "node n0 lost (stream closed); ranks 0-1 are gone"
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a stream must start with Register
            bad = rankctl_pb2_grpc.NodeServiceStub(channel).Connect(iter([pb.NodeMessage(heartbeat=pb.Heartbeat())]))
            await bad.read()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    run(test, tmp_path)


def test_restart_keeps_the_running_job_and_the_node_reconnects(tmp_path: Path) -> None:
    async def first(coord: CoordinatorServer, channel: grpc.aio.Channel) -> str:
        client = rankctl_pb2_grpc.ClientServiceStub(channel)
        daemon = FakeDaemon(channel)
        await daemon.expect("registered")  # a job larger than the known cluster would be refused
        job = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=JOB))).job
        await daemon.expect("assign")
        daemon.report(job.id, 0, "running")
        daemon.report(job.id, 1, "running")
        await wait_state(client, job.id, pb.JOB_STATE_RUNNING)
        return job.id

    job_id = run(first, tmp_path)

    async def second(coord: CoordinatorServer, channel: grpc.aio.Channel) -> None:
        client = rankctl_pb2_grpc.ClientServiceStub(channel)
        assert (await client.GetJob(pb.GetJobRequest(job_id=job_id))).state == pb.JOB_STATE_RUNNING
        nodes = (await client.ListNodes(pb.ListNodesRequest())).nodes
        assert [(n.name, n.state) for n in nodes] == [("n0", pb.NODE_STATE_DISCONNECTED)]
        daemon = FakeDaemon(channel, running=(pb.RunningJob(job_id=job_id, attempt=1, ranks=[0, 1]),))
        assert (await daemon.expect("registered")).last_seq == 2
        daemon.report(job_id, 1, "running", seq=2)            # a replay, dropped
        daemon.report(job_id, 0, "done", code=0, seq=3)
        daemon.report(job_id, 1, "done", code=0, seq=4)
        await wait_state(client, job_id, pb.JOB_STATE_SUCCEEDED)
        daemon.close()

    run(second, tmp_path)


def test_silent_node_is_lost_and_its_stream_closed(tmp_path: Path) -> None:
    async def test(coord: CoordinatorServer, channel: grpc.aio.Channel) -> None:
        client = rankctl_pb2_grpc.ClientServiceStub(channel)
        daemon = FakeDaemon(channel)
        assert (await daemon.expect("registered")).heartbeat_interval == pytest.approx(0.075)
        job = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=JOB))).job
        await daemon.expect("assign")
        failed = await wait_state(client, job.id, pb.JOB_STATE_FAILED)      # no heartbeats are sent
        assert failed.reason == "node n0 lost (no heartbeat for 0.3 s); ranks 0-1 are gone"
        assert await daemon.call.read() is grpc.aio.EOF
    run(test, tmp_path, timeout=0.3)


def store_finished_jobs(state_dir: Path, count: int) -> None:
    """``count`` finished jobs j0 .. j{count-1}, oldest first: even ones SUCCEEDED, odd ones FAILED."""
    from rankctl.coordinator.model.records import JobRecord
    from rankctl.coordinator.model.states import JobState
    from rankctl.coordinator.store.database import Store
    from rankctl.kinds.spec import build_spec

    spec = build_spec({"name": "cc", "kind": "comm-check", "resources": {"nodes": 1, "slots_per_node": 2}})
    store = Store(state_dir)
    with store.transaction():
        for i in range(count):
            store.insert_job(JobRecord(id=f"j{i}", name="cc", kind="comm-check", spec=spec, reason="done",
                                       state=JobState.FAILED if i % 2 else JobState.SUCCEEDED, world_size=2,
                                       slots_per_node=2, created_at=1000.0 + i, finished_at=2000.5 + i,
                                       nodes=["n0"], result={"comm": []}))
    store.close()


def test_list_jobs_pages_newest_first_and_filters_by_state(tmp_path: Path) -> None:
    store_finished_jobs(tmp_path, 7)

    async def test(coord: CoordinatorServer, channel: grpc.aio.Channel) -> None:
        client = rankctl_pb2_grpc.ClientServiceStub(channel)

        async def pages(**fields: Any) -> list[list[str]]:
            out, token = [], ""
            while True:
                page = await client.ListJobs(pb.ListJobsRequest(page_token=token, **fields))
                out.append([j.id for j in page.jobs])
                if not (token := page.next_page_token):
                    return out

        assert await pages(page_size=3) == [["j6", "j5", "j4"], ["j3", "j2", "j1"], ["j0"]]
        assert await pages(page_size=2, states=[pb.JOB_STATE_FAILED]) == [["j5", "j3"], ["j1"]]
        assert await pages(states=[pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED]) == [[f"j{i}" for i in range(6, -1, -1)]]
        newest = await client.ListJobs(pb.ListJobsRequest(page_size=2))
        assert [j.id for j in newest.jobs] == ["j6", "j5"] and newest.next_page_token != ""
        short = newest.jobs[0]
        assert not (short.ranks or short.nodes or short.attempts or short.HasField("result") or short.HasField("summary"))
        assert from_struct(short.spec)["kind"] == "comm-check"
        assert (short.state, short.create_time.seconds, short.finish_time.ToJsonString()) == (
            pb.JOB_STATE_SUCCEEDED, 1006, "1970-01-01T00:33:26.500Z")  # 2006.5 s
    run(test, tmp_path)


class HeartbeatCore:
    """The one core call a heartbeat makes, recorded."""

    def __init__(self) -> None:
        self.beats: list[list[int]] = []

    def heartbeat(self, session: NodeSession, free_ports: list[int]) -> None:
        self.beats.append(free_ports)


def test_a_heartbeat_without_usage_keeps_the_last_sample_and_one_with_usage_replaces_it() -> None:
    core = HeartbeatCore()
    service = NodeServiceServicer(core, blobs=None)  # type: ignore[arg-type]
    session = NodeSession(NodeRecord("n0", "127.0.0.1", 2), NodeStatus.READY)
    service._handle(session, pb.NodeMessage(heartbeat=pb.Heartbeat(free_ports=[1])))
    assert session.usage is None
    service._handle(session, pb.NodeMessage(heartbeat=pb.Heartbeat(usage=pb.NodeUsage(cpu_percent=50.0))))
    service._handle(session, pb.NodeMessage(heartbeat=pb.Heartbeat(free_ports=[2])))
    assert session.usage == pb.NodeUsage(cpu_percent=50.0) and core.beats == [[1], [], [2]]
    from rankctl.coordinator.jobs.shown import NodeShown
    assert convert.node_to_pb(NodeShown(session, 2, None, [], [], 0)).usage.cpu_percent == 50.0
    service._handle(session, pb.NodeMessage(heartbeat=pb.Heartbeat(usage=pb.NodeUsage(cpu_percent=5.0))))
    assert session.usage.cpu_percent == 5.0


def raw_stream(channel: grpc.aio.Channel):  # noqa: ANN201 - a Connect call that writes bytes as they are
    return channel.stream_stream("/rankctl.v1.NodeService/Connect", request_serializer=lambda b: b,
                                 response_deserializer=pb.CoordinatorMessage.FromString)()


def test_a_node_stream_that_sends_no_node_message_is_told_so(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from rankctl.coordinator.api import node_service

    monkeypatch.setattr(node_service, "REGISTER_WAIT_S", 0.5)
    register = pb.NodeMessage(register=pb.Register(name="n0", address="127.0.0.1", slots=2, session="s1"))

    async def test(coord: CoordinatorServer, channel: grpc.aio.Channel) -> None:
        first = raw_stream(channel)
        await first.write(b"\xff\xff\xff\xff")                    # not a NodeMessage
        assert await first.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "NodeService/Connect: the request is not a valid protobuf message" in await first.details()
        later = raw_stream(channel)
        await later.write(register.SerializeToString())
        assert (await later.read()).WhichOneof("body") == "registered"
        await later.write(b"\xff\xff\xff\xff")
        assert await later.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "NodeService/Connect: the request is not a valid protobuf message" in await later.details()
        await node_when(rankctl_pb2_grpc.ClientServiceStub(channel), lambda n: n.state == pb.NODE_STATE_LOST)
        twice = raw_stream(channel)
        await twice.write(register.SerializeToString())
        assert (await twice.read()).WhichOneof("body") == "registered"
        await twice.write(register.SerializeToString())
        assert await twice.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "a second Register on one node stream" in await twice.details()
        silent = raw_stream(channel)                               # opened, never a Register
        assert await silent.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no Register within 0.5 s" in await silent.details()
    run(test, tmp_path)
