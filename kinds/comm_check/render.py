"""How ``ctl`` shows a ``comm-check`` result: one row per group kind, readable units.

Hooks take ``rows_table`` (``ctl``'s table builder) so that no kind imports ``cli``.
"""

from __future__ import annotations

from typing import Any, Callable


def comm_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """comm-check rows (one per kind and op) pivoted to one row per kind, readable units."""
    by_kind: dict[str, dict[str, Any]] = {}
    for r in rows:
        out = by_kind.setdefault(r["kind"], {"kind": r["kind"], "groups x size": f"{r['groups']} x {r['size']}"})
        op = {"allreduce": "all-reduce", "allgather": "all-gather"}.get(r.get("op", ""), r.get("op", ""))
        out[f"{op} us (mean/max)"] = f"{r['mean_us']:.0f} / {r['max_us']:.0f}"
        out[f"{op} busbw GB/s (min)"] = f"{r['min_busbw_gbps']:.3g}"
    return list(by_kind.values())


def tables(result: dict[str, Any], rows_table: Callable) -> list[tuple[str | None, Any]]:
    """(result key, table) pairs; keys not named here get ``ctl``'s generic table."""
    rows = result.get("comm")
    if not (isinstance(rows, list) and rows and isinstance(rows[0], dict) and "min_busbw_gbps" in rows[0]):
        return []
    size = result.get("size_bytes")
    title = f"comm-check per kind ({size} bytes per rank)" if size else "comm-check per kind"
    return [("comm", rows_table(title, comm_rows(rows)))]
