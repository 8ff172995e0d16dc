"""The job page: a static shell, and the live fragment that dashboard.js fetches every second and swaps in.

The fragment holds the state, the step figures, the loss and throughput charts (``charts``), the rank
grid (``grid``), the newest notable events and the attempt history; everything in it is bounded.
"""

from __future__ import annotations

from typing import Any, Mapping

from rankctl.coordinator.model.states import is_terminal
from rankctl.coordinator.web.charts import Series, line_chart
from rankctl.coordinator.web.html import age, e, job_href, number, page, state_badge, table
from rankctl.coordinator.web.series import Snapshot
from rankctl.kinds import registry
from rankctl.kinds.figures import Figure, charts_of, described

REASON_SHOWN = 4000   # characters of an attempt's reason shown
LOG_TAIL = 50         # lines of a rank's log shown
LINE_CHARS = 2000     # characters of one log line shown


def charts(series: Snapshot, figures: Mapping[str, Figure]) -> str:
    """A chart per chart the job's kind describes, a line per figure on it (``kinds.figures``)."""
    drawn = [line_chart(chart, [Series(f.line or name, series.line(name), f.label or name) for name, f in lines])
             for chart, lines in charts_of(figures).items()]
    return '<div class="charts">' + "".join(f"<figure>{svg}</figure>" for svg in drawn) + "</div>"


def figures_list(summary: Any, series: Snapshot, figures: Mapping[str, Figure]) -> str:
    """The step, then each figure the job's kind describes (a sparse one: its latest), the step times, the ranks."""
    m = series.latest or summary.metrics or {}
    shown = []
    for name, f in figures.items():
        value = m.get(name)
        if value is None and f.sparse and series.line(name):
            value = series.line(name)[-1][1]
        shown.append((f.label or name, number(value)))
    items = [("step", f"{summary.min_step} (fastest {summary.max_step})"), ("step events", str(series.step_events)),
             *shown,
             ("step time", f"{number(m.get('step_time_min'), ' s')} – {number(m.get('step_time_max'), ' s')}"),
             ("ranks", f"{summary.running} running, {summary.exited} exited, {summary.failed} failed")]
    return '<dl class="figures">' + "".join(f"<dt>{e(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def kind_figures(kind: str) -> dict[str, Figure]:
    """The figures the job's kind describes (none for a kind no longer registered)."""
    known = registry.kinds().get(kind)
    return {name: f for name, f in described(known.figures).items() if f.label or f.chart} if known else {}


def attempts_table(attempts: list[dict], now: float) -> str:
    rows = []
    for a in reversed(attempts):
        reason = a.get("reason") or ""
        cls = "hang-reason" if reason.startswith("hang") else ""
        took = (a.get("finished_at") or now) - (a.get("started_at") or now)
        state = (a.get("state") or "ended") if a.get("finished_at") else "current"
        rows.append([str(a.get("attempt")), e(state), age(took),
                     f'<span class="{cls}">{e(reason[:REASON_SHOWN])}</span>'])
    return table(["attempt", "state", "ran", "reason"], rows, "attempts")


def notes(series: Snapshot, now: float) -> str:
    items = [f'<li class="ev-{e(kind)}"><span class="age">{age(now - ts)} ago</span> {e(kind)}: {e(msg)}</li>'
             for ts, kind, msg in reversed(series.notes)]
    return f'<ul id="events">{"".join(items)}</ul>'


def live_fragment(job: Any, summary: Any, series: Snapshot, grid_html: str, attempts: list[dict],
                  reason: str, now: float) -> str:
    done, shown = "1" if is_terminal(job.state) else "0", kind_figures(job.kind)
    hang = ' class="hang-reason"' if reason.startswith("hang") else ""
    return (f'<div id="live-body" data-state="{e(job.state.value)}" data-terminal="{done}" '
            f'data-step-events="{series.step_events}">'
            f'<p>{state_badge(job.state.value)} attempt {job.attempt} · <span{hang}>{e(reason)}</span></p>'
            f'<div class="row"><div>{figures_list(summary, series, shown)}</div><div><h2>ranks</h2>{grid_html}</div>'
            f'</div>{charts(series, shown)}<h2>attempts</h2>{attempts_table(attempts, now)}'
            f'<h2>recent events</h2>{notes(series, now)}</div>')


def job_page(job: Any, fragment: str, who: str, now: float) -> str:
    head = table(["id", "name", "kind", "world", "nodes", "submitted by", "age"],
                 [[e(job.id), e(job.name), e(job.kind), str(job.world_size), str(len(job.nodes)),
                   e(job.submitted_by or "–"), age(now - job.created_at)]])
    logs = (f'<section id="log-panel"><h2>log of rank <span id="log-rank">0</span></h2>'
            f'<form id="log-form" action="{job_href(job.id, "/logs")}"><label>rank '
            f'<input name="rank" type="number" min="0" max="{job.world_size - 1}" value="0"></label>'
            f'<button>show last {LOG_TAIL} lines</button> (or click a rank)</form><pre id="log-lines"></pre></section>')
    live = f'<div id="live" data-src="{job_href(job.id, "/live")}">{fragment}</div>'
    return page(f"job {job.id}", head + live + logs, who, script=True)


def log_text(rank: int, lines: list[str]) -> str:
    return "\n".join(line[:LINE_CHARS] for line in lines) or f"(rank {rank} has written nothing yet)"


def job_data(job: Any, summary: Any, series: Snapshot) -> dict:
    """The JSON twin of the live fragment (``/jobs/<id>/data.json``): for scripts and tests. ``loss_points`` and
    ``plotted``: of the main line (the first charted figure: train's loss), ``lines``: points plotted per figure."""
    main = next((name for lines in charts_of(kind_figures(job.kind)).values() for name, _ in lines), "")
    return {"id": job.id, "state": job.state.value, "attempt": job.attempt, "world_size": job.world_size,
            "step_events": series.step_events, "loss_points": series.seen.get(main, 0),
            "plotted": len(series.line(main)), "lines": {name: len(points) for name, points in series.lines.items()},
            "min_step": summary.min_step, "max_step": summary.max_step, "metrics": series.latest,
            "stragglers": list(summary.stragglers), "slow": [s.as_dict() for s in summary.slow],
            "failing": [r.rank for r in summary.failing]}
