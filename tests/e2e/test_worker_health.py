"""A worker daemon's health and reconnects: the health service names only services that exist and says
NOT_SERVING while the coordinator is away (real ``ctl coordinator`` / ``ctl worker`` processes); the
reconnect waits are jittered, so that thousands of daemons cut off together do not return in lockstep."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import start_coordinator, start_worker, wait_for
from rankctl.worker.daemon.daemon import WorkerDaemon
from rankctl.worker.daemon.serve import PEER_SERVICE
from rankctl.worker.uplink.session import reconnect_delay
from test_defects_worker import RecordingLauncher, config

INITIAL, CAP = 0.2, 5.0


def test_reconnect_waits_stay_between_the_initial_wait_and_the_cap() -> None:
    rng, delay, waits = random.Random(7), 0.0, []
    for _ in range(200):
        delay = reconnect_delay(delay, INITIAL, CAP, rng)
        waits.append(delay)
    assert all(INITIAL <= w <= CAP for w in waits)   # a daemon retries at least every CAP seconds
    assert waits[0] <= 3 * INITIAL and max(waits) == CAP
    assert len({round(w, 3) for w in waits if w < CAP}) > 20   # no fixed doubling ladder


def test_daemons_cut_off_together_come_back_spread_out() -> None:
    """A thousand daemons whose streams broke at once: their first retries spread over [INITIAL, 3 INITIAL],
    and after five failed retries each their next attempts spread over seconds."""
    firsts = [reconnect_delay(0.0, INITIAL, CAP, random.Random(i)) for i in range(1000)]
    assert min(firsts) >= INITIAL and max(firsts) <= 3 * INITIAL
    assert len({round(f, 3) for f in firsts}) > 300
    sixth = []
    for i in range(1000):
        rng, at, delay = random.Random(i), 0.0, 0.0
        for _ in range(6):
            delay = reconnect_delay(delay, INITIAL, CAP, rng)
            at += delay
        sixth.append(at)
    per_second = [sum(1 for t in sixth if s <= t < s + 1) for s in range(int(max(sixth)) + 1)]
    assert max(per_second) < 400 and max(sixth) - min(sixth) > 5


class RecordingRandom(random.Random):
    def __init__(self) -> None:
        super().__init__(0)
        self.calls: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.calls.append((a, b))
        return a


def test_the_daemon_draws_its_reconnect_waits_from_the_injected_rng(tmp_path: Path) -> None:
    rng = RecordingRandom()

    async def main() -> None:
        daemon = WorkerDaemon(config(tmp_path), RecordingLauncher(), rng=rng)   # nothing listens there
        task = asyncio.create_task(daemon.run())
        await asyncio.sleep(0.6)
        daemon.stop()
        await asyncio.gather(task, return_exceptions=True)
        assert daemon.stats.connect_failures >= 3 and not daemon.online

    asyncio.run(main())
    assert len(rng.calls) >= 3 and rng.calls[0] == (0.05, pytest.approx(0.15))


def health_port(log: Path) -> int:
    for line in log.read_text(errors="replace").splitlines():
        if '"worker started"' in line:
            return int(json.loads(line)["health_port"])
    return 0


def health(port: int, service: str = "") -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=5)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.mark.timeout(300)
@pytest.mark.grpc_in_process
def test_worker_health_follows_its_coordinator_session(tmp_path: Path) -> None:
    state = tmp_path / "coordinator"
    coordinator, address = start_coordinator(state)
    worker = start_worker(address, "node-a", 1, tmp_path)
    try:
        port = wait_for(lambda: health_port(worker.log), 120, "the worker's health port")
        wait_for(lambda: health(port) == "SERVING", 120, "SERVING with the coordinator up")
        assert health(port, PEER_SERVICE) == "SERVING"
        assert health(port, "rankctl.v1.Worker") == "NOT_FOUND"    # no such service
        coordinator.kill(signal.SIGKILL)
        wait_for(lambda: health(port) == "NOT_SERVING", 60, "NOT_SERVING with the coordinator gone")
        assert health(port, PEER_SERVICE) == "SERVING"           # peers still get their shards
        coordinator, again = start_coordinator(state, listen=address)
        assert again == address
        wait_for(lambda: health(port) == "SERVING", 60, "SERVING once registered again")
    finally:
        worker.stop()
        coordinator.stop()
