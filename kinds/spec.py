"""The typed job spec: ``contract.spec``'s common sections plus every registered kind's.

A job file is parsed and checked once at submit (``build_spec`` + ``check_job``, by ``ctl``
locally and by the coordinator). Everything downstream gets the stored canonical dict back as
a typed ``JobSpec`` with ``parse_spec`` (``model_validate``; no re-check). Pure: no torch.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import Field, ValidationError, create_model, field_validator

from rankctl.contract.jobfile import (
    SpecError, apply_overrides, parse_override, spec_errors,
)
from rankctl.contract.spec import JobSpec
from rankctl.kinds import registry
from rankctl.parallel.layout import LayoutError, ParallelConfig

_models: dict[int, type[JobSpec]] = {}


def _check_kind(cls: type, v: str) -> str:
    if v not in registry.kinds():
        raise ValueError(registry.unknown_kind(v))
    return v


def spec_model() -> type[JobSpec]:
    """``JobFile``: ``JobSpec`` (its only base) with every registered kind's sections as optional fields, rebuilt
    when kinds change; every spec in a process is an instance of it."""
    version = registry.version()
    model = _models.get(version)
    if model is None:
        sections = {name: (cls | None, Field(None, description=_first_paragraph(cls.__doc__) or f"The {kind.name} "
                                                                                              "kind's section."))
                    for kind in registry.kinds().values() for name, cls in kind.sections.items()}
        model = create_model("JobFile", __base__=JobSpec, __module__=__name__,
                             __validators__={"_kind": field_validator("kind")(classmethod(_check_kind))},
                             **sections)
        _models.clear()
        _models[version] = model
    return model


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def with_defaults(spec: JobSpec) -> JobSpec:
    """Fill the sections the job's kind needs, so that stored specs are explicit."""
    kind = registry.get(spec.kind)
    return spec.model_copy(update={name: getattr(spec, name, None) or cls() for name, cls in kind.sections.items()})


def parse_spec(doc: dict[str, Any]) -> JobSpec:
    """A stored canonical spec (``JobSpec.to_dict()``) back as the typed spec."""
    try:
        return with_defaults(spec_model().model_validate(doc))
    except ValidationError as exc:
        raise SpecError(spec_errors(exc, spec_model())) from None


def stored_spec(doc: dict[str, Any], name: str, kind: str) -> JobSpec:
    """A spec read back from a store row (``name``/``kind``: the row's columns): ``parse_spec``, or, for a job
    whose kind this process no longer knows (a plug-in removed), its common sections alone, so the job stays
    readable (its placement then fails naming the kind)."""
    doc = {"name": name, "kind": kind, **doc}
    try:
        return parse_spec(doc)
    except SpecError:
        common = {k: v for k, v in doc.items() if k in JobSpec.model_fields}
        try:
            return JobSpec.model_validate(common)
        except ValidationError:
            return JobSpec.model_construct(name=name, kind=kind)


def build_spec(doc: dict[str, Any], overrides: list[str] = ()) -> JobSpec:
    """Validate a job document after applying ``--set`` overrides (schema only; see ``check_job``). A section of
    another kind (``train:`` in a comm-check job) is refused: it would be stored and never read."""
    full = apply_overrides(copy.deepcopy(doc), list(overrides))
    spec = parse_spec(full)
    own = registry.get(spec.kind).sections
    stray = [name for name in full if name not in own and name not in JobSpec.model_fields]
    if stray:
        raise SpecError([f"{name}: a section of kind {_owner(name)}, not of kind {spec.kind} (whose sections are "
                         f"{', '.join(own) or 'none'} and the common ones)" for name in stray])
    return spec


def _owner(section: str) -> str:
    return " or ".join(n for n, k in registry.kinds().items() if section in k.sections) or "no kind"


def with_overrides(spec: JobSpec, overrides: list[str]) -> JobSpec:
    """``spec`` with ``key=value`` overrides that a kind's own hook derived from its valid fields (e.g. a path
    made absolute): set on the typed spec, not validated again."""
    for item in overrides:
        path, value = parse_override(item)
        spec = _replaced(spec, path, value)
    return spec


def _replaced(model: Any, path: list[str], value: Any) -> Any:
    inner = value if len(path) == 1 else _replaced(getattr(model, path[0]), path[1:], value)
    return model.model_copy(update={path[0]: inner})


def parallel_config(spec: JobSpec) -> ParallelConfig:
    p = spec.parallel
    try:
        return ParallelConfig(
            world_size=spec.world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp, order=p.order
        )
    except LayoutError as exc:
        raise SpecError([f"parallel: {exc} (world_size = resources.nodes*resources.slots_per_node)"]) from None


def check_job(spec: JobSpec) -> ParallelConfig:
    """Validate everything that crosses sections (layout, then the kind's rules); the layout config. An
    elastic job (``resources.min_nodes``) is checked at every world size it may run at, each problem naming it."""
    cfg = parallel_config(spec)
    check = registry.get(spec.kind).resolve("check")
    errors = check(spec, cfg) if check else []
    if errors:
        raise SpecError(errors)
    res = spec.resources
    for nodes in range(res.nodes - 1, res.fewest_nodes - 1, -1):
        smaller = spec.on_nodes(nodes)
        try:
            small_cfg = parallel_config(smaller)
            problems = check(smaller, small_cfg) if check else []
        except SpecError as exc:
            problems = exc.errors
        if problems:
            raise SpecError([f"resources.min_nodes={res.min_nodes}: on {nodes} node(s) ({smaller.world_size} "
                             f"ranks) the job cannot run: {p}" for p in problems])
    return cfg
