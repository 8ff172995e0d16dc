"""Rendering for ``ctl``: protobuf messages to plain dicts (the JSON contract) and rich tables."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from rankctl.contract.preflight import line as preflight_line
from rankctl.coordinator.model.states import TERMINAL as TERMINAL_STATES
from rankctl.proto import from_struct, short_name
from rankctl.proto import rankctl_pb2 as pb

TERMINAL = frozenset(s.value for s in TERMINAL_STATES)   # the state names a job ends in (one definition)


def state_name(state: int) -> str:
    """``RUNNING`` for ``JOB_STATE_RUNNING``."""
    return short_name(pb.JobState, state)


def node_state_name(state: int) -> str:
    """``READY`` for ``NODE_STATE_READY``."""
    return short_name(pb.NodeState, state)


def seconds(ts: Timestamp) -> float | None:
    """A Timestamp as unix seconds, None when unset (ctl's JSON has always shown times so)."""
    return ts.seconds + ts.nanos / 1e9 if ts.seconds or ts.nanos else None


def metrics_dict(metrics: Any) -> dict[str, Any]:
    """A ``map<string, double>`` of metrics as a dict; ``step`` is a whole number."""
    return {k: int(v) if k == "step" else v for k, v in metrics.items()}


def failure_to_dict(f) -> dict:  # noqa: ANN001 - pb.Failure
    """An attempt's typed failure: cause, node, and rank, exit code and step where it has them (else null)."""
    return {"cause": f.cause, "node": f.node or None, "rank": f.rank if f.HasField("rank") else None,
            "exit_code": f.exit_code if f.HasField("exit_code") else None,
            "step": f.step if f.HasField("step") else None}


def job_to_dict(job: pb.Job) -> dict[str, Any]:
    """The documented ``ctl status --json`` shape (docs/adr/0014-status-and-results.md).

    ``ranks`` holds the ranks the job message carries (one page of a large job); when that is
    not the whole world, ``ranks_shown`` says which ({"first", "last"}) and ``next_rank_offset``
    where the next page starts (null: no more). ``summary`` is null from a coordinator without one.
    """
    out: dict[str, Any] = {
        "id": job.id,
        "name": job.name,
        "kind": job.kind,
        "state": state_name(job.state),
        "reason": job.reason,
        "attempt": job.attempt,
        "world_size": job.world_size,
        "created_at": seconds(job.create_time) or 0.0,
        "finished_at": seconds(job.finish_time),
        "stopping": job.stopping,
        "submitted_by": job.submitted_by,
        "nodes": list(job.nodes),
        "node_count": job.node_count,
        "ranks": [rank_to_dict(r) for r in job.ranks],
        "summary": summary_to_dict(job.summary) if job.HasField("summary") else None,
        "attempts": [{"attempt": a.attempt, "state": a.state or None, "reason": a.reason or None,
                      "started_at": seconds(a.start_time) or 0.0, "finished_at": seconds(a.finish_time),
                      "nodes": a.nodes or None, "world_size": a.world_size or None, "layout": a.layout or None,
                      "failure": failure_to_dict(a.failure) if a.HasField("failure") else None}
                     for a in job.attempts],
        "result": from_struct(job.result) if job.HasField("result") else None,
        "allocation": allocation_to_dict(job.allocation) if job.HasField("allocation") else None,
    }
    if len(job.ranks) < job.world_size:
        first = job.rank_offset
        out["ranks_shown"] = {"first": first, "last": first + len(job.ranks) - 1} if job.ranks else None
        out["next_rank_offset"] = job.next_rank_offset or None
    summary = _hook(job.kind, "summary")
    if summary is not None:
        out.update(summary(out["result"]))
    return out


def allocation_to_dict(a: pb.Allocation) -> dict[str, Any]:
    """The allocation a job is pinned to (``ctl slurm submit``): the scheduler's job id, state and nodes."""
    return {"scheduler": a.request.scheduler, "id": a.id or None, "state": a.state, "nodes": list(a.nodes),
            "pool": a.pool, "number": a.number, "spares": a.request.spares, "output": a.output or None}


def rank_to_dict(r: pb.RankStatus) -> dict[str, Any]:
    return {"rank": r.rank, "node": r.node, "state": r.phase, "step": r.step,
            **({"exit_code": r.exit_code} if r.exited else {}), **({"error": r.error} if r.error else {})}


def summary_to_dict(s: pb.JobSummary) -> dict[str, Any]:
    return {"phases": dict(s.phases), "running": s.running, "exited": s.exited, "failed": s.failed,
            "min_step": s.min_step, "max_step": s.max_step, "stragglers": list(s.stragglers),
            "failing": [rank_to_dict(r) for r in s.failing], "metrics": metrics_dict(s.metrics),
            "reports": s.reports, "slow": [slow_to_dict(r) for r in s.slow],
            "preflight": {"ms": dict(s.preflight_ms), "note": s.preflight_note}, "stall": s.stall}


def slow_to_dict(r: pb.SlowRank) -> dict[str, Any]:
    """A straggler by compute time: its last step's compute, its peers' median then, over steps in a row."""
    return {"rank": r.rank, "node": r.node, "compute_s": r.compute_s, "median_s": r.median_s, "steps": r.steps}


def last_line(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return lines[-1] if lines else "no error reported"


def apply_batch(job: pb.Job, batch: pb.JobEventBatch) -> None:
    """Bring a displayed job up to a WatchJobBatches batch: its events, then the state and summary it carries."""
    for event in batch.events:
        apply_event(job, event)
    job.state, job.reason, job.attempt = batch.state, batch.reason, batch.attempt
    if batch.HasField("summary"):
        job.summary.CopyFrom(batch.summary)


def apply_event(job: pb.Job, event: pb.JobEvent) -> None:
    """Bring a displayed job up to one event: state, reason, the rank it names (if in the page), the step."""
    job.state = event.state
    if event.kind in ("transition", "waiting"):
        job.reason = event.message
    elif event.kind == "rank" and event.HasField("rank"):
        apply_rank(job, event.rank)
    elif event.kind == "step":  # every rank has finished event.step
        for r in job.ranks:
            r.step = max(r.step, event.step)
        job.summary.min_step = max(job.summary.min_step, event.step)
        job.summary.max_step = max(job.summary.max_step, event.step)
        if event.metrics:
            job.summary.metrics.clear()
            job.summary.metrics.update(event.metrics)


def apply_rank(job: pb.Job, status: pb.RankStatus) -> None:
    """A rank event's status onto the ranks of the page it names: ``status.rank`` alone, or the ``status.ranks``
    from it (one event for a node's ranks that reported alike); each keeps the higher step."""
    first = max(status.rank, job.rank_offset)
    last = min(status.rank + max(status.ranks, 1), job.rank_offset + len(job.ranks))
    for rank in range(first, last):
        shown = job.ranks[rank - job.rank_offset]
        if shown.rank == rank:
            step = max(shown.step, status.step)
            shown.CopyFrom(status)
            shown.rank, shown.step, shown.ranks = rank, step, 0


def node_to_dict(node: pb.Node) -> dict[str, Any]:
    hw = node.hardware
    return {
        "name": node.name,
        "address": node.address,
        "slots": node.slots,
        "free_slots": node.free_slots,
        "state": node_state_name(node.state),
        "last_seen": seconds(node.last_seen_time) or 0.0,
        "rejected_reports": node.rejected_reports,
        "draining": node.draining,
        "excluded_for": list(node.excluded_for),
        "gpus": [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes} for g in hw.gpus],
        "hostname": hw.hostname,
        "pool": node.pool,     # the allocation or worker pool it was started for ("": none)
        "jobs": list(node.jobs),   # the jobs holding slots on it (running, or ended with ranks not yet gone)
    }


def when(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def rows_table(title: str, rows: list[dict[str, Any]]):
    """A rich Table from a list of uniform dicts (column order from the first row)."""
    from rich.table import Table

    from rich.text import Text

    table = Table(title=title, title_justify="left", min_width=len(title))  # as wide as its title: never wrapped
    cols = list(rows[0]) if rows else []
    for c in cols:
        table.add_column(str(c), justify="right" if isinstance(rows[0][c], (int, float)) else "left")
    for row in rows:  # Text: a reason such as "[rank 3] ..." is data, never rich markup
        table.add_row(*[Text(_cell(row.get(c))) for c in cols])
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


def _allocation_line(a: dict[str, Any] | None) -> str:
    if a is None:
        return ""
    nodes = f" on {_nodes_text(a['nodes'])}" if a["nodes"] else ""
    output = f"; batch output {a['output']}" if a["output"] else ""
    return (f"allocation: {a['scheduler']} job {a['id'] or '(not submitted yet)'} ({a['state']}){nodes}, "
            f"{a['spares']} spare(s){output}\n")


def resumed_line(d: dict[str, Any]) -> str:
    """"\nresumed from step 40 (checkpoint of tp2 dp2, resharded to tp1 dp4)" when the job's result says it resumed
    (step N: the checkpoint saved after step N; the run went on with step N + 1); "" otherwise."""
    result = d.get("result")
    step = result.get("resumed_from") if isinstance(result, dict) else None
    if not isinstance(step, (int, float)) or isinstance(step, bool):
        return ""
    was, now = result.get("resumed_layout"), (d["attempts"][-1]["layout"] if d["attempts"] else None)
    how = f" (checkpoint of {was}, resharded to {now or 'this layout'})" if isinstance(was, str) and was else ""
    return f"\nresumed from step {int(step)}{how}"


def job_view(job: pb.Job, max_ranks: int = 64, results: bool = True):
    """Head, summary, progress, per-rank table (at most ``max_ranks``; 0: none) and result tables (unless not
    ``results``), as one renderable."""
    from rich.console import Group
    from rich.text import Text

    d = job_to_dict(job)
    head = Text.assemble(
        (f"{d['id']}  ", "bold"), (d["state"], _state_style(d["state"])),
        f"  attempt {d['attempt']}  world {d['world_size']}  nodes {_nodes_text(d['nodes'])}\n",
        f"submitted by: {d['submitted_by']}\n" if d["submitted_by"] else "",
        _allocation_line(d["allocation"]),
        f"reason: {d['reason'] or '-'}",
        resumed_line(d),
    )
    parts: list[Any] = [head]
    if d["summary"] is not None:
        parts.append(summary_text(d["summary"], d["world_size"]))
    progress_fn = _hook(job.kind, "progress")
    progress = progress_fn(job) if progress_fn else None
    if progress is not None:
        parts.append(progress)
    ended = [a for a in d["attempts"] if a["state"]]
    if len(d["attempts"]) > 1 or (ended and ended[-1]["state"] == "RESTARTING"):
        parts.append(rows_table("attempts", [{"attempt": a["attempt"], "ended": a["state"] or "running",
                                              "ranks": f"{a['world_size']} ({a['layout']})" if a["world_size"] else "",
                                              "reason": (a["reason"] or "")[:ERROR_LINE_MAX]}
                                             for a in d["attempts"]]))
    if max_ranks:
        parts += rank_parts(d, max_ranks)
    if results:
        parts += result_tables(d["result"], job.kind)
    return Group(*parts)


def rank_parts(d: dict[str, Any], max_ranks: int) -> list:
    """The per-rank table of a job's dict (at most ``max_ranks`` rows), the range it shows, contained ranks."""
    from rich.text import Text

    shown, parts = d["ranks"][:max_ranks], []
    if shown:
        rows = [{"rank": r["rank"], "node": r["node"], "phase": r["state"], "step": r["step"],
                 "exit": r.get("exit_code", "")} for r in shown]
        parts.append(rows_table("ranks", rows))
        if len(shown) < d["world_size"]:
            parts.append(Text(f"showing ranks {shown[0]['rank']}-{shown[-1]['rank']} of {d['world_size']}; "
                              f"`ctl status {d['id']} --ranks A-B` for more", style="dim"))
    contained = [r for r in shown if r.get("exit_code") == 0 and LEFTOVERS in (r.get("error") or "")]
    for r in contained[:FAILING_SHOWN]:  # exit 0, yet its processes had to be killed (worker containment)
        parts.append(Text(f"rank {r['rank']} on {r['node'] or '-'}: {last_line(r['error'])[:ERROR_LINE_MAX]}",
                          style="yellow"))
    return parts


LIVE_SPARE_LINES = 2   # lines a live view leaves free below it on a terminal
TABLE_LINES = 5        # a rank table's lines besides its rows (title, borders, header)


def live_view(job: pb.Job, console: Any, height: int | None, max_ranks: int = 64):
    """What ``ctl watch`` and ``ctl up`` redraw while a job runs: ``job_view`` without result tables, with as
    many ranks as fit ``height`` lines (None: not a terminal, ``max_ranks``). Never taller than the terminal."""
    from rich.console import Group

    full = job_view(job, max_ranks=0, results=False)
    if height is None:
        return job_view(job, max_ranks=max_ranks, results=False)
    used = len(console.render_lines(full, console.options, pad=False))
    fit = max(0, min(max_ranks, height - used - TABLE_LINES - 1 - LIVE_SPARE_LINES))
    return Group(full, *rank_parts(job_to_dict(job), fit)) if fit else full


NODES_NAMED = 8       # node names in a job's head line; the rest are counted
FAILING_SHOWN = 4     # failing ranks in a job's view, each with its error's last line ...
SLOW_SHOWN = 4        # stragglers by compute time in a job's view (the summary carries the worst 16)
ERROR_LINE_MAX = 160  # ... cut to this many characters
LEFTOVERS = "leftover process"  # the daemon's note on a rank whose processes outlived it (worker/launcher/forker.py)


def _nodes_text(nodes: list[str]) -> str:
    if len(nodes) <= NODES_NAMED:
        return ", ".join(nodes) or "-"
    return f"{', '.join(nodes[:NODES_NAMED])}, ... ({len(nodes)} nodes)"


def _few(ranks: list[int], shown: int = 8) -> str:
    more = len(ranks) - shown
    return ", ".join(map(str, ranks[:shown])) + (f" (+{more} more)" if more > 0 else "")


def slow_text(r: dict[str, Any]) -> str:
    """One straggler by compute time, as ``ctl status`` shows it."""
    ratio = f" ({r['compute_s'] / r['median_s']:.1f}x)" if r["median_s"] > 0 else ""
    return (f"straggler: rank {r['rank']} on {r['node'] or '-'}: compute {r['compute_s']:.3f} s per step vs "
            f"median {r['median_s']:.3f} s of its peers{ratio}, {r['steps']} step(s) over")


def summary_text(s: dict[str, Any], world: int):
    """Ranks per phase, the step spread, stragglers and failing ranks (one line each)."""
    from rich.text import Text

    phases = "  ".join(f"{phase} {n}" for phase, n in sorted(s["phases"].items(), key=lambda kv: -kv[1]) if n)
    text = Text(f"ranks: {phases or '-'}  (running {s['running']}, exited {s['exited']}, failed {s['failed']} "
                f"of {world})")
    if s["max_step"]:  # a job without steps (comm-check, a script) has no step line
        text.append(f"\nsteps: {s['min_step']}-{s['max_step']}")
    if s["stragglers"]:
        text.append(f"  stragglers at step {s['min_step']}: {_few(s['stragglers'])}")
    if s.get("preflight", {}).get("ms"):
        text.append(f"\npre-flight: {preflight_line(s['preflight']['ms'], s['preflight'].get('note', ''))}")
    if s.get("stall"):
        text.append(f"\nstall: {s['stall']}", style="yellow")
    for r in s["slow"][:SLOW_SHOWN]:
        text.append(f"\n{slow_text(r)}", style="yellow")
    if len(s["slow"]) > SLOW_SHOWN:
        text.append(f"\n... {len(s['slow']) - SLOW_SHOWN} more straggler(s) by compute; `--json` lists "
                    f"the worst {len(s['slow'])}", style="yellow")
    for r in s["failing"][:FAILING_SHOWN]:
        line = last_line(r.get("error", ""))
        line = line if len(line) <= ERROR_LINE_MAX else line[:ERROR_LINE_MAX - 1] + "…"
        text.append(f"\nfailing: rank {r['rank']} on {r['node'] or '-'} (exit {r.get('exit_code', '-')}): {line}",
                    style="red")
    if s["failed"] > FAILING_SHOWN:
        text.append(f"\n... {s['failed'] - FAILING_SHOWN} more failed rank(s); `--json` lists the lowest "
                    f"{len(s['failing'])} with their errors", style="red")
    return text


def _state_style(state: str) -> str:
    return {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan"}.get(state, "")

