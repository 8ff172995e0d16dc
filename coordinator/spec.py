"""The job file (YAML, version 1): schema, ``--set`` overrides and field-path errors.

Schema only: cross-field rules (layout, model shape, batch) live in ``coordinator.checks``.
Unknown fields are errors; integers are strict (YAML ``"2"`` is not 2).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class SpecError(ValueError):
    """A job file that cannot be accepted. ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("; ".join(errors))

    def __str__(self) -> str:
        if len(self.errors) == 1:
            return f"invalid job: {self.errors[0]}"
        return "invalid job:\n" + "\n".join(f"  - {e}" for e in self.errors)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Section):
    nodes: StrictInt = Field(1, ge=1)
    slots_per_node: StrictInt = Field(1, ge=1)


class ParallelSpec(_Section):
    tp: StrictInt = Field(1, ge=1)
    pp: StrictInt = Field(1, ge=1)
    cp: StrictInt = Field(1, ge=1)
    ep: StrictInt = Field(1, ge=1)
    etp: StrictInt | None = Field(None, ge=1)
    vpp: StrictInt | None = Field(None, ge=1)
    order: str = "tp-cp-ep-dp-pp"
    sequence_parallel: StrictBool = False
    schedule: Literal["gpipe", "1f1b"] = "1f1b"


class MoeSpec(_Section):
    experts: StrictInt = Field(ge=1)
    top_k: StrictInt = Field(2, ge=1)
    every: StrictInt = Field(1, ge=1)
    aux_loss: float = Field(0.01, ge=0)
    capacity_factor: float | None = Field(None, gt=0)


class ModelSpec(_Section):
    layers: StrictInt = Field(4, ge=1)
    hidden: StrictInt = Field(128, ge=1)
    heads: StrictInt = Field(4, ge=1)
    ffn_hidden: StrictInt | None = Field(None, ge=1)
    seq_len: StrictInt = Field(128, ge=1)
    vocab: StrictInt = Field(256, ge=1)
    position_embedding: Literal["learned", "rope"] = "learned"
    tie_embeddings: StrictBool = True
    moe: MoeSpec | None = None


class TrainSpec(_Section):
    steps: StrictInt = Field(20, ge=1)
    global_batch: StrictInt = Field(16, ge=1)
    micro_batch: StrictInt = Field(2, ge=1)
    lr: float = Field(3.0e-4, gt=0)
    warmup: StrictInt = Field(2, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    seed: StrictInt = 1234
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    data: str = "builtin:pydoc"
    eval_every: StrictInt = Field(0, ge=0)
    checkpoint_every: StrictInt = Field(0, ge=0)
    resume: StrictBool = False


class CommCheckSpec(_Section):
    size_bytes: StrictInt = Field(1 << 20, ge=4, le=1 << 30)
    iters: StrictInt = Field(5, ge=1, le=10_000)
    warmup: StrictInt = Field(2, ge=0, le=1_000)
    duration: float = Field(0.0, ge=0, le=7 * 24 * 3600)  # soak: repeat the check this many seconds


class RestartSpec(_Section):
    max_restarts: StrictInt = Field(0, ge=0)


class JobSpec(_Section):
    name: str
    kind: Literal["train", "comm-check"] = "train"
    resources: Resources = Resources()
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    parallel: ParallelSpec = ParallelSpec()
    model: ModelSpec | None = None
    train: TrainSpec | None = None
    comm_check: CommCheckSpec | None = None
    restart: RestartSpec = RestartSpec()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("must be 1-63 characters of a-z, 0-9 and '-', starting and ending with a letter or digit")
        return v

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.resources.slots_per_node

    def with_defaults(self) -> "JobSpec":
        """Fill the sections a job kind needs, so that stored specs are explicit."""
        if self.kind == "train":
            return self.model_copy(update={"model": self.model or ModelSpec(), "train": self.train or TrainSpec()})
        return self.model_copy(update={"comm_check": self.comm_check or CommCheckSpec()})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


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
    if kind in ("string_type",):
        return "must be a string"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a mapping"
    return msg.removeprefix("Value error, ")


def spec_errors(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        value = err.get("input")
        shown = "" if err["type"] in ("missing",) else f" (got {value!r})"
        if isinstance(value, dict) and err["type"] != "extra_forbidden":
            shown = ""
        out.append(f"{_path(err['loc'])}{shown}: {_rule(err)}")
    return out


# -- loading ------------------------------------------------------------------

def parse_override(item: str) -> tuple[list[str], Any]:
    """``parallel.tp=4`` -> (["parallel", "tp"], 4); the value is read as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise SpecError([f"--set {item!r}: expected KEY.PATH=VALUE, e.g. parallel.tp=2"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return [p for p in key.strip().split(".")], value


def apply_overrides(doc: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = doc
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise SpecError([f"--set {item!r}: {'.'.join(path[: i + 1])} is not a mapping"])
            node = child
        node[path[-1]] = value
    return doc


def load_yaml_text(text: str, source: str = "job file") -> dict[str, Any]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError([f"{source}: not valid YAML{where}: {problem}"]) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise SpecError([f"{source}: must be a mapping of fields, got {type(doc).__name__}"])
    return doc


def build_spec(doc: dict[str, Any], overrides: list[str] = ()) -> JobSpec:
    doc = apply_overrides(copy.deepcopy(doc), list(overrides))
    try:
        return JobSpec.model_validate(doc).with_defaults()
    except ValidationError as exc:
        raise SpecError(spec_errors(exc)) from None


def load_spec(path: str | Path, overrides: list[str] = ()) -> JobSpec:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([f"{path}: cannot read the job file ({exc.strerror})"]) from None
    return build_spec(load_yaml_text(text, str(path)), overrides)
