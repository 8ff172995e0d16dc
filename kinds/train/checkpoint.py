"""Sharded checkpoints: one file per rank per step, a done-marker per rank, full export.

Layout on disk::

    {root}/step-{s:08d}/rank-{r:05d}.pt     this rank's shard, optimizer, RNG, step, layout
    {root}/step-{s:08d}/rank-{r:05d}.done   JSON {step, rank, fingerprint, identity, sha256, bytes}, after the .pt

Both are written to a temporary name and ``os.replace``d, so a reader never sees a torn
file. In-memory snapshots (``train.snapshot_every``) are the same files under
``snapshot_root`` (``contract.files.checkpoints``: the node's tmpfs, bounded: ``save_snapshot`` makes room once
when it is full). A step counts as complete only when every rank of the world has its marker with the
same ``fingerprint``: a hash of the run's identity (world size, layout, model, seed, data; see
``kinds.train.train_state.identity_of``), which the marker also keeps so that a refused resume
can name what differs (``differences``): ``latest_complete``.

Where ``root`` is (``checkpoint_root``): ranks run in ``run_dir = {state}/jobs/{job_id}/{attempt}``
(the worker daemon's layout), and checkpoints go to ``{state}/checkpoints/{job name}``: a
directory that outlives the job id, so resubmitting a job with the same name and
``train.resume: true`` finds them. Each node writes its own ranks' files under its own
state directory; the trainer agrees on the resume step with a collective, so this works
with or without a shared filesystem (``export_full_state_dict`` needs every rank's file
in one directory).

``export_full_state_dict(step_dir)`` gathers TP shards back into serial-shaped tensors
(concatenate along the sharded dim in TP-rank order, trim the vocabulary padding; take
TP rank 0 for replicated parameters), keyed as the serial ``GPT.named_parameters()``.
Mixture-of-experts parameters (``meta["expert"]``, ``layers.<i>.mlp.experts.<e>.*``) live only
on the ep rank that owns expert ``e``; they are read from the ranks with expert data-parallel
coordinate ``edp == 0`` (every ep rank and every expt_tp slice has one) and gathered over
expt_tp (``meta["tp_rank"]``/``tp_size`` refer to expt_tp for them), so the export holds every
expert exactly as the serial model names it.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
from typing import Any

import torch

from rankctl.contract.files import safepath
from rankctl.contract.files.checkpoints import (
    RANK_FILE_RE, STEP_RE, complete_for, damage, list_steps, marker_file, prune, rank_file, read_marker,
    remove_rank_step, root_in, snapshot_root, state_dir_of, step_dir,
)
from rankctl.kinds.train.intact import content_problem

# the layout's helpers live in contract.checkpoints (the daemon replicates these files); re-exported here
__all__ = ["atomic_write", "checkpoint_root", "complete_for", "copied", "differences", "export_full_state_dict",
           "fingerprint", "latest_complete", "list_steps", "load_rank", "marker_file", "prune", "rank_file", "read_marker",
           "remove_rank_files", "save_rank", "save_snapshot", "snapshot_root_for", "step_dir"]


def checkpoint_root(run_dir: str, job_name: str) -> str:
    """``{state}/checkpoints/{job_name}`` for ``run_dir = {state}/jobs/{job_id}/{attempt}``."""
    return root_in(state_dir_of(run_dir), job_name)


def snapshot_root_for(run_dir: str, job_name: str) -> str:
    """The node's in-memory snapshot root of ``job_name`` (``contract.files.checkpoints.snapshot_root``)."""
    return snapshot_root(state_dir_of(run_dir), job_name)


def copied(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU (dicts, lists and tuples rebuilt; other values
    shared, they are immutable here): a state that later optimizer steps cannot change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copied(v) for v in obj)
    return obj


def fingerprint(identity: dict[str, Any]) -> str:
    """A short hash of ``identity`` (what must match for a checkpoint to be resumed as is)."""
    text = json.dumps(identity, sort_keys=True)
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"train.seed: checkpoint 7, this job 8"`` for every dotted field that differs."""
    old, new = _flat(saved), _flat(current)
    return [f"{k}: checkpoint {old.get(k)!r}, this job {new.get(k)!r}"
            for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


class _Recorder:
    """A file whose ``write`` keeps the OSError it raised (torch.save turns it into a RuntimeError,
    "unexpected pos", which would hide a full filesystem: ENOSPC), and the SHA-256 and size of what it wrote."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None
        self.digest, self.size = hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        try:
            n = self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self.f.flush()


def atomic_write(path: str, write: Any, *, base: str | None = None) -> _Recorder:
    """``write(f)`` to a temporary name renamed over ``path`` (a link there is replaced, never written through),
    both reached from ``base`` (default: ``path``'s directory) through no link (``contract.files.safepath``); the
    temporary file goes when it fails, and the OSError a full filesystem raised is raised as it is (not
    torch.save's RuntimeError), naming the file. Returns what was written (its SHA-256 and size)."""
    base = os.path.dirname(os.path.abspath(path)) if base is None else base
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with os.fdopen(safepath.open_write(base, tmp), "wb") as f:
            out = _Recorder(f)
            try:
                write(out)
            except RuntimeError as exc:
                if out.error is None:
                    raise
                raise out.error from exc
            f.flush()
            os.fsync(f.fileno())
        safepath.replace(base, tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            safepath.unlink(base, tmp)
        if isinstance(exc, OSError) and exc.filename is None:   # a write's error names no file: name it
            raise OSError(exc.errno, exc.strerror, tmp) from exc
        raise
    return out


def _base(root: str, base: str | None) -> str:
    """Where the safe walk to ``root`` starts: ``base`` (a worker root), or ``root`` itself (made here) when
    the caller trusts it as it is."""
    if base is None:
        os.makedirs(root, exist_ok=True)
        return root
    return base


def save_rank(root: str, step: int, rank: int, state: dict[str, Any], fp: str,
              identity: dict[str, Any] | None = None, job_id: str | None = None, *, base: str | None = None) -> str:
    """Write this rank's state for ``step`` and then its done-marker (``fp``, ``identity``, the writing job's
    id, and the shard's SHA-256 and size, which a restore verifies: ``contract.files.checkpoints.damage``);
    returns the .pt path. Every directory and file is made through no link below ``base`` (``_base``)."""
    base = _base(root, base)
    safepath.makedirs(base, step_dir(root, step))
    path = rank_file(root, step, rank)
    written = atomic_write(path, lambda f: torch.save(state, f), base=base)
    fields = {"step": step, "rank": rank, "fingerprint": fp, "identity": identity,
              "sha256": written.digest.hexdigest(), "bytes": written.size}
    if job_id is not None:
        fields["job_id"] = job_id
    marker = json.dumps(fields).encode()
    atomic_write(marker_file(root, step, rank), lambda f: f.write(marker), base=base)
    return path


def space_note(root: str) -> str:
    """What bounds the filesystem under ``root``, for a message about a full one."""
    try:
        st = os.statvfs(root)
    except OSError:
        return "the node's snapshot memory is full"
    return (f"the node's snapshot memory ({st.f_blocks * st.f_frsize >> 20} MiB, bounded by ctl worker "
            f"--snapshot-memory-mb) is full")


def _saved_or_full(root: str, step: int, rank: int, *args: Any, base: str | None) -> str | None:
    """``save_rank``'s path, or None when the filesystem is full (ENOSPC; this rank's files of ``step`` removed)."""
    try:
        return save_rank(root, step, rank, *args, base=base)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    remove_rank_step(root, step, rank, base=base)
    return None


def save_snapshot(root: str, step: int, rank: int, state: dict[str, Any], fp: str,
                  identity: dict[str, Any] | None = None, job_id: str | None = None, *,
                  base: str | None = None) -> str:
    """``save_rank`` into the node's bounded snapshot memory. When it is full (ENOSPC) the partial step goes,
    this rank keeps only its newest complete step and the write is tried once more; a second ENOSPC raises
    one naming the bound (and leaves nothing partial)."""
    path = _saved_or_full(root, step, rank, state, fp, identity, job_id, base=base)
    if path is None:
        prune(root, [rank], keep=1, base=base)
        path = _saved_or_full(root, step, rank, state, fp, identity, job_id, base=base)
    if path is None:
        raise OSError(errno.ENOSPC, f"No space left after keeping only the newest snapshot step: {space_note(root)}")
    return path


def load_rank(root: str, step: int, rank: int, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    return torch.load(rank_file(root, step, rank), map_location=map_location, weights_only=True)


def latest_complete(root: str, world_size: int, fp: str | None = None) -> int | None:
    """The latest step whose checkpoint every rank finished, or None."""
    steps = complete_for(root, range(world_size), fp)
    return steps[-1] if steps else None


def remove_rank_files(root: str, rank: int, *, base: str | None = None) -> int:
    """Delete this rank's files (and markers) of every step; a fresh run under the same name
    must not leave a mix of old and new shards that could later look complete. Listed and deleted
    through no link below ``base`` (``root`` when None): a linked step directory is refused, not followed."""
    base, removed, prefix = root if base is None else base, 0, f"rank-{rank:05d}."
    for step in sorted(n for n in safepath.listdir(base, root) if STEP_RE.match(n)):
        d = os.path.join(root, step)
        for name in safepath.listdir(base, d):
            if name.startswith(prefix) and safepath.unlink(base, os.path.join(d, name)):
                removed += 1
    return removed


# -- export -----------------------------------------------------------------------------------

def _load_all(step_paths: list[str]) -> list[dict[str, Any]]:
    """Every rank's file of one step, from one directory or several (nodes without a shared
    filesystem each hold their own ranks' files)."""
    by_name = {os.path.basename(f): f for p in step_paths for f in glob.glob(os.path.join(p, "rank-*.pt"))}
    if not by_name:
        raise FileNotFoundError(f"no rank files in checkpoint directory {', '.join(step_paths)}")
    states = []
    for name in sorted(by_name):
        path = by_name[name]
        step_path, rank_match = os.path.dirname(path), RANK_FILE_RE.match(name)
        step_match = STEP_RE.match(os.path.basename(step_path))
        if step_match and rank_match:   # its marker's size and SHA-256 (``contract.files.checkpoints.damage``)
            why = damage(os.path.dirname(step_path), int(step_match.group(1)), int(rank_match.group(1)))
            if why:
                raise ValueError(f"rank {int(rank_match.group(1))}'s shard is damaged: {why}")
        try:
            states.append(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - torch.load's errors name no file
            raise ValueError(f"{path} cannot be loaded: {type(exc).__name__}: {str(exc)[:200]}") from None
        if problem := content_problem(states[-1]):   # a tensor of another shape than its metadata's
            raise ValueError(f"{path}: {problem}")
    world = states[0]["world_size"]
    if len(states) != world:
        raise ValueError(f"{', '.join(step_paths)} hold {len(states)} rank files, "
                         f"but the checkpoint's world size is {world}")
    return states


def _gather(name: str, parts: list[tuple[int, torch.Tensor]], meta: dict[str, Any]) -> torch.Tensor:
    parts = sorted(parts, key=lambda p: p[0])
    dim, full_shape = meta["shard_dim"], tuple(meta["full_shape"])
    if dim is None:
        return parts[0][1].clone()
    if [r for r, _ in parts] != list(range(meta["tp_size"])):
        raise ValueError(f"{name}: expected shards from TP ranks 0..{meta['tp_size'] - 1}, got {[r for r, _ in parts]}")
    full = torch.cat([t for _, t in parts], dim=dim)
    return full.narrow(dim, 0, full_shape[dim]).clone()


def export_full_state_dict(step_path: str | list[str]) -> dict[str, torch.Tensor]:
    """Serial-shaped parameters from one step's directory, or its directories on several nodes
    (between them every rank's file must be there)."""
    shards: dict[str, list[tuple[int, torch.Tensor]]] = {}
    metas: dict[str, dict[str, Any]] = {}
    for state in _load_all([step_path] if isinstance(step_path, str) else list(step_path)):
        coords = state["coords"]
        dense_replica = any(coords.get(k, 0) != 0 for k in ("dp", "cp"))  # DP / CP replicas: same parameters
        expert_replica = coords.get("edp", 0) != 0  # expert DP replicas likewise
        for name, tensor in state["model"].items():
            meta = state["meta"][name]
            expert = bool(meta.get("expert", False))
            if expert_replica if expert else dense_replica:
                continue
            metas[name] = meta
            tp_rank = meta.get("tp_rank", coords.get("tp", 0)) if expert else coords.get("tp", 0)
            shards.setdefault(name, []).append((tp_rank, tensor))
    out = {}
    for name, parts in shards.items():
        key = metas[name]["init_key"]
        if key != name and key in shards:
            continue  # a tied head copy on a later pipeline stage; the serial model has one tensor
        if metas[name]["shard_dim"] is None:
            parts = [min(parts, key=lambda p: p[0])]
        out[name] = _gather(name, parts, metas[name])
    return out
