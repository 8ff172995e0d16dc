"""A job's result from its ranks' results (pure, no torch; easy to change per job kind).

``comm-check`` ranks report (``worker.commcheck.run``)::

    {"size_bytes": S, "iters": n, "groups": [{"kinds": ["tp", "tp_cp"], "members": [0, 1],
      "allreduce": {"us", "algbw_gbps", "busbw_gbps", "bytes"}, "allgather": {...}}, ...]}

and the job result is a table with one row per (kind, op): a group's time for an op is its
slowest member's; a row gives the mean and max over the kind's groups and the lowest bus
bandwidth (nccl-tests definitions, from each group's time).
Other kinds keep every rank's result under ``ranks``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from rankctl.parallel.layout import KINDS

OPS = ("allreduce", "allgather")
BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n}


def parse_rank_results(raw: Mapping[int, str]) -> dict[int, Any]:
    """rank -> decoded result_json (empty or undecodable ones are left out)."""
    out: dict[int, Any] = {}
    for rank, text in raw.items():
        if not text:
            continue
        try:
            out[rank] = json.loads(text)
        except json.JSONDecodeError:
            out[rank] = {"unparseable": text[:200]}
    return out


def aggregate(kind: str, results: Mapping[int, Any]) -> dict[str, Any]:
    """The job result for ``kind`` from rank -> result."""
    if kind == "comm-check":
        return comm_check_result(results)
    if kind == "train":
        return train_result(results)
    return {"ranks": {str(r): results[r] for r in sorted(results)}}


def train_result(results: Mapping[int, Any]) -> dict[str, Any]:
    """The global losses as the lowest rank holding them reports (a last pipeline stage;
    every DP rank of it holds the same dp-reduced loss)."""
    for rank in sorted(results):
        r = results[rank]
        if isinstance(r, Mapping) and r.get("losses") and all(x.get("loss") is not None for x in r["losses"]):
            return {"losses": r["losses"], "val_losses": r.get("val_losses", []), "final": r.get("final", {}),
                    "resumed_from": r.get("resumed_from"), "reported_by": rank}
    return {"losses": [], "val_losses": [], "final": {}, "reported_by": None}


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
    order = sorted(by_kind, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k))
    first = next((r for r in results.values() if isinstance(r, Mapping)), {})
    return {
        "comm": [row for kind in order for row in _kind_rows(kind, by_kind[kind])],
        "size_bytes": first.get("size_bytes"),
        "iters": first.get("iters"),
    }
