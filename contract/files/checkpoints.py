"""Where a train job's sharded checkpoints and in-memory snapshots lie on a node (the rank writes,
the daemon replicates).

::

    {state}/checkpoints/{job name}/step-{s:08d}/rank-{r:05d}.pt     one rank's shard of step s
    {state}/checkpoints/{job name}/step-{s:08d}/rank-{r:05d}.done   its done-marker (JSON), written after

Snapshots (``train.snapshot_every``) have the same layout and content under a root in the node's
memory (tmpfs), so that they outlive the rank process but cost no disk write::

    /dev/shm/rankctl-{hash of the state dir}/snapshots/{job name}/step-.../rank-...     this node's ranks
    /dev/shm/rankctl-{hash of the state dir}/snapshot-replicas/{job name}/...         copies kept for a peer

(``{state}/snapshots/...`` and ``{state}/snapshot-replicas/...`` when /dev/shm is missing, not
writable, or its ``rankctl-*`` directory is not this user's). Each root keeps the newest
``KEEP_STEPS`` marked steps per rank (``prune``). Both roots together stay under the worker's
``--snapshot-memory-mb`` (``worker.files.snapmem``: a tmpfs of that size mounted at ``memory_base``).

Pure paths and directory listing only: the rank side (``kinds.train.checkpoint``) writes and reads
the files, the daemon side (``worker.replication.replicas``) copies complete ones to a peer node and back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from typing import Any

from rankctl.contract.files import safepath

STEP_RE = re.compile(r"^step-(\d{8})$")
RANK_FILE_RE = re.compile(r"^rank-(\d{5})\.")
SHM = "/dev/shm"      # the node's memory-backed filesystem (tests point it elsewhere)
KEEP_STEPS = 2        # marked steps kept per rank in a snapshot root and in a replica root


def root_in(state_dir: str, job_name: str) -> str:
    """``{state}/checkpoints/{job name}`` (the name is checked by whoever takes it from a spec)."""
    return os.path.join(state_dir, "checkpoints", job_name)


def memory_base(state_dir: str) -> str:
    """``/dev/shm/rankctl-{hash}``, this node's directory in memory (one per state dir, so daemons
    sharing a machine do not mix), or ``state_dir`` itself when that cannot be used."""
    state = os.path.realpath(state_dir)
    digest = hashlib.sha1(state.encode(), usedforsecurity=False).hexdigest()[:12]
    base = os.path.join(SHM, f"rankctl-{digest}")
    try:
        st = os.lstat(base)
    except FileNotFoundError:
        return base if os.path.isdir(SHM) and os.access(SHM, os.W_OK | os.X_OK) else state
    except OSError:
        return state
    mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()  # never a link or another user's
    return base if mine and os.access(base, os.W_OK | os.X_OK) else state


def snapshot_root(state_dir: str, job_name: str) -> str:
    """Where this node's ranks keep their snapshots of ``job_name`` (see the module doc)."""
    return os.path.join(memory_base(state_dir), "snapshots", job_name)


def snapshot_replica_root(state_dir: str, job_name: str) -> str:
    """Where this node keeps the snapshots its peers push for ``job_name``."""
    return os.path.join(memory_base(state_dir), "snapshot-replicas", job_name)


def state_dir_of(run_dir: str) -> str:
    """``{state}`` for a rank's ``run_dir = {state}/jobs/{job_id}/{attempt}``."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(run_dir))))


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def rank_file(root: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(root, step), f"rank-{rank:05d}.pt")


def marker_file(root: str, step: int, rank: int) -> str:
    return os.path.join(step_dir(root, step), f"rank-{rank:05d}.done")


def list_steps(root: str) -> list[int]:
    """Every step that has a directory, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := STEP_RE.match(n)))


def read_marker(root: str, step: int, rank: int) -> dict[str, Any] | None:
    try:
        with open(marker_file(root, step, rank), encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


HASH_CHUNK = 1 << 22   # bytes read at a time when a shard's checksum is verified


def damage(root: str, step: int, rank: int) -> str:
    """Why ``rank``'s shard of ``step`` under ``root`` cannot be trusted ("" when it can): its size or SHA-256
    differ from what its marker recorded when it was written (a torn, truncated or overwritten file), or
    it is missing. A marker written before checksums were kept (no ``sha256``) is trusted as it is."""
    marker = read_marker(root, step, rank) or {}
    want, size = marker.get("sha256"), marker.get("bytes")
    path = rank_file(root, step, rank)
    try:
        have = os.path.getsize(path)
        if not want:
            return ""
        if isinstance(size, int) and have != size:
            return f"{path} holds {have} bytes, its marker says {size}"
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    return "" if digest.hexdigest() == want else f"{path} does not match the SHA-256 its marker recorded"


def complete_for(root: str, ranks: list[int] | range, fp: str | None = None) -> list[int]:
    """Steps for which every rank in ``ranks`` has a marker (matching ``fp`` if given)."""
    out = []
    for step in list_steps(root):
        markers = [read_marker(root, step, r) for r in ranks]
        if all(m is not None and (fp is None or m.get("fingerprint") == fp) for m in markers):
            out.append(step)
    return out


def ranks_in(root: str) -> set[int]:
    """Every rank that has a file in some step of ``root``."""
    out: set[int] = set()
    for step in list_steps(root):
        try:
            out.update(int(m.group(1)) for n in os.listdir(step_dir(root, step)) if (m := RANK_FILE_RE.match(n)))
        except FileNotFoundError:
            pass
    return out


def remove_rank_step(root: str, step: int, rank: int, *, base: str | None = None) -> None:
    """Delete ``rank``'s files of ``step`` (its marker first, so the step never looks complete while
    going), then the step's directory if that left it empty. Through no link below ``base`` (``root``
    when None: ``contract.files.safepath``)."""
    base, d = root if base is None else base, step_dir(root, step)
    names = sorted(safepath.listdir(base, d), key=lambda n: not n.endswith(".done"))
    prefix = f"rank-{rank:05d}."
    for name in names:
        if name.startswith(prefix):
            safepath.unlink(base, os.path.join(d, name))
    safepath.rmdir(base, d)  # only when empty: other ranks' files may be there (or a writer about to)


def prune(root: str, ranks: list[int] | set[int] | None = None, keep: int = KEEP_STEPS, *,
          base: str | None = None) -> None:
    """Keep the newest ``keep`` marked steps of each rank (every rank in ``root`` when ``ranks`` is
    None): its files of older steps go, leftovers of unfinished writes included. Newer unmarked
    files (a write in progress) stay."""
    for rank in sorted(ranks_in(root) if ranks is None else ranks):
        marked = complete_for(root, [rank])
        if len(marked) < keep:
            continue
        oldest = marked[-keep]
        for step in list_steps(root):
            if step < oldest:
                remove_rank_step(root, step, rank, base=base)
