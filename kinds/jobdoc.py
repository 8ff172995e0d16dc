"""The job file's reference (``docs/job-file.md``), written from the spec's own field docstrings.

Each field of the common sections (``contract.spec``) and of every registered kind's sections (``kinds/<kind>/spec.py``)
has a docstring; pydantic makes it the field's description in the JSON Schema that ``GetJobSchema`` serves (and
editors read), and this module writes the same descriptions, with each field's type, default and bounds, as
Markdown. ``python -m rankctl.kinds.jobdoc > docs/job-file.md`` writes the page; a test checks that it is current
and that no field lacks a description. Pure: no torch.
"""

from __future__ import annotations

import json
from typing import Any

from rankctl.kinds.spec import spec_model

HEAD = """# The job file

A job file is YAML: the sections below, each field with its type, default and rule. Unknown fields are errors;
`--set SECTION.FIELD=VALUE` overrides any field on `ctl submit`, `ctl plan` and `ctl up`. `ctl plan job.yaml` checks
a file without submitting it; `GetJobSchema` serves the same rules as a JSON Schema. This page is written from the
spec's field docstrings (`python -m rankctl.kinds.jobdoc > docs/job-file.md`); a test keeps it current.
"""


def _type(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in prop:
        return "section"
    if "enum" in prop:
        return " \\| ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    if "anyOf" in prop:
        return " \\| ".join(_type(p, defs) for p in prop["anyOf"])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}), defs)}"
    if kind == "object":
        return f"mapping to {_type(prop.get('additionalProperties', {}), defs)}"
    return str(kind)


def _rule(prop: dict[str, Any]) -> str:
    parts = []
    for p in [prop, *prop.get("anyOf", ()), prop.get("items", {}), prop.get("additionalProperties", {})]:
        if not isinstance(p, dict):
            continue
        lo = (">= " + _num(p["minimum"])) if "minimum" in p else ("> " + _num(p["exclusiveMinimum"])) \
            if "exclusiveMinimum" in p else ""
        hi = ("<= " + _num(p["maximum"])) if "maximum" in p else ""
        parts += [x for x in (lo, hi) if x]
        if "maxLength" in p:
            parts.append(f"at most {p['maxLength']} characters")
        if "maxItems" in p or "maxProperties" in p:
            parts.append(f"at most {p.get('maxItems', p.get('maxProperties'))} entries")
        if "pattern" in p:
            parts.append(f"matches `{p['pattern']}`")
    return ", ".join(parts)


def _num(v: float) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def _default(prop: dict[str, Any], required: bool) -> str:
    """``required`` only for the schema's required fields; one whose default is made per job (an empty list or
    mapping, a section of defaults) shows none."""
    if required:
        return "required"
    if "default" not in prop and prop.get("type") in ("array", "object"):
        return "`[]`" if prop["type"] == "array" else "`{}`"
    if "$ref" in prop or "default" not in prop:
        return ""
    return f"`{json.dumps(prop['default'])}`"


def _table(schema: dict[str, Any], defs: dict[str, Any]) -> list[str]:
    rows = ["| field | type | default | rule | what it is |", "| --- | --- | --- | --- | --- |"]
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        text = " ".join(str(prop.get("description", "")).split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {_type(prop, defs)} | {_default(prop, name in required)} | {_rule(prop)} | {text} |")
    return rows


def _ref(prop: dict[str, Any]) -> str | None:
    for p in [prop, *prop.get("anyOf", ())]:
        if "$ref" in p:
            return str(p["$ref"]).rsplit("/", 1)[1]
    return None


def reference() -> str:
    """The page (Markdown)."""
    schema = spec_model().model_json_schema()
    defs = schema.get("$defs", {})
    out = [HEAD, "## The job", "", *_table(schema, defs), ""]
    todo = [(name, _ref(prop)) for name, prop in schema["properties"].items() if _ref(prop)]
    while todo:
        path, ref = todo.pop(0)
        section = defs[ref]
        about = " ".join(str(section.get("description", "")).split())
        out += [f"## `{path}`", "", *([about, ""] if about else []), *_table(section, defs), ""]
        todo[:0] = [(f"{path}.{name}", _ref(prop)) for name, prop in section.get("properties", {}).items()
                    if _ref(prop)]
    return "\n".join(out)


def undescribed(model: Any = None) -> list[str]:
    """Fields of the job file (or of ``model``) without a description (the test wants none)."""
    schema = (model or spec_model()).model_json_schema()
    sections = [("", schema), *((name + ".", d) for name, d in schema.get("$defs", {}).items())]
    return [f"{where}{name}" for where, s in sections for name, prop in s.get("properties", {}).items()
            if not str(prop.get("description", "")).strip()]


if __name__ == "__main__":
    print(reference(), end="")
