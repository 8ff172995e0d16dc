"""Where a coordinator's ids become paths on this node, and the checks that come first.

The daemon never trusts an id to be a safe path component: job ids, job names (the
checkpoint root is named after the job), attempts and ranks are checked against the
shared rules (``contract.names``), and the resolved directory must still lie under the
state dir. A failed check raises ``Refused``; nothing is created.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rankctl.contract.names import job_id_problem, job_name_problem, shown


class Refused(ValueError):
    """An assignment this node will not run: one line saying why."""


def _index_problem(value: object, what: str) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return None
    return f"{what} {shown(value)} must be a non-negative integer"


def inside(root: Path, path: Path) -> Path:
    """``path`` resolved, if it lies under ``root`` (resolved too); ``Refused`` otherwise."""
    resolved, base = path.resolve(), root.resolve()
    if not resolved.is_relative_to(base):
        raise Refused(f"{shown(str(path))} resolves outside the state dir {base}")
    return resolved


def run_dir_for(state_dir: Path, job_id: object, attempt: object) -> Path:
    """``{state_dir}/jobs/{job_id}/{attempt}`` after checking both ids (not created here)."""
    problem = job_id_problem(job_id) or _index_problem(attempt, "attempt")
    if problem:
        raise Refused(problem)
    return inside(state_dir, state_dir / "jobs" / str(job_id) / str(attempt))


def check_assignment(a: Any, job_id: str, attempt: int) -> None:
    """One rank's assignment: it belongs to this Assign, its rank is an index, and its job
    name (the checkpoint directory's name) follows the job-name rule."""
    if a.job_id != job_id or a.attempt != attempt:
        raise Refused(f"rank assignment for {shown(a.job_id)} attempt {shown(a.attempt)} "
                      f"inside the Assign of {job_id} attempt {attempt}")
    problem = (_index_problem(a.rank, "rank") or _index_problem(a.world_size, "world size")
               or job_name_problem(a.spec.name, "job name (spec.name)"))
    if problem:
        raise Refused(problem)
    if a.rank >= a.world_size:
        raise Refused(f"rank {a.rank} is outside the world size {a.world_size}")
