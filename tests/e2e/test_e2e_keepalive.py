"""HTTP/2 keepalive both ways, through the real ``ctl coordinator`` and two ``ctl worker`` daemons:

* a stopped daemon is lost within the heartbeat timeout though its fleet was asked to heartbeat seldom (the
  coordinator's pings end its stream, not the heartbeats);
* a stopped coordinator ends the daemons' sessions within seconds (the daemons' pings), so they go looking for a
  leader instead of waiting on a silent stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from cluster import Proc, ctl, start_coordinator, start_worker, wait_for


class Fleet:
    def __init__(self, root: Path) -> None:
        # at most one heartbeat a second from the fleet: 2 nodes beat every 3 s (0.75 s doubled twice), so a silent
        # one would be judged on heartbeats only after 12 s; the 3 s heartbeat timeout holds through keepalive
        self.coord, self.address = start_coordinator(root / "coord", heartbeat_timeout=3.0,
                                                     extra=("--max-heartbeat-rate", "1"))
        self.workers: dict[str, Proc] = {n: start_worker(self.address, n, 1, root, idle_warm=False)
                                         for n in ("node-a", "node-b")}

    def states(self) -> dict[str, str]:
        out = ctl(self.address, "nodes", "--json")
        return {n["name"]: n["state"] for n in json.loads(out.stdout)} if out.returncode == 0 else {}

    def stop(self) -> None:
        for proc in (*self.workers.values(), self.coord):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    f = Fleet(tmp_path_factory.mktemp("keepalive"))
    yield f
    f.stop()


def events(log: str, name: str) -> list[dict]:
    """The JSON log records of event ``name``."""
    out = []
    for line in log.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == name:
                out.append(record)
    return out


def test_a_stopped_daemon_is_lost_by_keepalive_within_the_timeout_though_heartbeats_come_seldom(fleet: Fleet
                                                                                                ) -> None:
    wait_for(lambda: fleet.states() == {"node-a": "READY", "node-b": "READY"}, 60, "both nodes READY")
    wait_for(lambda: any(e.get("interval") == 3.0 for e in events(fleet.coord.output(), "node.heartbeat_retuned")),
             30, "the fleet asked for a heartbeat every 3 s")
    time.sleep(1.0)
    victim = fleet.workers["node-b"]
    os.kill(victim.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        wait_for(lambda: fleet.states().get("node-b") == "LOST", 60, "node-b LOST")
        took = time.monotonic() - t0
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    lost = [e["detail"] for e in events(fleet.coord.output(), "node.lost") if e.get("node") == "node-b"]
    print(f"\nnode-b SIGSTOPped: LOST after {took:.1f} s ({lost})")
    assert lost[:1] == ["stream closed"], lost           # the transport ended it, not "no heartbeat for 12.0 s"
    assert fleet.states().get("node-a") == "READY"       # the live one answers the pings


def test_a_stopped_coordinator_ends_the_daemons_sessions_within_seconds(fleet: Fleet) -> None:
    daemon = fleet.workers["node-a"]
    wait_for(lambda: fleet.states().get("node-a") == "READY", 60, "node-a READY")
    before = len(events(daemon.output(), "coordinator unreachable"))
    os.kill(fleet.coord.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        wait_for(lambda: len(events(daemon.output(), "coordinator unreachable")) > before, 60,
                 "node-a to find the coordinator silent")
        took = time.monotonic() - t0
    finally:
        os.kill(fleet.coord.pid, signal.SIGCONT)
    print(f"\ncoordinator SIGSTOPped: node-a's session ended after {took:.1f} s")
    wait_for(lambda: fleet.states().get("node-a") == "READY", 60, "node-a registered again")
