"""Per-rank limits from the job file (worker.limits): what is written where, and the refusals.
The kernel's side (an OOM kill at the limit, a refused fork) is in test_e2e_leftovers."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankctl.contract.spec import Resources
from rankctl.worker.launcher.limits import Controller, Limits, RankLimits, Unenforceable


def test_limits_come_from_the_spec_and_default_to_none() -> None:
    assert RankLimits.of(Resources()) == RankLimits()
    assert RankLimits.of(Resources(memory_mb=512, pids_max=100)).files() == {
        "memory": ("memory.max", "memory.limit_in_bytes", str(512 << 20)),
        "pids": ("pids.max", "pids.max", "100"),
    }


@pytest.mark.parametrize("field, value", [("memory_mb", 1), ("memory_mb", 1 << 30), ("pids_max", 2)])
def test_a_limit_out_of_range_names_its_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        Resources(**{field: value})


def test_a_limit_no_controller_can_set_is_refused_naming_the_field(tmp_path: Path) -> None:
    limits = Limits({"pids": Controller("pids", str(tmp_path), False)}, {"memory": "no memory controller here"})
    with pytest.raises(Unenforceable, match=r"resources.memory_mb=512 cannot be enforced on this node: no memory"):
        limits.prepare("j.1.0", RankLimits(memory_mb=512, pids_max=50))
    assert limits.prepare("j.1.1", RankLimits(pids_max=50)) == [str(tmp_path / "j.1.1")]
    assert limits.prepare("j.1.2", RankLimits()) == []
    assert "limits: pids (cgroup v1)" == limits.describe()


def test_v1_limits_are_written_and_removed_and_oom_kills_read(tmp_path: Path) -> None:
    mem, pids = tmp_path / "memory", tmp_path / "pids"
    mem.mkdir(), pids.mkdir()
    limits = Limits({"memory": Controller("memory", str(mem), False), "pids": Controller("pids", str(pids), False)}, {})
    dirs = limits.prepare("k", RankLimits(memory_mb=64, pids_max=20))
    assert sorted(dirs) == [str(mem / "k"), str(pids / "k")]
    assert (mem / "k" / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (pids / "k" / "pids.max").read_text() == "20"
    (mem / "k" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert limits.oom_kills("k") == 3
    for d in (mem / "k", pids / "k"):  # a real cgroup directory's files go with it; a plain one's do not
        for f in d.iterdir():
            f.unlink()
    limits.release("k")
    assert not (mem / "k").exists() and not (pids / "k").exists()


def test_v2_limits_go_in_the_ranks_own_directory_and_oom_kills_come_from_memory_events(tmp_path: Path) -> None:
    limits = Limits({"memory": Controller("memory", str(tmp_path), True)}, {"pids": "none"})
    (tmp_path / "k").mkdir()  # containment made it
    assert limits.prepare("k", RankLimits(memory_mb=128)) == []  # containment enters it
    assert (tmp_path / "k" / "memory.max").read_text() == str(128 << 20)
    assert limits.oom_kills("k") == 0
    (tmp_path / "k" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    assert limits.oom_kills("k") == 1
