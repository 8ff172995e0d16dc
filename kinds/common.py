"""What kinds that train a model with a loss share (``train``, and ``python`` through ``ctx.report``): their
step figures, the job's losses from its ranks' results, how ``ctl`` shows them, and the optimiser warm-up.

Pure (no torch at import): the coordinator aggregates results and ``ctl`` renders with it. Hooks take
``rows_table`` (``ctl``'s table builder) so that no kind imports ``cli``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from rankctl.kinds.figures import Figure

# The per-step figures the coordinator folds into a step event (``JobKind.figures``): the loss every rank
# that holds it agrees on (the dp-reduced loss of a last pipeline stage), and the slowest rank's tokens/s; each
# with its dashboard chart and its gauge.
TRAINING_FIGURES: Mapping[str, Figure] = {
    "loss": Figure("first", label="loss", chart="loss-curve", line="train", metric="rankctl_job_loss",
                   help="Training loss of the last completed step."),
    "val_loss": Figure("first", label="val loss", chart="loss-curve", line="val", metric="rankctl_job_val_loss",
                       help="The latest validation loss (of the last step that had one).", sparse=True),
    "tokens_per_s": Figure("min", label="tokens/s", unit="tokens/s", chart="throughput", line="tps",
                           metric="rankctl_job_tokens_per_second",
                           help="Tokens/s of the last completed step (slowest rank)."),
}
SAMPLED_ROWS = 12


def losses_result(results: Mapping[int, Any]) -> dict[str, Any]:
    """The job's losses as the lowest rank holding them reports (a last pipeline stage; every DP rank of it
    holds the same dp-reduced loss): ``{"losses", "val_losses", "final", "resumed_from", "reported_by"}``,
    ``resumed_layout`` when it resumed from a checkpoint of another layout, and ``ended`` when the run stopped
    early on purpose (``train.stop_at``; the coordinator's SUCCEEDED reason adds it)."""
    for rank in sorted(results):
        r = results[rank]
        if isinstance(r, Mapping) and r.get("losses") and all(x.get("loss") is not None for x in r["losses"]):
            out = {"losses": r["losses"], "val_losses": r.get("val_losses", []), "final": r.get("final", {}),
                   "resumed_from": r.get("resumed_from"), "reported_by": rank}
            if r.get("ended"):   # why the run ended before its last step (train.stop_at): the job's reason says it
                out["ended"] = r["ended"]
            if r.get("resumed_layout"):   # the layout of the checkpoint it resumed from, when another
                out["resumed_layout"] = r["resumed_layout"]
            if r.get("losses_every"):     # too many steps to carry: every k-th loss (contract.resultsize)
                out["losses_total"], out["losses_every"] = r.get("losses_total"), r["losses_every"]
            return out
    return {"losses": [], "val_losses": [], "final": {}, "reported_by": None}


def losses_summary(result: Any) -> dict[str, Any]:
    """Extra top-level fields of ``ctl status --json``: the job's losses (with ``losses_total`` and
    ``losses_every`` when they are every k-th of more steps than a rank's result carries)."""
    if not isinstance(result, dict):
        return {"losses": []}
    sampled = {k: result[k] for k in ("losses_total", "losses_every") if result.get(k)}
    return {"losses": result.get("losses", []), **sampled}


def loss_tables(result: dict[str, Any], rows_table: Callable) -> list[tuple[str | None, Any]]:
    """(result key, table) pairs: the losses and validation losses, sampled to ``SAMPLED_ROWS`` rows."""
    out: list[tuple[str | None, Any]] = []
    for key in ("losses", "val_losses"):
        value = result.get(key)
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            rows = [_step_first(r) for r in sample(value, SAMPLED_ROWS)]   # a Struct's keys come in any order
            out.append((key, rows_table(f"{key.replace('_', ' ')} ({len(value)} steps)", rows)))
    return out


def _step_first(row: dict[str, Any]) -> dict[str, Any]:
    """The row with ``step`` first and the rest by name: the same columns in the same order on every call."""
    return {**({"step": row["step"]} if "step" in row else {}), **{k: row[k] for k in sorted(row) if k != "step"}}


def sample(rows: list, n: int) -> list:
    """At most ``n`` rows spread evenly, always keeping the first and the last."""
    if len(rows) <= n:
        return rows
    idx = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in idx]


def number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def latest_metrics(job: Any) -> tuple[int, dict] | None:
    """(step, metrics) with a loss: the job summary's (the last step every rank finished), else, before any
    step is finished by every rank, those of the lowest rank in the job's page that reports a loss."""
    summary = job.summary if job.HasField("summary") else None
    m = dict(summary.metrics) if summary is not None else {}
    if number(m.get("loss")):
        step = m.get("step")
        return (int(step) if number(step) else summary.min_step), m
    for r in sorted(job.ranks, key=lambda r: r.rank):
        m = json.loads(r.metrics_json) if r.metrics_json else {}
        if isinstance(m, dict) and number(m.get("loss")):
            return r.step, m
    return None


def warm() -> None:
    """``JobKind.warm``: AdamW's constructor imports ``torch._dynamo`` (~2.5 s of CPU); the launcher imports it
    once before it first forks ranks of a kind that builds optimisers, not every rank it forks."""
    import torch._dynamo  # noqa: F401 - importing it is the point
