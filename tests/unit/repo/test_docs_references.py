"""Every document that README, docs/ and the examples point a reader to is in the repository (issue 23: an
example named an ARCHITECTURE.md that was not there)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MD = re.compile(r"(?<![\w./-])([\w./-]+\.md)\b")
# The team's shared design notes live outside this repository; docs/architecture.md says where it started from.
OUTSIDE = {"shared/ARCHITECTURE.md"}


def _sources() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.yaml")),
            *sorted((ROOT / "examples").rglob("*.py"))]


def test_every_referenced_document_exists() -> None:
    missing = []
    for src in _sources():
        for name in MD.findall(src.read_text()):
            if name in OUTSIDE:
                continue
            if not any((base / name).is_file() for base in (src.parent, ROOT, ROOT / "docs")):
                missing.append(f"{src.relative_to(ROOT)} -> {name}")
    assert not missing, missing


def test_the_check_sees_a_missing_document(tmp_path: Path) -> None:
    assert MD.findall("see ARCHITECTURE.md and docs/api.md.") == ["ARCHITECTURE.md", "docs/api.md"]
    assert not (ROOT / "ARCHITECTURE.md").exists()
