"""How ``ctl`` shows a ``python`` job: the losses in ``--json`` and tables (``kinds.common``, as ``train``), the
last metrics, and a progress line (step, loss, metrics) from the job summary (before that, the ranks)."""

from __future__ import annotations

from typing import Any

from rankctl.kinds.common import latest_metrics, losses_summary

SHOWN_METRICS = 4


def summary(result: Any) -> dict[str, Any]:
    """Extra top-level fields of ``ctl status --json``: ``losses`` (as ``train``) and ``metrics``."""
    metrics = result.get("metrics", {}) if isinstance(result, dict) else {}
    return {**losses_summary(result), "metrics": metrics if isinstance(metrics, dict) else {}}


def progress(job: Any):
    """``step N  loss X  name value ...`` (``latest_metrics``); None before any loss is reported."""
    latest = latest_metrics(job)
    if latest is None:
        return None
    step, m = latest
    shown = [f"{k} {v:.4g}" for k, v in m.items() if k not in ("loss", "step") and isinstance(v, (int, float))][:SHOWN_METRICS]
    return "  ".join([f"step {step}", f"loss {m['loss']:.4f}", *shown])
