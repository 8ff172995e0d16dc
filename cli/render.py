"""Rendering for ``ctl``: protobuf messages to plain dicts (the JSON contract) and rich tables."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from typing import Any

from rankctl.proto import rankctl_pb2 as pb

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def state_name(state: int) -> str:
    return pb.JobState.Name(state)


def _loads(text: str) -> Any:
    return json.loads(text) if text else None


def job_to_dict(job: pb.Job) -> dict[str, Any]:
    """The documented ``ctl status --json`` shape (ARCHITECTURE.md, Status and results)."""
    out: dict[str, Any] = {
        "id": job.id,
        "name": job.name,
        "kind": job.kind,
        "state": state_name(job.state),
        "reason": job.reason,
        "attempt": job.attempt,
        "world_size": job.world_size,
        "created_at": job.created_at,
        "finished_at": job.finished_at or None,
        "nodes": list(job.nodes),
        "ranks": [{"rank": r.rank, "node": r.node, "state": r.phase, "step": r.step,
                   **({"exit_code": r.exit_code} if r.exited else {}),
                   **({"error": r.error} if r.error else {})} for r in job.ranks],
        "result": _loads(job.result_json),
    }
    summary = _hook(job.kind, "summary")
    if summary is not None:
        out.update(summary(out["result"]))
    return out


def node_to_dict(node: pb.Node) -> dict[str, Any]:
    hw = node.hardware
    return {
        "name": node.name,
        "address": node.address,
        "slots": node.slots,
        "free_slots": node.free_slots,
        "state": pb.NodeState.Name(node.state),
        "last_seen": node.last_seen,
        "rejected_reports": node.rejected_reports,
        "gpus": [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes} for g in hw.gpus],
        "hostname": hw.hostname,
    }


def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def when(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def rows_table(title: str, rows: list[dict[str, Any]]):
    """A rich Table from a list of uniform dicts (column order from the first row)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    cols = list(rows[0]) if rows else []
    for c in cols:
        table.add_column(str(c), justify="right" if isinstance(rows[0][c], (int, float)) else "left")
    for row in rows:
        table.add_row(*[_cell(row.get(c)) for c in cols])
    return table


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    if isinstance(v, list):
        return ",".join(map(str, v)) if len(v) <= 8 else f"{v[0]}..{v[-1]} ({len(v)})"
    return "-" if v is None else str(v)


def _hook(kind: str, name: str):
    """A kind's rendering hook (``kinds.registry.JobKind``), or None (unknown kind, no hook)."""
    from rankctl.kinds import registry

    try:
        return registry.get(kind).resolve(name)
    except ValueError:
        return None


def result_tables(result: Any, kind: str = "") -> list:
    """The kind's tables, then one table per other list of dicts in the result."""
    if not isinstance(result, dict):
        return []
    kind_tables = _hook(kind, "tables")
    pairs = kind_tables(result, rows_table) if kind_tables else []
    done = {key for key, _ in pairs}
    tables = [table for _, table in pairs]
    for key, value in result.items():
        if key not in done and isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            tables.append(rows_table(key, value))
    return tables


def job_view(job: pb.Job, max_ranks: int = 64):
    """Summary, per-rank table and result tables of one job, as a rich renderable group."""
    from rich.console import Group
    from rich.text import Text

    d = job_to_dict(job)
    head = Text.assemble(
        (f"{d['id']}  ", "bold"), (d["state"], _state_style(d["state"])),
        f"  attempt {d['attempt']}  world {d['world_size']}  nodes {', '.join(d['nodes']) or '-'}\n",
        f"reason: {d['reason'] or '-'}",
    )
    ranks = [{"rank": r["rank"], "node": r["node"], "phase": r["state"], "step": r["step"],
              "exit": r.get("exit_code", "")} for r in d["ranks"][:max_ranks]]
    parts = [head]
    progress_fn = _hook(job.kind, "progress")
    progress = progress_fn(job) if progress_fn else None
    if progress is not None:
        parts.append(progress)
    if ranks:
        parts.append(rows_table("ranks", ranks))
    parts += result_tables(d["result"], job.kind)
    return Group(*parts)


def _state_style(state: str) -> str:
    return {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan"}.get(state, "")


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def stdout_console():
    from rich.console import Console

    return Console()
