"""Cross-field rules of a job: its layout, model shape and batch must fit together.

Pure (no torch): run by ``ctl plan`` and by the coordinator before anything is stored.
"""

from __future__ import annotations

from rankctl.coordinator.spec import JobSpec, SpecError
from rankctl.parallel.layout import LayoutError, ParallelConfig


def parallel_config(spec: JobSpec) -> ParallelConfig:
    p = spec.parallel
    try:
        return ParallelConfig(
            world_size=spec.world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp, order=p.order
        )
    except LayoutError as exc:
        raise SpecError([f"parallel: {exc} (world_size = resources.nodes*resources.slots_per_node)"]) from None


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
            errors.append(f"model.moe.experts={m.moe.experts} is not divisible by parallel.ep={p.ep}")
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
    return errors


def _data_errors(spec: JobSpec) -> list[str]:
    """The training data must exist where the job is submitted (nodes share the filesystem)."""
    from rankctl.models.data import check_data_source  # numpy only, no torch

    if spec.train is None:
        return []
    problem = check_data_source(spec.train.data)
    return [problem] if problem else []


def check_job(spec: JobSpec) -> ParallelConfig:
    """Validate everything that crosses sections; return the layout config or raise SpecError."""
    cfg = parallel_config(spec)
    errors = _model_errors(spec, cfg) + _train_errors(spec, cfg) + _data_errors(spec)
    if errors:
        raise SpecError(errors)
    return cfg
