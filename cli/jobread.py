"""Reading a job file in ``ctl``: one function for ``submit``, ``up`` and ``plan``, so they cannot disagree.

The file is parsed and validated once (``kinds.spec.build_spec``: schema, defaults); the kind's own overrides
(``JobKind.client_overrides``: e.g. an absolute ``train.data``) are applied to that typed spec, and the
cross-field check (``check_job``: layout, then the kind's rules) runs once on the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rankctl.cli.errors import CtlError

if TYPE_CHECKING:
    from rankctl.contract.spec import JobSpec
    from rankctl.parallel.layout import ParallelConfig


@dataclass(frozen=True)
class JobFile:
    text: str                  # the file as read (what the coordinator validates again, in its own process)
    sets: list[str]            # the user's --set overrides, then the kind's
    spec: "JobSpec"            # typed, with every override applied
    layout: "ParallelConfig"   # what check_job found the layout to be


def read_job_file(path: str, overrides: tuple[str, ...] | list[str]) -> JobFile:
    """Read, validate and check ``path`` once; CtlError (exit 2) naming the field, value and rule."""
    from rankctl.contract.jobfile import SpecError, read_job_text

    try:
        text = read_job_text(path)
    except SpecError as exc:
        raise CtlError(str(exc)) from None
    return read_job_doc(text, path, Path(path).resolve().parent, overrides)


def read_job_doc(text: str, source: str, job_dir: Path, overrides: tuple[str, ...] | list[str]) -> JobFile:
    """A job file's ``text`` (named ``source`` in errors; relative paths against ``job_dir``), validated and
    checked as ``read_job_file`` does."""
    from rankctl.contract.jobfile import SpecError, load_yaml_text
    from rankctl.kinds import registry
    from rankctl.kinds.spec import build_spec, check_job, with_overrides

    sets = list(overrides)
    try:
        spec = build_spec(load_yaml_text(text, source), sets)
        hook = registry.get(spec.kind).resolve("client_overrides")
        extra = hook(spec, job_dir) if hook else []
        spec = with_overrides(spec, extra)
        layout = check_job(spec)
    except SpecError as exc:
        raise CtlError(str(exc)) from None
    return JobFile(text, sets + extra, spec, layout)
