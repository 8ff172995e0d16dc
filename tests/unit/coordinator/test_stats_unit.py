"""Unit tests of coordinator.model.stats: the counters the core keeps for its metrics."""

from __future__ import annotations

from rankctl.coordinator.model.stats import QUEUE_WAIT_BUCKETS, RESTART_CAUSES, CoordinatorStats


def test_a_fresh_stats_counts_nothing() -> None:
    stats = CoordinatorStats()
    assert stats.rank_reports == 0
    assert stats.restarts == {}
    assert stats.queue_wait.count == 0 and stats.queue_wait.total == 0.0


def test_queue_wait_buckets_rise_from_a_second_to_a_day() -> None:
    assert QUEUE_WAIT_BUCKETS[0] == 1.0 and QUEUE_WAIT_BUCKETS[-1] == 24 * 3600.0
    assert list(QUEUE_WAIT_BUCKETS) == sorted(set(QUEUE_WAIT_BUCKETS))


def test_the_queue_wait_histogram_uses_the_queue_wait_buckets_plus_one_above_them() -> None:
    stats = CoordinatorStats()
    assert stats.queue_wait.bounds == QUEUE_WAIT_BUCKETS
    assert len(stats.queue_wait.counts) == len(QUEUE_WAIT_BUCKETS) + 1


def test_queue_wait_observations_fall_in_cumulative_buckets() -> None:
    stats = CoordinatorStats()
    for seconds in (0.5, 1.0, 30.0, 10 * 86400.0):
        stats.queue_wait.observe(seconds)
    buckets = dict(stats.queue_wait.buckets())
    assert buckets["1.0"] == 2 and buckets["60.0"] == 3 and buckets["86400.0"] == 3 and buckets["+Inf"] == 4
    assert stats.queue_wait.total == 0.5 + 1.0 + 30.0 + 10 * 86400.0


def test_each_stats_has_its_own_counters() -> None:
    one, two = CoordinatorStats(), CoordinatorStats()
    one.restarts["failure"] += 2
    one.queue_wait.observe(3.0)
    assert two.restarts == {} and two.queue_wait.count == 0
    assert one.queue_wait is not two.queue_wait


def test_restart_causes_are_failure_drain_and_grow() -> None:
    assert RESTART_CAUSES == ("failure", "drain", "grow")
    stats = CoordinatorStats()
    for cause in RESTART_CAUSES:
        stats.restarts[cause] += 1
    assert sum(stats.restarts.values()) == 3
