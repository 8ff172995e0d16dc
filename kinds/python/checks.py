"""The ``python`` kind's rules (pure), ``ctl``'s override making a relative workdir absolute, and the
blob a shipped workdir references."""

from __future__ import annotations

import re
from pathlib import Path

from rankctl.contract.names import shown
from rankctl.contract.spec import JobSpec

FUNCTION_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


def is_function(entrypoint: str) -> bool:
    """``package.module:function`` (imported and called) rather than a script path (run as ``__main__``)."""
    return FUNCTION_RE.fullmatch(entrypoint) is not None


def errors(spec: JobSpec, cfg) -> list[str]:  # noqa: ANN001 - ParallelConfig, unused
    entry = spec.python.entrypoint
    if not entry.strip():
        return ["python.entrypoint is required: a script (train.py) or a function (package.module:function)"]
    if "\x00" in entry or (":" in entry and not is_function(entry) and not entry.endswith(".py")):
        return [f"python.entrypoint {shown(entry)} is neither a script path (ending in .py) "
                "nor package.module:function"]
    return []


def absolute_workdir(spec: JobSpec, job_dir: Path) -> list[str]:
    """``ctl``'s overrides: a relative ``python.workdir`` made absolute against the job file's directory
    (``job_dir``); a relative script with no workdir gets that directory as its workdir."""
    cfg = spec.python
    if cfg is None:
        return []
    if cfg.workdir is not None:
        return [] if Path(cfg.workdir).is_absolute() else [f"python.workdir={(job_dir / cfg.workdir).resolve()}"]
    if is_function(cfg.entrypoint) or Path(cfg.entrypoint).is_absolute():
        return []
    return [f"python.workdir={job_dir}"]


def blobs(spec: dict) -> list[str]:
    """``JobKind.blobs``: the packed workdir ``ctl`` uploaded (``python.workdir_blob``), if any."""
    digest = (spec.get("python") or {}).get("workdir_blob")
    return [digest] if digest else []
