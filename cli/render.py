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
    if job.kind == "train":
        result = out["result"] or {}
        out["losses"] = result.get("losses", []) if isinstance(result, dict) else []
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


def comm_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """comm-check rows (one per kind and op) pivoted to one row per kind, readable units."""
    by_kind: dict[str, dict[str, Any]] = {}
    for r in rows:
        out = by_kind.setdefault(r["kind"], {"kind": r["kind"], "groups x size": f"{r['groups']} x {r['size']}"})
        op = {"allreduce": "all-reduce", "allgather": "all-gather"}.get(r.get("op", ""), r.get("op", ""))
        out[f"{op} us (mean/max)"] = f"{r['mean_us']:.0f} / {r['max_us']:.0f}"
        out[f"{op} busbw GB/s (min)"] = f"{r['min_busbw_gbps']:.3g}"
    return list(by_kind.values())


def result_tables(result: Any) -> list:
    """Tables found in a job result: any list of dicts under a key becomes one table."""
    if not isinstance(result, dict):
        return []
    tables = []
    final = result.get("final")
    if isinstance(final, dict) and isinstance(final.get("expert_tokens"), dict) and final["expert_tokens"]:
        tables.append(rows_table(f"expert load balance (step {final.get('step', '?')}, tokens per expert)",
                                 expert_rows(final["expert_tokens"])))
    for key, value in result.items():
        if not (isinstance(value, list) and value and all(isinstance(r, dict) for r in value)):
            continue
        if key == "comm" and "min_busbw_gbps" in value[0]:
            size = result.get("size_bytes")
            title = f"comm-check per kind ({size} bytes per rank)" if size else "comm-check per kind"
            tables.append(rows_table(title, comm_rows(value)))
        elif key in ("losses", "val_losses"):
            tables.append(rows_table(f"{key.replace('_', ' ')} ({len(value)} steps)", _sample(value, 12)))
        else:
            tables.append(rows_table(key, value))
    return tables


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
    progress = train_progress(job)
    if progress is not None:
        parts.append(progress)
    if ranks:
        parts.append(rows_table("ranks", ranks))
    parts += result_tables(d["result"])
    return Group(*parts)


def train_progress(job: pb.Job):
    """A progress bar with the current loss and tokens/s, from the ranks' latest metrics."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    if job.kind != "train":
        return None
    steps = (_loads(job.spec_json) or {}).get("train", {}).get("steps", 0)
    latest = _latest_metrics(job)
    if not steps or latest is None:
        return None
    step, m = latest
    grid = Table.grid(padding=(0, 1))
    grid.add_row(f"step {step}/{steps}", ProgressBar(total=steps, completed=step, width=30),
                 f"loss {m.get('loss', float('nan')):.4f}", f"{m.get('tokens_per_s', 0):,.0f} tok/s",
                 f"lr {m.get('lr', 0):.2e}")
    return grid


def _latest_metrics(job: pb.Job) -> tuple[int, dict] | None:
    """(step, metrics) of the lowest rank that reports a loss (a last pipeline stage)."""
    for r in sorted(job.ranks, key=lambda r: r.rank):
        m = _loads(r.metrics_json) or {}
        if isinstance(m, dict) and isinstance(m.get("loss"), (int, float)):
            return r.step, m
    return None


def _state_style(state: str) -> str:
    return {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan"}.get(state, "")


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def stdout_console():
    from rich.console import Console

    return Console()
