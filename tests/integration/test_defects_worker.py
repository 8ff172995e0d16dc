"""The worker daemon against misbehaving parts: a launcher that will not start again, a
coordinator that sends ids that are not safe paths, a rank that floods its log.

No coordinator process here: a small grpc.aio NodeService in the test stands in for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

import grpc
import pytest
from structlog.testing import capture_logs

from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.worker.daemon.daemon import DaemonConfig, LauncherLost, WorkerDaemon
from rankctl.worker.runs.launcher_client import LauncherError

pytestmark = [pytest.mark.timeout(120), pytest.mark.grpc_in_process]


class DeadLauncher:
    """A launcher whose process has already exited: no events, nothing to launch."""

    hardware: dict = {}
    pid = 0

    async def events(self):
        return
        yield

    async def launch(self, assignments) -> None:
        raise LauncherError("launcher is gone")

    async def kill(self, job_id: str) -> None:
        raise LauncherError("launcher is gone")

    async def close(self) -> int:
        return 0


def config(state: Path, coordinator: str = "127.0.0.1:1", **kw) -> DaemonConfig:
    return DaemonConfig(coordinator=coordinator, name="node-a", slots=2, state_dir=state, backoff_initial=0.05,
                        **kw)


def test_daemon_gives_up_when_no_new_launcher_starts(tmp_path: Path) -> None:
    serving: list[bool] = []

    async def main() -> None:
        async def start() -> None:
            raise LauncherError("launcher exited before ready (exit 1)")

        async def set_serving(ok: bool) -> None:
            serving.append(ok)

        daemon = WorkerDaemon(config(tmp_path, launcher_restarts=3, launcher_backoff=0.01), DeadLauncher(),
                              start_launcher=start, set_serving=set_serving)
        with pytest.raises(LauncherLost, match="did not restart after 3 tries: launcher exited before ready"):
            await asyncio.wait_for(daemon.run(), 30)

    asyncio.run(main())
    assert serving == [False]


class FakeCoordinator(pb_grpc.NodeServiceServicer):
    """Acknowledges a Register, then sends what the test puts in ``outbox``; keeps what comes in."""

    def __init__(self) -> None:
        self.inbox: list[pb.NodeMessage] = []
        self.outbox: asyncio.Queue[pb.CoordinatorMessage] = asyncio.Queue()

    async def _read(self, requests) -> None:
        async for msg in requests:
            self.inbox.append(msg)

    async def Connect(self, requests, context):  # noqa: N802 - the gRPC method name
        self.inbox.append(await anext(requests))
        yield pb.CoordinatorMessage(registered=pb.Registered(node="node-a", heartbeat_interval=1.0))
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                yield await self.outbox.get()
        finally:
            reader.cancel()

    def reports(self) -> list[pb.RankReport]:
        """Every report the daemon sent, in order (it sends them in ReportBatch messages)."""
        out: list[pb.RankReport] = []
        for m in self.inbox:
            body = m.WhichOneof("body")
            if body == "report":
                out.append(m.report)
            elif body == "batch":
                out.extend(m.batch.reports)
        return out


async def serve(servicer: pb_grpc.NodeServiceServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_NodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        await asyncio.sleep(0.05)


def assign(job_id: str, attempt: int = 1, *, rank: int = 0, name: str = "ok", kind: str = "comm-check") -> pb.CoordinatorMessage:
    """A node's compact Assign of one rank (its ranks compute their own groups from the spec)."""
    return pb.CoordinatorMessage(assign=pb.Assign(
        job_id=job_id, attempt=attempt, world_size=1, first_rank=rank, rank_count=1, rendezvous="127.0.0.1:0",
        backend="gloo", kind=kind, spec_json=json.dumps({"name": name, "kind": kind})))


class RecordingLauncher(DeadLauncher):
    def __init__(self) -> None:
        self.launched: list = []

    async def events(self):
        await asyncio.Event().wait()  # alive, and quiet
        yield

    async def launch(self, assignments) -> None:
        self.launched.extend(assignments)


ESCAPE = "../../../escaped"
BAD = [assign(ESCAPE), assign("ok-0a1b2c", name=ESCAPE),
       assign("ok-0a1b2c", attempt=-1), assign("ok-0a1b2c", rank=-1), assign("Ok/../x-0a1b2c")]


def test_ids_that_are_not_safe_paths_are_refused_and_nothing_leaves_the_state_dir(tmp_path: Path) -> None:
    state, launcher = tmp_path / "a" / "state", RecordingLauncher()
    state.mkdir(parents=True)

    async def main() -> tuple[int, list[pb.RankReport]]:
        fake = FakeCoordinator()
        server, address = await serve(fake)
        daemon = WorkerDaemon(config(state, address), launcher)
        task = asyncio.create_task(daemon.run())
        await asyncio.wait_for(daemon.connected.wait(), 30)
        for msg in BAD:
            fake.outbox.put_nowait(msg)
        deadline = time.monotonic() + 5
        while getattr(daemon, "refused", 0) < len(BAD) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        daemon.stop()
        await task
        await server.stop(0)
        return getattr(daemon, "refused", 0), fake.reports()

    with capture_logs() as logs:
        refused, reports = asyncio.run(main())
    assert sorted(os.listdir(tmp_path)) == ["a"] and os.listdir(tmp_path / "a") == ["state"]
    assert not (state / "jobs").exists() and launcher.launched == []
    assert refused == len(BAD)
    assert {r.status.error.split(": ", 1)[0] for r in reports if r.status.exited} == {
        "node node-a refused the assignment"}
    errors = [e for e in logs if e["event"] == "assignment refused" and e["log_level"] == "error"]
    assert len(errors) == len(BAD) and "job id '../../../escaped'" in errors[0]["error"], errors
    assert "../../../escaped" in errors[1]["error"], errors[1]  # the job name, refused as a path


DROPPED = re.compile(r"^\[rankctl: (\d+) lines dropped")


def test_ctl_worker_refuses_a_bad_node_name(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from rankctl.cli.main import cli

    out = CliRunner().invoke(cli, ["worker", "--name", "Bad/Name", "--state-dir", str(tmp_path / "state")])
    assert out.exit_code == 2, out.output
    assert "--name 'Bad/Name' must be" in out.output and "Traceback" not in out.output
    assert not (tmp_path / "state").exists()


def test_ctl_worker_names_the_node_after_the_lower_cased_hostname(monkeypatch) -> None:
    from rankctl.cli.commands import daemons

    monkeypatch.setattr(daemons.socket, "gethostname", lambda: "GPU-Node-07.Cluster")
    assert daemons.node_name(None) == "gpu-node-07.cluster"
    monkeypatch.setattr(daemons.socket, "gethostname", lambda: "node_7")
    with pytest.raises(daemons.CtlError, match="the hostname 'node_7' must be .*; pass --name"):
        daemons.node_name(None)


TAKEN = "node name 'node-a' is held by a live daemon (session node-a-123 from 10.0.0.7)"


class NameTakenCoordinator(pb_grpc.NodeServiceServicer):
    """Refuses every session, as the coordinator does a second live daemon under one name."""

    def __init__(self) -> None:
        self.connects = 0

    async def Connect(self, requests, context):  # noqa: N802 - the gRPC method name
        self.connects += 1
        await anext(requests)
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, TAKEN)
        yield pb.CoordinatorMessage()


def test_daemon_stops_when_its_node_name_is_taken(tmp_path: Path) -> None:
    from rankctl.worker.daemon.daemon import NodeNameTaken

    async def main() -> int:
        fake = NameTakenCoordinator()
        server, address = await serve(fake)
        daemon = WorkerDaemon(config(tmp_path, address), RecordingLauncher())
        with pytest.raises(NodeNameTaken, match="^node name 'node-a' is held"):
            await asyncio.wait_for(daemon.run(), 30)
        await asyncio.sleep(0.5)  # a retry loop would connect again by now (backoff 0.05 s)
        await server.stop(0)
        return fake.connects

    assert asyncio.run(main()) == 1


def test_ctl_worker_exits_2_printing_why_its_name_is_taken(tmp_path: Path) -> None:
    async def main() -> tuple[int, str]:
        server, address = await serve(NameTakenCoordinator())
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rankctl.cli.main", "worker", "--coordinator", address, "--name", "node-a",
            "--state-dir", str(tmp_path / "state"), stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 90)
        finally:
            if proc.returncode is None:
                proc.kill()
            await server.stop(0)
        return proc.returncode, err.decode()

    code, err = asyncio.run(main())
    assert code == 2, err[-2000:]
    assert f"error: {TAKEN}" in err and "Traceback" not in err


def test_daemon_gives_up_on_a_launcher_that_keeps_dying(tmp_path: Path) -> None:
    starts: list[int] = []

    async def main() -> None:
        async def start() -> DeadLauncher:  # starts, then dies at once, every time
            starts.append(1)
            return DeadLauncher()

        daemon = WorkerDaemon(config(tmp_path, launcher_restarts=2, launcher_backoff=0.01), DeadLauncher(),
                              start_launcher=start)
        with pytest.raises(LauncherLost, match="died 3 times in a row"):
            await asyncio.wait_for(daemon.run(), 30)

    asyncio.run(main())
    assert len(starts) == 2
