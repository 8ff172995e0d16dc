"""Pure rules that read a job's rank statuses: running, done, failed, and how to say so."""

from __future__ import annotations

from rankctl.coordinator.records import RankRecord


def rank_span(ranks: list[int]) -> str:
    """[4, 5, 6, 7] -> "ranks 4-7"; [3] -> "rank 3"; [1, 2, 5] -> "ranks 1-2, 5"."""
    if not ranks:
        return "no ranks"
    ranks = sorted(ranks)
    parts, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def last_error_line(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return lines[-1] if lines else "no error reported"


def first_failure(ranks: dict[int, RankRecord]) -> RankRecord | None:
    """The lowest rank that exited with a nonzero code (or in phase ``failed``), if any."""
    failed = [r for r in ranks.values() if r.exited and (r.exit_code != 0 or r.phase == "failed")]
    return min(failed, key=lambda r: r.rank) if failed else None


def failure_reason(r: RankRecord) -> str:
    return f"rank {r.rank} on node {r.node} exited with code {r.exit_code}: {last_error_line(r.error)}"


def all_running(ranks: dict[int, RankRecord], world_size: int) -> bool:
    return len(ranks) == world_size and all(r.passed_running() for r in ranks.values())


def all_succeeded(ranks: dict[int, RankRecord], world_size: int) -> bool:
    return len(ranks) == world_size and all(r.exited and r.exit_code == 0 for r in ranks.values())


def changed(old: RankRecord | None, new: RankRecord) -> bool:
    """Whether a report is worth an event: phase, step or exit changed."""
    if old is None:
        return True
    return (old.phase, old.step, old.exited, old.exit_code) != (new.phase, new.step, new.exited, new.exit_code)
