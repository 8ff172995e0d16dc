"""The ``python`` job result from its ranks' reports (pure): the losses as ``train`` aggregates them
(``kinds.common``) plus the last metrics, so that ``ctl status --json`` shows ``losses`` exactly as for ``train`` jobs.

A rank's result (``runtime.context.RankContext.reported``)::

    {"losses": [{"step", "loss"}, ...], "metrics": {last report's metrics}, "final": {"step", ...}}
"""

from __future__ import annotations

from typing import Any, Mapping

from rankctl.kinds.common import losses_result


def python_result(results: Mapping[int, Any]) -> dict[str, Any]:
    """The lowest rank's losses that are complete (``losses_result``) and the metrics of the same rank
    (or, when no rank reported a loss, of the lowest rank that reported metrics)."""
    out = losses_result(results)
    by = out["reported_by"]
    if by is None:
        by = next((r for r in sorted(results) if isinstance(results[r], Mapping) and results[r].get("metrics")), None)
        out["final"] = results[by].get("final", {}) if by is not None else {}
    out["metrics"] = dict(results[by].get("metrics") or {}) if by is not None else {}
    out.pop("val_losses", None)
    out.pop("resumed_from", None)
    return out
