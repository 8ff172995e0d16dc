"""How ``ctl`` shows a ``train`` job: a progress bar and the expert-load table, beside the losses
(``kinds.common``). Hooks take ``rows_table`` (``ctl``'s table builder) so that no kind imports ``cli``.
"""

from __future__ import annotations

from typing import Any, Callable

from rankctl.kinds.common import latest_metrics, loss_tables, number


def _spec_steps(job: Any) -> int:
    """``train.steps`` of the job's spec (a Struct), 0 when it has none."""
    train = job.spec.fields.get("train")
    steps = train.struct_value.fields.get("steps") if train is not None else None
    return int(steps.number_value) if steps is not None else 0


def tables(result: dict[str, Any], rows_table: Callable) -> list[tuple[str | None, Any]]:
    """(result key, table) pairs: expert load balance first, then the sampled loss tables."""
    out: list[tuple[str | None, Any]] = []
    final = result.get("final")
    if isinstance(final, dict) and isinstance(final.get("expert_tokens"), dict) and final["expert_tokens"]:
        out.append((None, rows_table(f"expert load balance (step {final.get('step', '?')}, tokens per expert)",
                                     expert_rows(final["expert_tokens"]))))
    return out + loss_tables(result, rows_table)


def expert_rows(expert_tokens: dict[str, list[int]]) -> list[dict[str, Any]]:
    """One row per MoE layer: tokens per expert, and max / mean (1.0 = perfectly balanced)."""
    rows = []
    for layer, tokens in expert_tokens.items():
        mean = sum(tokens) / len(tokens) if tokens else 0.0
        rows.append({"layer": layer, "tokens per expert": " ".join(str(t) for t in tokens),
                     "max/mean": (max(tokens) / mean) if mean else None})
    return rows


def progress(job: Any):
    """A progress bar with the current loss, tokens/s and step-time spread (see ``latest_metrics``)."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    steps = _spec_steps(job)
    latest = latest_metrics(job)
    if not steps or latest is None:
        return None
    step, m = latest
    cells = [f"step {step}/{steps}", ProgressBar(total=steps, completed=step, width=None),
             f"loss {m.get('loss', float('nan')):.4f}", f"{m.get('tokens_per_s', 0):,.0f} tok/s"]
    if number(m.get("lr")):
        cells.append(f"lr {m['lr']:.2e}")
    if number(m.get("step_time_median")) and number(m.get("step_time_run_min")):   # over the run, not its last step
        cells.append(f"{m['step_time_median']:.3g} s/step (median; {m['step_time_run_min']:.3g}-"
                     f"{m['step_time_run_max']:.3g})")
    elif number(m.get("step_time_min")) and number(m.get("step_time_max")):
        cells.append(f"{m['step_time_min']:.3g}-{m['step_time_max']:.3g} s/step")
    grid = Table.grid(padding=(0, 1))
    for cell in cells:  # one line on an 80-column terminal: the bar gives way (10 to 30 columns), no text wraps
        if isinstance(cell, str):
            grid.add_column(no_wrap=True)
        else:
            grid.add_column(min_width=10, max_width=30, ratio=1)
    grid.add_row(*cells)
    return grid


PRINTED_STEPS = 20   # a run's step lines in its log, about (plus its first and last step, and each evaluation)


def printed_step(step: int, steps: int, evaluated: bool) -> bool:
    """Whether the rank that prints (``loop.train``) prints this step's line."""
    return step in (1, steps) or evaluated or step % max(1, steps // PRINTED_STEPS) == 0


def step_line(step: int, steps: int, metrics: dict[str, Any]) -> str:
    """What a training script prints for a step, as Megatron does, for ``ctl logs`` and ``ctl up`` (short
    enough for an 80-column terminal after ``[rank R]``):
    ``step 10/200  loss 3.4358  lr 1.5e-04  grad 2.58  6,065 tok/s  0.169 s``."""
    parts = [f"step {step}/{steps}"]
    for key, fmt in (("loss", "loss {:.4f}"), ("val_loss", "val loss {:.4f}"), ("lr", "lr {:.1e}"),
                     ("grad_norm", "grad {:.3g}"), ("tokens_per_s", "{:,.0f} tok/s"), ("step_time_s", "{:.3g} s")):
        if number(metrics.get(key)):
            parts.append(fmt.format(metrics[key]))
    return "  ".join(parts)

