"""Reading a job file: bounded YAML, ``--set`` overrides, and one line per problem.

The YAML itself is bounded (its size, nesting depth, aliases and node count after alias
expansion are checked before it is built). The schema is ``contract.spec`` plus each kind's
sections; ``kinds.spec.build_spec`` validates a document against it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rankctl.contract import limits as L
from rankctl.contract.names import brief, did_you_mean

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: fast and iterative


class SpecError(ValueError):
    """A job file that cannot be accepted. ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("; ".join(errors))

    def __str__(self) -> str:
        if len(self.errors) == 1:
            return f"invalid job: {self.errors[0]}"
        return "invalid job:\n" + "\n".join(f"  - {e}" for e in self.errors)


# -- errors -------------------------------------------------------------------

def _path(loc: tuple) -> str:
    parts = [str(p) for p in loc if not str(p).startswith("function-")]
    return ".".join(parts) or "(root)"


def _rule(err: dict) -> str:
    kind, msg, ctx = err["type"], err["msg"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "must be an integer"
    if kind in ("bool_type", "bool_parsing"):
        return "must be true or false"
    if kind in ("float_type", "float_parsing"):
        return "must be a number"
    if kind == "finite_number":
        return "must be a finite number"
    bound = {"less_than_equal": ("le", "at most"), "greater_than_equal": ("ge", "at least"),
             "greater_than": ("gt", "greater than"), "less_than": ("lt", "less than")}.get(kind)
    if bound and bound[0] in ctx:
        return f"must be {bound[1]} {ctx[bound[0]]}"
    if kind in ("string_type",):
        return "must be a string"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a mapping"
    return msg.removeprefix("Value error, ")


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """The field names of the section at ``loc`` under the pydantic ``model`` ([] when it is no model)."""
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if isinstance(part, int) or fields is None or part not in fields:
            return []
        model = _model_of(fields[part].annotation)
    return list(getattr(model, "model_fields", None) or ())


def _model_of(annotation: Any) -> Any:
    """The model class in an annotation (``Section | None`` -> ``Section``), else the annotation."""
    if hasattr(annotation, "model_fields"):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if hasattr(arg, "model_fields"):
            return arg
    return annotation


def spec_errors(exc: ValidationError, model: Any = None) -> list[str]:
    """One line per problem; a bad value is quoted by a short prefix only (never ``repr``'d whole). With the
    ``model`` validated against, an unknown field names the closest known one at its place (``paralel``)."""
    out, errors = [], exc.errors(include_url=False)
    for err in errors[:L.MAX_ERRORS_SHOWN]:
        value = err.get("input")
        shown = "" if err["type"] in ("missing",) else f" (got {brief(value)})"
        if isinstance(value, dict) and err["type"] != "extra_forbidden":
            shown = ""
        hint = ""
        if err["type"] == "extra_forbidden" and model is not None and err["loc"]:
            hint = did_you_mean(str(err["loc"][-1]), _fields_at(model, tuple(err["loc"][:-1])))
        out.append(f"{_path(err['loc'])}{shown}: {_rule(err)}{hint}")
    if len(errors) > L.MAX_ERRORS_SHOWN:
        out.append(f"... and {len(errors) - L.MAX_ERRORS_SHOWN} more problems")
    return out


# -- reading and bounded YAML -------------------------------------------------

def _too_big(source: str, size: int | str) -> SpecError:
    return SpecError([f"{source}: job file is {size} bytes; the limit is {L.MAX_JOB_FILE_BYTES}"])


def read_job_text(path: str | Path) -> str:
    """A job file's text: size-capped before it is read whole, UTF-8 (errors name the byte offset)."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > L.MAX_JOB_FILE_BYTES:
                raise _too_big(str(path), size)
            data = fh.read(L.MAX_JOB_FILE_BYTES + 1)  # a file that grows, or /dev/zero, stops here
    except OSError as exc:
        raise SpecError([f"{path}: cannot read the job file ({exc.strerror or exc})"]) from None
    if len(data) > L.MAX_JOB_FILE_BYTES:
        raise _too_big(str(path), f"more than {L.MAX_JOB_FILE_BYTES}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecError([f"{path}: not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset {exc.start} "
                         f"(line {line}) {exc.reason}"]) from None


class _Shape:
    """Expanded node count, nesting depth and aliases of a YAML stream, from its events alone.

    The event parser is iterative and builds nothing, so a hostile document (an alias bomb,
    10,000 nested brackets) is refused after a bounded walk, before any object exists. The
    expanded size of each anchor is remembered, so shared nodes are counted without walking them.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.frames: list[list] = [[0, None]]  # [expanded nodes so far, anchor] per open collection
        self.anchored: dict[str, int] = {}
        self.aliases = 0

    def _refuse(self, problem: str, event: yaml.Event) -> SpecError:
        mark = event.start_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return SpecError([f"{self.source}: refused YAML{where}: {problem}"])

    def _add(self, count: int, anchor: str | None, event: yaml.Event) -> None:
        if anchor is not None:
            self.anchored[anchor] = count
        frame = self.frames[-1]
        frame[0] += count
        if frame[0] > L.MAX_YAML_NODES:
            raise self._refuse(f"more than {L.MAX_YAML_NODES} values (an alias counts the values it repeats)", event)

    def feed(self, event: yaml.Event) -> None:
        if isinstance(event, yaml.CollectionStartEvent):
            if len(self.frames) > L.MAX_YAML_DEPTH:
                raise self._refuse(f"nested deeper than the limit of {L.MAX_YAML_DEPTH} levels", event)
            self.frames.append([1, event.anchor])
        elif isinstance(event, yaml.CollectionEndEvent):
            count, anchor = self.frames.pop()
            self._add(count, anchor, event)
        elif isinstance(event, yaml.ScalarEvent):
            self._add(1, event.anchor, event)
        elif isinstance(event, yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > L.MAX_YAML_ALIASES:
                raise self._refuse(f"more than {L.MAX_YAML_ALIASES} aliases", event)
            self._add(self.anchored.get(event.anchor, 1), None, event)


class _DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping (YAML's loaders keep the last silently)."""


class _StrictLoader(_Loader):
    """The safe loader, refusing a key that appears twice in one mapping, at any depth."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, str] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # a collection key is refused as unhashable; merged keys are YAML's defaults
            key, mark = self.construct_object(key_node), key_node.start_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}"
            if key in first:
                raise _DuplicateKey(f"{brief(key)}: duplicate key ({where}; first at {first[key]}); "
                                    f"a key may appear once in a mapping")
            first[key] = where
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's exponent floats (1e3, 3e-4, 1.0e3): YAML 1.1 reads them as strings, which strict number fields refuse
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


class _NotYaml(SpecError):
    """Text that does not parse as YAML (``--set`` then takes it as a plain string)."""


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _yaml_error(exc: Exception, source: str) -> SpecError:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    if "maximum nesting depth" in problem:  # libyaml's own limit (1000) can fire before ours
        return SpecError([f"{source}: refused YAML{where}: nested deeper than the limit of {L.MAX_YAML_DEPTH} levels"])
    return _NotYaml([f"{source}: not valid YAML{where}: {_clip(problem)}"])


def bounded_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load`` of ``text`` after checking its size, depth, aliases and expanded size; a key given twice
    in one mapping (at any depth) is refused, not overwritten."""
    source = _clip(source, 256)  # a client names the source; keep the echo short
    if len(text) > L.MAX_JOB_FILE_BYTES or len(text.encode("utf-8", "surrogatepass")) > L.MAX_JOB_FILE_BYTES:
        raise _too_big(source, len(text.encode("utf-8", "surrogatepass")))
    try:
        shape = _Shape(source)
        for event in yaml.parse(text, Loader=_Loader):
            shape.feed(event)
        return yaml.load(text, Loader=_StrictLoader)
    except _DuplicateKey as exc:
        raise SpecError([f"{source}: {exc}"]) from None
    except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: e.g. an int of 5,000 digits
        if isinstance(exc, SpecError):
            raise
        raise _yaml_error(exc, source) from None


# -- loading ------------------------------------------------------------------

def parse_override(item: str) -> tuple[list[str], Any]:
    """``parallel.tp=4`` -> (["parallel", "tp"], 4); the value is read as (bounded) YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise SpecError([f"--set {brief(item)}: expected KEY.PATH=VALUE, e.g. parallel.tp=2"])
    path = key.strip().split(".")
    if len(path) > L.MAX_YAML_DEPTH:
        raise SpecError([f"--set {brief(item)}: nested deeper than the limit of {L.MAX_YAML_DEPTH} levels"])
    try:
        value = bounded_yaml(raw, f"--set {brief(key)}") if raw.strip() else None
    except _NotYaml:
        value = raw
    return path, value


def literal_override(key: str, value: str) -> str:
    """The override that sets ``key`` to the string ``value`` as it is (a path): a YAML double-quoted scalar, so
    that nothing in it (`` #``, ``: ``, a trailing ``:``, a leading ``&``) is read as YAML."""
    return f"{key}={json.dumps(str(value), ensure_ascii=False)}"


def apply_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    total = sum(len(item) for item in overrides)
    if total > L.MAX_JOB_FILE_BYTES:
        raise SpecError([f"--set: {total} characters of overrides; the limit is {L.MAX_JOB_FILE_BYTES}"])
    for item in overrides:
        path, value = parse_override(item)
        node = doc
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError([f"--set {brief(item)}: {_clip('.'.join(path[: i + 1]))} is not a mapping"])
            node = child
        node[path[-1]] = value
    return doc


def load_yaml_text(text: str, source: str = "job file") -> dict[str, Any]:
    """The mapping a job file holds; size, depth, aliases and expanded size are bounded first."""
    doc = bounded_yaml(text, source)
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise SpecError([f"{source}: must be a mapping of fields, got {type(doc).__name__}"])
    return doc
