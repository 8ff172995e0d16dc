"""The ``train`` job result from its ranks' results (pure, no torch)."""

from __future__ import annotations

from typing import Any, Mapping


def train_result(results: Mapping[int, Any]) -> dict[str, Any]:
    """The global losses as the lowest rank holding them reports (a last pipeline stage;
    every DP rank of it holds the same dp-reduced loss)."""
    for rank in sorted(results):
        r = results[rank]
        if isinstance(r, Mapping) and r.get("losses") and all(x.get("loss") is not None for x in r["losses"]):
            return {"losses": r["losses"], "val_losses": r.get("val_losses", []), "final": r.get("final", {}),
                    "resumed_from": r.get("resumed_from"), "reported_by": rank}
    return {"losses": [], "val_losses": [], "final": {}, "reported_by": None}
