"""Every job-file field has a docstring, which is its description in the served JSON Schema and in
docs/job-file.md; the page is current."""

from __future__ import annotations

import json
from pathlib import Path

from rankctl.coordinator.api import convert
from rankctl.kinds import jobdoc

PAGE = Path(__file__).resolve().parents[3] / "docs" / "job-file.md"


def test_every_field_of_every_section_is_described() -> None:
    assert jobdoc.undescribed() == []


def test_the_served_schema_carries_the_docstrings() -> None:
    schema = json.loads(convert.job_schema_to_pb().schema_json)
    hang = schema["$defs"]["RestartSpec"]["properties"]["hang_timeout"]
    assert hang["description"].startswith("Seconds a RUNNING job may stay still")
    assert "elastic" in schema["$defs"]["Resources"]["properties"]["min_nodes"]["description"].lower()
    assert schema["properties"]["train"]["description"].startswith("The training run")


def test_docs_job_file_is_written_from_the_spec() -> None:
    assert PAGE.read_text() == jobdoc.reference(), \
        "docs/job-file.md is stale: python -m rankctl.kinds.jobdoc > docs/job-file.md"


def test_the_check_sees_a_field_without_a_description() -> None:
    from pydantic import create_model

    from rankctl.contract.spec import Section

    class Part(Section):
        said: int = 1
        """A field with its docstring."""

    bare = create_model("Bare", __base__=Section, size=(int, 1), part=(Part, Part()))
    assert jobdoc.undescribed(bare) == ["size", "part"]   # Part.said has its docstring


def test_only_the_schemas_required_fields_read_required() -> None:
    """Issue 53, item 10: ``python.args`` and ``python.env`` (empty by default) read "required" in the page."""
    from rankctl.kinds.jobdoc import reference

    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in reference().splitlines()
            if line.startswith("| `")}
    assert rows["`args`"] == "`[]`" and rows["`env`"] == "`{}`", (rows["`args`"], rows["`env`"])
    assert rows["`name`"] == "required"
