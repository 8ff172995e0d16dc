"""How ``ctl`` shows a ``train`` job: losses in ``--json``, a progress bar, loss and expert-load tables.

Hooks take ``rows_table`` (``ctl``'s table builder) so that no kind imports ``cli``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

SAMPLED_ROWS = 12


def _loads(text: str) -> Any:
    return json.loads(text) if text else None


def _spec_steps(job: Any) -> int:
    """``train.steps`` of the job's spec (a Struct), 0 when it has none."""
    train = job.spec.fields.get("train")
    steps = train.struct_value.fields.get("steps") if train is not None else None
    return int(steps.number_value) if steps is not None else 0


def summary(result: Any) -> dict[str, Any]:
    """Extra top-level fields of ``ctl status --json``: the global losses."""
    result = result or {}
    return {"losses": result.get("losses", []) if isinstance(result, dict) else []}


def tables(result: dict[str, Any], rows_table: Callable) -> list[tuple[str | None, Any]]:
    """(result key, table) pairs: expert load balance first, then the sampled loss tables."""
    out: list[tuple[str | None, Any]] = []
    final = result.get("final")
    if isinstance(final, dict) and isinstance(final.get("expert_tokens"), dict) and final["expert_tokens"]:
        out.append((None, rows_table(f"expert load balance (step {final.get('step', '?')}, tokens per expert)",
                                     expert_rows(final["expert_tokens"]))))
    for key in ("losses", "val_losses"):
        value = result.get(key)
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            out.append((key, rows_table(f"{key.replace('_', ' ')} ({len(value)} steps)", _sample(value, SAMPLED_ROWS))))
    return out


def expert_rows(expert_tokens: dict[str, list[int]]) -> list[dict[str, Any]]:
    """One row per MoE layer: tokens per expert, and max / mean (1.0 = perfectly balanced)."""
    rows = []
    for layer, tokens in expert_tokens.items():
        mean = sum(tokens) / len(tokens) if tokens else 0.0
        rows.append({"layer": layer, "tokens per expert": " ".join(str(t) for t in tokens),
                     "max/mean": (max(tokens) / mean) if mean else None})
    return rows


def _sample(rows: list, n: int) -> list:
    """At most ``n`` rows spread evenly, always keeping the first and the last."""
    if len(rows) <= n:
        return rows
    idx = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in idx]


def progress(job: Any):
    """A progress bar with the current loss, tokens/s and step-time spread (see ``latest_metrics``)."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    steps = _spec_steps(job)
    latest = latest_metrics(job)
    if not steps or latest is None:
        return None
    step, m = latest
    cells = [f"step {step}/{steps}", ProgressBar(total=steps, completed=step, width=30),
             f"loss {m.get('loss', float('nan')):.4f}", f"{m.get('tokens_per_s', 0):,.0f} tok/s"]
    if _number(m.get("lr")):
        cells.append(f"lr {m['lr']:.2e}")
    if _number(m.get("step_time_min")) and _number(m.get("step_time_max")):
        cells.append(f"step time {m['step_time_min']:.3g}-{m['step_time_max']:.3g} s")
    grid = Table.grid(padding=(0, 1))
    grid.add_row(*cells)
    return grid


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def latest_metrics(job: Any) -> tuple[int, dict] | None:
    """(step, metrics) with a loss: the job summary's (the last step every rank finished), else, from a
    coordinator without summaries, those of the lowest rank in the job's page that reports a loss."""
    summary = job.summary if job.HasField("summary") else None
    m = dict(summary.metrics) if summary is not None else {}
    if _number(m.get("loss")):
        step = m.get("step")
        return (int(step) if _number(step) else summary.min_step), m
    for r in sorted(job.ranks, key=lambda r: r.rank):
        m = _loads(r.metrics_json) or {}
        if isinstance(m, dict) and _number(m.get("loss")):
            return r.step, m
    return None
