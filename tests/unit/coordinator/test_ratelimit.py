"""Node stream budgets (coordinator.ratelimit): within the burst nothing waits; past it the wait is what
the rate needs, debts add up, and an idle stream earns its burst back."""

from __future__ import annotations

import pytest

from rankctl.coordinator.api.ratelimit import BYTES_BURST, REPORTS_BURST, REPORTS_PER_S, StreamBudget, TokenBucket


def test_a_burst_passes_and_then_the_rate_holds() -> None:
    b = TokenBucket(rate=100.0, burst=10.0)
    assert [b.delay(1, 0.0) for _ in range(10)] == [0.0] * 10
    assert b.delay(1, 0.0) == pytest.approx(0.01)
    assert b.delay(1, 0.0) == pytest.approx(0.02)      # debts add up
    assert b.delay(1, 1.0) == 0.0                       # a second later the bucket is full again
    assert b.tokens == pytest.approx(9.0)


def test_a_node_replaying_many_reports_is_slowed_not_dropped() -> None:
    s = StreamBudget()
    assert s.delay(int(REPORTS_BURST), 1000, 0.0) == 0.0
    wait = s.delay(int(REPORTS_PER_S), 1000, 0.0)
    assert wait == pytest.approx(1.0)
    assert s.delay(1, BYTES_BURST, 10.0) == 0.0 and s.delay(1, 8 << 20, 10.0) == pytest.approx(1.0)
    assert s.waited == pytest.approx(2.0)


def test_the_time_a_stream_is_held_back_is_not_the_nodes_silence(tmp_path) -> None:  # noqa: ANN001
    from rankctl.coordinator.api.node_service import held_back
    from rankctl.coordinator.fleet.nodes import NodeStatus
    from test_core import make_world

    world = make_world(tmp_path, timeout=10.0)
    node = world.connect("n0", slots=2)
    held_back(node.session, world.clock(), 40.0)   # a replay read 40 s late: its heartbeats wait behind it
    world.clock.t += 45.0
    world.core.tick()
    assert node.session.status is NodeStatus.READY
    world.clock.t += 10.0                      # 10 s of real silence after the hold: lost
    world.core.tick()
    assert node.session.status is NodeStatus.LOST
    world.store.close()


def test_malformed_requests_log_one_line_per_method_a_period_with_the_count() -> None:
    from structlog.testing import capture_logs

    from rankctl.security.malformed import RequestGuard

    now = [0.0]
    guard = RequestGuard(period_s=60.0, clock=lambda: now[0])
    with capture_logs() as logs:
        for t in (0.0, 1.0, 2.0, 61.0):
            now[0] = t
            guard.note("/a/B", "corrupt")
        guard.note("/a/C", "corrupt")
    assert [(e["method"], e["refused"]) for e in logs] == [("/a/B", 1), ("/a/B", 3), ("/a/C", 1)]
