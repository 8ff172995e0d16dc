"""docs/architecture.md is a map: at most 400 lines, and every module path and folder it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAP = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"`((?:[\w.-]+/)+[\w.*-]*)`")


def named_paths(text: str) -> list[str]:
    """The repository paths a text names in backticks: ``coordinator/jobs/core.py``, ``worker/runs/``."""
    return [p for chunk in PATH.findall(text) for p in chunk.split() if "/" in p]


def test_the_map_is_short() -> None:
    assert len(MAP.read_text().splitlines()) <= 400


def test_every_path_the_map_names_exists() -> None:
    paths = named_paths(MAP.read_text())
    assert len(paths) > 60
    missing = [p for p in paths if not list(ROOT.glob(p.rstrip("/")))]
    assert missing == []


def test_the_check_sees_a_missing_path() -> None:
    assert named_paths("see `coordinator/jobs/nope.py` and `worker/runs/`, not `x`") == \
        ["coordinator/jobs/nope.py", "worker/runs/"]
    assert not list(ROOT.glob("coordinator/jobs/nope.py"))
