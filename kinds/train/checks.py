"""The ``train`` kind's cross-field rules: its layout, model shape, batch and data must fit together.

Pure (no torch, no file system): run once at submit (by ``ctl`` locally and by the coordinator) through
``kinds.spec.check_job``. ``node_paths`` names the files a rank will open, for the worker's sandbox.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rankctl.contract.spec import JobSpec
    from rankctl.parallel.layout import ParallelConfig


def _model_errors(spec: JobSpec, cfg: ParallelConfig) -> list[str]:
    m, p = spec.model, spec.parallel
    if m is None:
        return []
    errors = []
    if m.heads % p.tp:
        errors.append(f"model.heads={m.heads} is not divisible by parallel.tp={p.tp}: attention heads are split over tp")
    if m.hidden % m.heads:
        errors.append(f"model.hidden={m.hidden} is not divisible by model.heads={m.heads}")
    elif m.position_embedding == "rope" and (m.hidden // m.heads) % 2:
        errors.append(f"model.position_embedding=rope needs an even head size, got hidden/heads={m.hidden // m.heads}")
    ffn = m.ffn_hidden or 4 * m.hidden
    if ffn % p.tp:
        errors.append(f"model.ffn_hidden={ffn} is not divisible by parallel.tp={p.tp}: the MLP is split over tp")
    chunks = p.pp * (p.vpp or 1)
    if m.layers % chunks:
        errors.append(
            f"model.layers={m.layers} is not divisible by parallel.pp*vpp={chunks} "
            f"(pp={p.pp}, vpp={p.vpp or 1}): every pipeline chunk holds the same number of layers"
        )
    if p.cp > 1 and m.seq_len % (2 * p.cp):
        errors.append(
            f"model.seq_len={m.seq_len} is not divisible by 2*parallel.cp={2 * p.cp}: "
            "context parallelism cuts each sequence into 2*cp chunks"
        )
    if p.sequence_parallel and m.seq_len % (p.tp * p.cp):
        errors.append(f"model.seq_len={m.seq_len} is not divisible by parallel.tp*cp={p.tp * p.cp} (sequence_parallel)")
    if m.moe is not None:
        if m.moe.experts % p.ep:
            errors.append(f"model.moe.experts={m.moe.experts} is not divisible by parallel.ep={p.ep}: "
                          f"each expert-parallel rank holds the same number of whole experts")
        if m.moe.top_k > m.moe.experts:
            errors.append(f"model.moe.top_k={m.moe.top_k} exceeds model.moe.experts={m.moe.experts}")
        etp = p.etp if p.etp is not None else p.tp
        if ffn % etp:
            errors.append(f"model.ffn_hidden={ffn} is not divisible by parallel.etp={etp}: "
                          "each expert's MLP is split over etp (etp defaults to tp)")
        if p.tp > 1 and (m.seq_len % p.cp or (m.seq_len // p.cp) % p.tp):
            errors.append(f"model.seq_len={m.seq_len} / parallel.cp={p.cp} is not divisible by parallel.tp={p.tp}: "
                          "the MoE layers split each rank's tokens over tp")
        if m.moe.capacity_factor is not None and p.cp > 1:
            errors.append(f"model.moe.capacity_factor is not supported with context parallelism (parallel.cp={p.cp})")
    elif p.ep > 1:
        errors.append(f"parallel.ep={p.ep} needs a mixture-of-experts model (model.moe is not set)")
    return errors


def _train_errors(spec: JobSpec, cfg: ParallelConfig) -> list[str]:
    t, p = spec.train, spec.parallel
    if t is None:
        return []
    errors = []
    per_step = t.micro_batch * cfg.dp
    if t.global_batch % per_step:
        errors.append(
            f"train.global_batch={t.global_batch} is not divisible by train.micro_batch*dp={per_step} "
            f"(micro_batch={t.micro_batch}, dp={cfg.dp})"
        )
    elif p.vpp is not None and (t.global_batch // per_step) % p.pp:
        errors.append(
            f"interleaved schedule (parallel.vpp={p.vpp}) needs micro-batches per step "
            f"({t.global_batch // per_step}) to be a multiple of parallel.pp={p.pp}"
        )
    for field, value in (("checkpoint_dir", t.checkpoint_dir), ("init_from", t.init_from)):
        if value is not None and not os.path.isabs(value):
            errors.append(f"train.{field}={value!r} must be an absolute path (one every node reads)")
    if t.init_optimizer and not t.init_from:
        errors.append("train.init_optimizer=true needs train.init_from (the checkpoint whose AdamW state to take)")
    res = spec.resources
    if res.fewest_nodes < res.nodes and (t.checkpoint_every or t.snapshot_every) and not t.checkpoint_dir:
        errors.append(f"resources.min_nodes={res.min_nodes} needs train.checkpoint_dir: an attempt on fewer nodes "
                      f"resumes by re-slicing every old rank's checkpoint, which each node's own directory does not "
                      f"hold (a directory on a filesystem all nodes share)")
    if t.stop_at is not None and t.stop_at > t.steps:
        errors.append(f"train.stop_at={t.stop_at} must be at most train.steps={t.steps} (the run stops after that "
                      f"step; train.steps sets the schedule)")
    return errors


def _data_errors(spec: JobSpec) -> list[str]:
    """``train.data`` by its text alone: where the job is checked (the coordinator, ``ctl``) is not where it
    reads its data, and the coordinator's answer must not depend on the files of its host. The node checks
    the file, inside its sandbox (``worker.files.sandbox``), before the ranks read it."""
    from rankctl.contract.names import shown
    from rankctl.kinds.train.data import TOKEN_SUFFIXES, VOCAB, data_problem, is_token_file  # numpy only, no torch

    if spec.train is None:
        return []
    problem = data_problem(spec.train.data)
    out = [problem] if problem else []
    vocab = getattr(spec.model, "vocab", VOCAB) if spec.model is not None else VOCAB
    if not problem and isinstance(vocab, int) and vocab < VOCAB and not is_token_file(spec.train.data):
        out.append(f"model.vocab={vocab}: train.data={shown(spec.train.data)} is read as bytes, so the vocabulary "
                   f"must hold at least {VOCAB} tokens (a token file, {'/'.join(TOKEN_SUFFIXES)}, may use fewer)")
    for field in ("checkpoint_dir", "init_from"):   # node paths too, by their text alone
        value = getattr(spec.train, field)
        if value and "\x00" in value:
            out.append(f"train.{field}={shown(value)}: a path cannot hold a NUL character")
    return out


def errors(spec: JobSpec, cfg: ParallelConfig) -> list[str]:
    """Every cross-field problem of a train job (empty when it can run)."""
    return _model_errors(spec, cfg) + _train_errors(spec, cfg) + _data_errors(spec)


def absolute_data(spec: JobSpec, job_dir: Path | None = None) -> list[str]:
    """``ctl``'s overrides making a relative ``train.data``, ``train.checkpoint_dir`` or ``train.init_from``
    path absolute against the directory ``ctl`` runs in (daemons do not share it); ``job_dir`` is not used:
    data paths predate job-relative paths."""
    from rankctl.contract.jobfile import literal_override

    data = spec.train.data if spec.train else "builtin:"
    out = [] if not data or "\x00" in data or data.startswith("builtin:") or Path(data).is_absolute() else [
        literal_override("train.data", Path(data).resolve())]   # empty or NUL: refused by the check that follows
    for field in ("checkpoint_dir", "init_from"):   # likewise, against the directory ctl runs in
        value = getattr(spec.train, field) if spec.train else None
        if value and "\x00" not in value and not Path(value).is_absolute():
            out.append(literal_override(f"train.{field}", Path(value).resolve()))
    return out


def node_paths(spec: JobSpec, workdir: str, cwd: str) -> list[tuple[str, Any, Any]]:
    """The node files a train rank opens, as ``(field, value, path)``: ``train.data`` unless builtin, the path
    joined to the rank's working directory ``cwd`` as its ``open`` does (``workdir`` is not used)."""
    data = spec.train.data if getattr(spec, "train", None) else "builtin:"
    out = [] if data.startswith("builtin:") else [("train.data", data, os.path.join(cwd, data))]
    for field in ("checkpoint_dir", "init_from"):
        value = getattr(spec.train, field) if getattr(spec, "train", None) else None
        if value:
            out.append((f"train.{field}", value, value))
    return out


def written_paths(spec: JobSpec) -> list[tuple[str, Any, Any]]:
    """The node directory a train rank creates and deletes under, as ``(field, value, path)``:
    ``{train.checkpoint_dir}/{job name}`` when the spec names a checkpoint dir (else the node's state dir)."""
    value = spec.train.checkpoint_dir if getattr(spec, "train", None) else None
    return [("train.checkpoint_dir", value, os.path.join(value, spec.name))] if value else []
