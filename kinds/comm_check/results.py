"""The ``comm-check`` job result from its ranks' results (pure, no torch).

Ranks report (``kinds.comm_check.run``)::

    {"size_bytes": S, "iters": n, "groups": [{"kinds": ["tp", "tp_cp"], "members": [0, 1],
      "allreduce": {"us", "algbw_gbps", "busbw_gbps", "bytes"}, "allgather": {...}}, ...]}

and the job result is a table with one row per (kind, op): a group's time for an op is its
slowest member's; a row gives the mean and max over the kind's groups and the lowest bus
bandwidth (nccl-tests definitions, from each group's time).
"""

from __future__ import annotations

from typing import Any, Mapping

from rankctl.kinds.comm_check.ops import BUS_FACTOR, OPS
from rankctl.parallel.layout import GROUP_NAMES


def _group_times(results: Mapping[int, Any]) -> dict[tuple[int, ...], dict[str, Any]]:
    """members -> {"kinds": set, op: slowest member's measurement}."""
    groups: dict[tuple[int, ...], dict[str, Any]] = {}
    for result in results.values():
        if not isinstance(result, Mapping):
            continue
        for row in result.get("groups", []):
            g = groups.setdefault(tuple(row["members"]), {"kinds": set()})
            g["kinds"].update(row["kinds"])
            for op in OPS:
                if op in row and (op not in g or row[op]["us"] > g[op]["us"]):
                    g[op] = row[op]
    return groups


def _busbw(op: str, nbytes: float, n: int, us: float) -> float:
    return (nbytes / (us / 1e6) / 1e9) * BUS_FACTOR[op](n) if us > 0 else 0.0


def _kind_rows(kind: str, groups: list[tuple[tuple[int, ...], dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per op: groups of the kind, their size, mean/max latency, lowest bus bandwidth."""
    rows = []
    for op in OPS:
        timed = [(m, g[op]) for m, g in groups if op in g]
        if not timed:
            continue
        times = [t["us"] for _, t in timed]
        rows.append({
            "kind": kind, "op": op, "groups": len(groups), "size": len(groups[0][0]),
            "bytes": int(timed[0][1]["bytes"]), "mean_us": sum(times) / len(times), "max_us": max(times),
            "min_busbw_gbps": min(_busbw(op, t["bytes"], len(m), t["us"]) for m, t in timed),
        })
    return rows


def comm_check_result(results: Mapping[int, Any]) -> dict[str, Any]:
    """``{"comm": [rows per (kind, op) in layout kind order], "size_bytes", "iters"}``."""
    by_kind: dict[str, list[tuple[tuple[int, ...], dict[str, Any]]]] = {}
    for members, g in _group_times(results).items():
        for kind in g["kinds"]:
            by_kind.setdefault(kind, []).append((members, g))
    order = sorted(by_kind, key=lambda k: (GROUP_NAMES.index(k) if k in GROUP_NAMES else len(GROUP_NAMES), k))
    first = next((r for r in results.values() if isinstance(r, Mapping)), {})
    return {
        "comm": [row for kind in order for row in _kind_rows(kind, by_kind[kind])],
        "size_bytes": first.get("size_bytes"),
        "iters": first.get("iters"),
    }
