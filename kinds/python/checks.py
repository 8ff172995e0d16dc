"""The ``python`` kind's rules (pure), ``ctl``'s override making a relative workdir absolute, the blob a
shipped workdir references, and the node paths a rank uses (``node_paths``, for the worker's sandbox)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from rankctl.contract.jobfile import SpecError, literal_override
from rankctl.contract.names import shown
from rankctl.contract.spec import JobSpec
from rankctl.kinds.python.spec import PythonSpec
from rankctl.kinds.registry import Shipment

CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
FUNCTION_RE = re.compile(MODULE_RE.pattern + r":[A-Za-z_][A-Za-z0-9_]*")


def is_function(entrypoint: str) -> bool:
    """``package.module:function`` (imported and called) rather than a script path (run as ``__main__``)."""
    return FUNCTION_RE.fullmatch(entrypoint) is not None


def _module_errors(module: str, entry: str) -> list[str]:
    if entry:
        return [f"python.module {shown(module)} and python.entrypoint {shown(entry)}: give one of them, not both"]
    if not MODULE_RE.fullmatch(module):
        return [f"python.module {shown(module)} is not a dotted module name (package.module, as python -m takes)"]
    return []


def errors(spec: JobSpec, cfg) -> list[str]:  # noqa: ANN001 - ParallelConfig, unused
    entry, module = spec.python.entrypoint, spec.python.module
    if module:
        return _module_errors(module, entry) or _control_errors(spec.python, entry)
    if not entry.strip():
        return ["python.entrypoint is required: a script (train.py) or a function (package.module:function); "
                "or python.module (python -m)"]
    if "\x00" in entry or (":" in entry and not is_function(entry) and not entry.endswith(".py")):
        return [f"python.entrypoint {shown(entry)} is neither a script path (ending in .py) "
                "nor package.module:function"]
    return _control_errors(spec.python, entry)


def _control_errors(cfg: PythonSpec, entry: str) -> list[str]:
    paths = [(f, t) for f, t in (("python.entrypoint", entry), ("python.workdir", cfg.workdir or ""))
             if CONTROL_RE.search(t)]
    envs = [(f"python.env {shown(k, 40)}", v) for k, v in cfg.env.items() if "\x00" in k + str(v)]
    return [f"{field} {shown(text)} holds a control character; a path may not" for field, text in paths] \
        + [f"{field} = {shown(text)} holds a NUL character, which no process environment can carry"
           for field, text in envs]


def absolute_workdir(spec: JobSpec, job_dir: Path) -> list[str]:
    """``ctl``'s overrides: a relative ``python.workdir`` made absolute against the job file's directory
    (``job_dir``); a relative script with no workdir gets that directory as its workdir."""
    cfg = spec.python
    if cfg is None or CONTROL_RE.search(cfg.workdir or ""):
        return []   # refused by ``errors`` (the check that follows)
    if cfg.workdir is not None:
        if Path(cfg.workdir).is_absolute():
            return []
        try:
            return [literal_override("python.workdir", (job_dir / cfg.workdir).resolve())]
        except (OSError, RuntimeError) as exc:   # a loop of links, a name too long
            raise SpecError([f"python.workdir {shown(cfg.workdir)} cannot be resolved here: {shown(str(exc))}"]) \
                from None
    if cfg.module or is_function(cfg.entrypoint) or Path(cfg.entrypoint).is_absolute():
        return []   # a module or a function is imported (the worker's own directory, when no workdir is shipped)
    return [literal_override("python.workdir", job_dir)]


def shipment(spec: JobSpec) -> Shipment | None:
    """``python.workdir`` is packed and shipped by ``ctl`` unless it already names a blob."""
    cfg: PythonSpec | None = getattr(spec, "python", None)
    if cfg is None or not cfg.workdir or cfg.workdir_blob:
        return None
    entry = cfg.entrypoint
    script = bool(entry) and not is_function(entry) and not os.path.isabs(entry) and not entry.startswith("~")
    return Shipment(directory=cfg.workdir, max_mb=cfg.workdir_max_mb, field="python.workdir_blob",
                    source="python.workdir", cap="python.workdir_max_mb",
                    inside=("python.entrypoint", entry) if script else None)


def blobs(spec: JobSpec) -> list[str]:
    """``JobKind.blobs``: the packed workdir ``ctl`` uploaded (``python.workdir_blob``), if any."""
    cfg: PythonSpec | None = getattr(spec, "python", None)
    return [cfg.workdir_blob] if cfg is not None and cfg.workdir_blob else []


def unpacked_limit(spec: JobSpec) -> int:
    """``JobKind.blob_limit``: the bytes a node may extract of the spec's workdir blob."""
    cfg: PythonSpec = getattr(spec, "python", None) or PythonSpec()
    return cfg.unpacked_limit_mb() << 20


def node_paths(spec: JobSpec, workdir: str, cwd: str) -> list[tuple[str, Any, Any]]:
    """``(field, value, path)`` of each node path a python rank uses, resolved as ``run.run`` resolves them:
    the workdir (the daemon's copy of a shipped one, ``workdir``, else ``python.workdir``) relative to the
    rank's working directory ``cwd``, and a script entry point relative to the workdir. A function entry
    point (``package.module:function``) names no file.
    """
    cfg: PythonSpec = getattr(spec, "python", None) or PythonSpec()
    wd, entry = workdir or cfg.workdir or "", cfg.entrypoint or ""
    out = [("python.workdir", wd, os.path.join(cwd, wd))] if wd else []
    if entry and not is_function(entry):
        out.append(("python.entrypoint", entry, script_path(entry, wd, cwd, dict(cfg.env))))
    return out


def script_path(entrypoint: str, workdir: str, cwd: str, env: dict[str, Any]) -> str:
    """The script a rank runs, as ``run._script_path`` finds it: after ``chdir(workdir)``, ``workdir/entrypoint``
    (so a relative workdir counts twice), ``~`` expanded with the job's ``env`` HOME when it sets one."""
    home = env.get("HOME")
    if isinstance(home, str) and (entrypoint == "~" or entrypoint.startswith("~/")):
        entrypoint = home + entrypoint[1:]
    return os.path.join(cwd, workdir, workdir, os.path.expanduser(entrypoint))
