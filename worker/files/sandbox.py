"""Where a job may touch this node's files: only under the worker's roots.

The roots are the directories given with ``--data-root`` and the worker's state dir (the state dir alone when
none is given). Before its ranks start, every node path a job's spec names must resolve under a root
(``assignment_problem``): relative paths as the rank resolves them (against its working directory, the
launcher's, which it inherits from the daemon), then ``..`` and symlinks (``os.path.realpath``). A root that is
only a string prefix (``/data`` for ``/data2``) does not count. The answer never depends on whether the path
exists, so a refusal tells nothing about files outside the roots.

Node paths a spec names, per kind (``JobKind.node_paths``):
- ``train.data`` (``builtin:`` data names no file);
- ``python.workdir`` and a script ``python.entrypoint``. A workdir ``ctl`` shipped (``python.workdir_blob``) is
  fetched by content hash into the state dir: the spec's ``python.workdir`` then only says where ``ctl`` found
  it and is not a node path. A python job runs the user's code: this keeps the files the job names inside the
  roots; it does not confine what the code opens (that needs an OS sandbox).

Directories a rank creates, writes and deletes under (``JobKind.written_paths``: a train job's
``{train.checkpoint_dir}/{job name}``) must also be reachable through no symbolic link below a root, as written
(``written_problem``, ``contract.files.safepath``): the rank writes only through that library, so a link planted
later is refused there too; this check refuses the job before it starts.

Paths the node forms from ids (run dir, rank files, checkpoint, snapshot and replica roots) must be one entry in
their directory: ``derived_problem`` checks the ids with ``contract.names`` before any path is formed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from rankctl.contract.files import rankfiles

from rankctl.contract.files import safepath
from rankctl.contract.names import job_name_problem, shown
from rankctl.contract.spec import JobSpec
from rankctl.kinds import registry
from rankctl.worker.files.paths import Refused, _index_problem, run_dir_for
from rankctl.worker.replication.shardstore import AREAS, ShardStore

MAX_PATH = 4096  # characters of a path a job names (Linux's PATH_MAX)
SHOWN_PATH = 200  # characters of a refused path quoted back


def allowed_roots(data_roots: Sequence[str], state_dir: str) -> list[str]:
    """The state dir, then each ``--data-root``, as real paths (duplicates dropped). An empty root or a data root
    that is not a directory raises ``ValueError``: the worker must not start with it."""
    roots = []
    for root in (str(state_dir), *data_roots):
        if not root:
            raise ValueError("an empty --data-root (or state dir) would allow the worker's working directory")
        if root != str(state_dir) and not os.path.isdir(root):
            raise ValueError(f"--data-root {shown(root, SHOWN_PATH)} is not a directory")
        real = os.path.realpath(root)
        if real not in roots:
            roots.append(real)
    return roots


def write_roots(data_roots: Sequence[str], state_dir: str) -> list[str]:
    """Where ranks may create and delete (``contract.files.safepath``'s bases): each root of ``allowed_roots``, as
    given (absolute) and as its real path, so that a path written under either form is found."""
    out: list[str] = []
    for given, real in zip((str(state_dir), *data_roots), allowed_roots(data_roots, state_dir)):
        out += [p for p in (os.path.abspath(given), real) if p not in out]
    return out


def written_problem(spec: JobSpec, roots: Sequence[str]) -> str | None:
    """The first directory ``spec`` makes its ranks write under that is not under one of ``roots``
    (``write_roots``) as written, or passes through a symbolic link below it, as a one-line reason; or None."""
    kind = registry.kinds().get(spec.kind)
    written = kind.resolve("written_paths") if kind else None
    for field, value, path in written(spec) if written else []:
        base = safepath.base_of(os.path.normpath(path), roots)
        if base is None or os.path.normpath(path) != path.rstrip(os.sep):
            return (f"{field}: {_quoted(value)} is not under a root as written ({', '.join(roots)}): {safepath.RULE} "
                    f"(name it through no '..', '.' or link)")
        problem = safepath.problem(base, path)
        if problem:
            return f"{field}: {_quoted(value)}: {problem}"
    return None


def _under(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _quoted(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if text and len(text) <= SHOWN_PATH and text.isprintable() else shown(text, SHOWN_PATH)


def path_problem(field: str, value: str, roots: Sequence[str], *, path: str | None = None) -> str | None:
    """Why ``field``'s ``value`` may not be used on this node, or None when it resolves under one of ``roots``
    (real paths, from ``allowed_roots``). ``path``: what the rank opens when it differs from ``value`` (a
    relative value joined to its directory); the message quotes ``value``. Builtin data is not a path: see
    ``assignment_problem``."""
    path = value if path is None else path
    if not isinstance(value, str) or not isinstance(path, str) or not value:
        return f"{field}: {_quoted(value)} is not a path"
    if "\x00" in path or len(path) > MAX_PATH:
        return f"{field}: {_quoted(value)} is not a usable path (a NUL character, or over {MAX_PATH} characters)"
    real = os.path.realpath(path)
    if any(_under(real, root) for root in roots):
        return None
    return (f"{field}: {_quoted(value)} is outside the allowed roots ({', '.join(roots)}); a worker allows only "
            "paths under its --data-root directories and its state dir")


def assignment_problem(spec: JobSpec, roots: Sequence[str], *, workdir: str = "",
                       cwd: str | None = None) -> str | None:
    """The first node path ``spec`` (an assignment's typed spec) names that lies outside ``roots``, as a
    one-line reason, or None. ``workdir``: the daemon's copy of a shipped workdir (``RankAssignment.workdir``);
    ``cwd``: the ranks' working directory (default: this process's, which the launcher and its ranks inherit)."""
    kind = registry.kinds().get(spec.kind)
    node_paths = kind.resolve("node_paths") if kind else None
    if node_paths is None:
        return None
    for field, value, path in node_paths(spec, workdir, os.getcwd() if cwd is None else cwd):
        problem = path_problem(field, value, roots, path=path)
        if problem:
            return problem
    return None


def derived_problem(state_dir: str, job_id: object, attempt: object, job_name: object,
                    ranks: Iterable[object]) -> str | None:
    """Why the paths this node forms from an Assign's ids would not each be one entry in their directory, or
    None. The ids are checked first (``contract.names``, non-negative integers; ``worker.files.paths``), so no path is
    formed from a bad one; then every path is formed with the node's own builders and its parent compared."""
    ranks = list(ranks)
    problem = job_name_problem(job_name, "job name (spec.name)") or next(
        (p for r in ranks if (p := _index_problem(r, "rank"))), None)
    if problem:
        return problem
    try:
        run_dir = str(run_dir_for(Path(state_dir), job_id, attempt))  # checks the job id and the attempt first
    except Refused as exc:
        return str(exc)
    store, name = ShardStore(os.path.realpath(state_dir)), str(job_name)
    pairs = [(os.path.join(store.state_dir, "jobs", str(job_id)), run_dir),
             *((run_dir, f(run_dir, r)) for r in ranks
               for f in (rankfiles.status_path, rankfiles.log_path, rankfiles.control_path)),
             *((os.path.dirname(root), root) for area in AREAS
               for root in (store.own_root(name, area), store.replica_root(name, area)))]
    bad = next((path for parent, path in pairs if not _one_entry(parent, path)), None)
    return f"{shown(bad, SHOWN_PATH)} is not one entry in its directory" if bad else None


def _one_entry(parent: str, path: str) -> bool:
    name = os.path.basename(path)
    return (os.path.dirname(path) == os.path.normpath(parent) and name not in ("", ".", "..")
            and os.path.normpath(path) == path)
