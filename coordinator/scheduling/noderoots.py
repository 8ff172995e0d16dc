"""Whether the node directories a job writes under (``JobKind.written_paths``) lie under some node's roots.

Each daemon reports where its jobs may create files when it registers (``Register.data_roots``: its
``--data-root`` dirs and state dir, as given and real). A job whose written path lies, as written, under no
registered node of the general queue (unpooled, or of a worker pool) would only fail on every node at its start, so submit refuses it. Only
nodes that reported roots count (one that did not, an older daemon or one known from the store and not yet
back, cannot say). When it cannot be told the job is accepted and the node decides
(``worker.files.sandbox.written_problem``): no node has reported roots yet, or the job runs on an allocation's own
pool (its nodes register after the submit).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

from rankctl.contract.files import safepath
from rankctl.contract.names import shown
from rankctl.contract.spec import JobSpec
from rankctl.kinds import registry

SHOWN_ROOTS = 4   # roots quoted in a refusal


def roots_problems(spec: JobSpec, nodes: Iterable[Any], general: Callable[[str], bool]) -> list[str]:
    """Why ``spec`` writes outside the roots of every node of ``nodes`` (sessions: ``pool``, ``data_roots``)
    that serves the general queue (unpooled, or of a pool that ``general`` names: a worker pool), as a list of
    at most one line; [] when it does not or that cannot be told."""
    problem = roots_problem(spec, [s.data_roots for s in nodes if not s.pool or general(s.pool)])
    return [problem] if problem else []


def roots_problem(spec: JobSpec, node_roots: Iterable[tuple[str, ...]]) -> str | None:
    """Why ``spec`` writes outside every node's roots (``node_roots``: each general-pool node's reported
    roots, () when it reported none), or None (also when no node reported any)."""
    kind = registry.kinds().get(spec.kind)
    written = kind.resolve("written_paths") if kind else None
    paths = written(spec) if written else []
    if not paths:
        return None
    known = [roots for roots in node_roots if roots]
    if not known:
        return None
    every = sorted({r for roots in known for r in roots})
    for field, value, _path in paths:
        if not any(safepath.base_of(os.path.normpath(value), roots) for roots in known):
            return (f"{field}={shown(value, 200)} lies under no registered node's --data-root or state dir "
                    f"({len(known)} nodes; roots {', '.join(every[:SHOWN_ROOTS])}"
                    f"{', ...' if len(every) > SHOWN_ROOTS else ''}): a worker creates files only under its roots "
                    f"(ctl worker --data-root)")
    return None
