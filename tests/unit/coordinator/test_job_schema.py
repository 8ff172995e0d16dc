"""GetJobSchema's answer: the JSON Schema of the job file users write (every registered kind's sections)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rankctl.coordinator.api import auth

from rankctl.coordinator.api import convert
from rankctl.contract.spec import JobSpec
from rankctl.kinds import registry
from toykind import KIND as TOY

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def schema() -> tuple[dict, str]:
    msg = convert.job_schema_to_pb()
    return json.loads(msg.schema_json), msg.version


def _resolve(node: dict, defs: dict) -> dict:
    """A property's schema with a ``$ref`` followed (also inside an optional section's ``anyOf``)."""
    refs = [s for s in node.get("anyOf", ()) if "$ref" in s]
    node = refs[0] if refs else node
    return defs[node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node


def unknown_keys(doc: dict, node: dict, defs: dict, where: str = "") -> list[str]:
    """Keys of ``doc`` that the schema ``node`` does not declare, section by section (a structural check)."""
    props = _resolve(node, defs).get("properties", {})
    out = []
    for key, value in doc.items():
        if key not in props:
            out.append(where + key)
        elif isinstance(value, dict) and "properties" in _resolve(props[key], defs):
            out += unknown_keys(value, props[key], defs, f"{where}{key}.")
    return out


def test_every_example_job_file_is_described_by_the_schema() -> None:
    s, _ = schema()
    assert s["$schema"].endswith("/draft/2020-12/schema") and s["required"] == ["name"]
    assert s["additionalProperties"] is False  # unknown fields are errors (contract.spec.Section)
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert len(files) >= 5
    for path in files:
        doc = yaml.safe_load(path.read_text())
        assert unknown_keys(doc, s, s["$defs"]) == [], path.name
        assert doc.get("kind", s["properties"]["kind"]["default"]) in s["properties"]["kind"]["enum"]


def test_the_schema_is_built_once_and_follows_the_registered_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[type] = []   # every JSON Schema generation of a job-file model (each ``spec_model()`` is a JobSpec)
    generate = JobSpec.model_json_schema.__func__

    def counted(cls: type, *args, **kwargs) -> dict:  # noqa: ANN002, ANN003 - pydantic's own signature
        built.append(cls)
        return generate(cls, *args, **kwargs)

    monkeypatch.setattr(JobSpec, "model_json_schema", classmethod(counted))
    before, version = schema()
    assert len(built) <= 1   # built now, or by an earlier test for the same kinds
    built.clear()
    assert schema()[1] == version and schema()[1] == version
    assert built == []   # cached: no model_json_schema() per call
    assert "toy" not in before["properties"]
    registry.register(TOY)
    try:
        after, new_version = schema()
        assert new_version != version and "toy" in after["properties"] and "toy-kind" in after["properties"]["kind"]["enum"]
        assert len(built) == 1   # a new kind: built again, once (the counter sees a build)
        assert schema()[1] == new_version and len(built) == 1
    finally:
        registry.unregister("toy-kind")
    assert "toy" not in schema()[0]["properties"]


def test_any_user_may_read_the_schema() -> None:
    assert auth.needed("/rankctl.v1.ClientService/GetJobSchema") == auth.VIEWER
