"""A daemon's write that races the end of its coordinator stream ends the session, never the daemon.

grpc.aio raises ``asyncio.InvalidStateError: RPC already finished`` (not ``AioRpcError``) for a write on a call
the server already ended. CI saw it kill a daemon whose certificate was revoked: the coordinator ended the stream
(UNAUTHENTICATED) while a heartbeat went out, and the daemon stopped with "internal error: InvalidStateError"
instead of logging the refusal and retrying. Here a real gRPC server ends each stream at once, and the session's
Register is written only once the call is over, so the race is taken every time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import structlog.testing

from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.worker.daemon.daemon import WorkerDaemon
from rankctl.worker.uplink.session import raise_ended
from test_defects_worker import RecordingLauncher, config

REFUSAL = "the certificate of node node-a is revoked (serial 7)"


class Refusing(pb_grpc.NodeServiceServicer):
    """Ends every node stream at once, as the coordinator ends a revoked node's."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> None:
        self.code, self.streams = code, 0

    async def Connect(self, request_iterator, context):  # noqa: ANN001, ANN201
        self.streams += 1
        if self.code == grpc.StatusCode.OK:
            return
        await context.abort(self.code, REFUSAL)


async def serve(servicer: Refusing) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    pb_grpc.add_NodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.grpc_in_process
@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK])
def test_a_write_after_the_stream_ended_raises_what_ended_it(code: grpc.StatusCode) -> None:
    async def main() -> None:
        server, address = await serve(Refusing(code))
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = pb_grpc.NodeServiceStub(channel).Connect()
                assert await call.code() == code          # the server ended it
                with pytest.raises(asyncio.InvalidStateError):   # what grpc.aio says to a write now
                    await call.write(pb.NodeMessage(heartbeat=pb.Heartbeat(ts=1.0)))
                if code == grpc.StatusCode.OK:
                    with pytest.raises(ConnectionError, match="closed the stream"):
                        await raise_ended(call)
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await raise_ended(call)
                    assert err.value.code() == code and err.value.details() == REFUSAL
        finally:
            await server.stop(None)

    asyncio.run(main())


@pytest.mark.grpc_in_process
def test_a_daemon_whose_write_races_a_refusal_logs_it_and_retries(tmp_path: Path) -> None:
    async def main() -> None:
        servicer = Refusing()
        server, address = await serve(servicer)
        daemon = WorkerDaemon(config(tmp_path, coordinator=address), RecordingLauncher())
        session, register = daemon.session, daemon.session._register

        async def late_register(call) -> None:  # noqa: ANN001 - the Register goes out after the stream ended
            await call.code()
            await register(call)
        session._register = late_register
        task = asyncio.create_task(daemon.run())
        try:
            with structlog.testing.capture_logs() as logs:
                for _ in range(100):   # reconnects at the backoff's pace (50 ms here)
                    await asyncio.sleep(0.05)
                    if daemon.stats.connect_failures >= 3 or task.done():
                        break
            assert not task.done(), task.exception()   # before: InvalidStateError ended the daemon
            assert daemon.stats.connect_failures >= 3 and servicer.streams >= 3
            refusals = [e["error"] for e in logs if e["log_level"] == "error" and "revoked" in e["event"]]
            assert refusals and refusals[0] == REFUSAL, logs   # the refusal is logged, as a read's would be
        finally:
            daemon.stop()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)

    asyncio.run(main())
