"""The rank grid of a job: nodes x slots, one cell per rank, a page of nodes at a time.

A cell's fill is its rank's phase (``fill``: waiting, running, done; stopped for a rank its daemon stopped
when the attempt ended; red only for a failed rank, as the figures count them), a stripe on top its pipeline
stage; it sits in a box with the other members of its tp group on that node. Stragglers (behind on steps
or slow to compute), failed ranks and the ranks a hang points at (while it lasts: stopped, or holding
collective-wait evidence; once judged: the ranks its reason names) are marked. At most ``MAX_CELLS`` cells per page, so the HTML of a poll is bounded whatever the job's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rankctl.coordinator.diagnosis.progress import is_failed, stopped_on_request
from rankctl.coordinator.web.html import e
from rankctl.parallel.layout import ParallelConfig
from rankctl.parallel.placement import ranks_of_node

MAX_CELLS = 256
WAITING = '"in":true'  # a rank's collective evidence says it is blocked in a group (coordinator.hangs)
FILLS = {"running": "running", "done": "done", "exited": "done", "failed": "failed"}  # phase -> fill; else waiting
STAGE_HUES = (170, 260)  # the stage stripe's hues, first stage to last: teal to indigo, never the failed red
SHORT = {"pending": "pend", "starting": "start", "rendezvous": "rdzv", "running": "run"}  # phases as cells show them


@dataclass(frozen=True)
class Window:
    """Which job nodes a grid page shows: ``first`` .. ``first + count - 1`` of ``total``."""

    page: int
    pages: int
    first: int
    count: int
    total: int
    slots: int = 1

    @property
    def ranks(self) -> tuple[int, int]:
        """(offset, limit) of the ranks shown, for ``core.rank_page``."""
        return self.first * self.slots, self.count * self.slots


def window(world_size: int, slots: int, page: int) -> Window:
    per = max(1, MAX_CELLS // max(1, slots))
    total = max(1, world_size // max(1, slots))
    pages = -(-total // per)
    page = min(max(0, page), pages - 1)
    first = page * per
    return Window(page=page, pages=pages, first=first, count=min(per, total - first), total=total, slots=slots)


def _tp_first(cfg: ParallelConfig | None, rank: int) -> int:
    """The lowest member of ``rank``'s tp group (its own rank without a layout)."""
    if cfg is None:
        return rank
    grid = cfg.dense_grid
    k = grid.tokens.index("tp")
    d = grid.strides[k]
    return rank - ((rank // d) % grid.sizes[k]) * d


def marks(summary: Any, records: list[Any]) -> dict[int, str]:
    """rank -> extra CSS classes: ``straggler``, ``failed``, ``hang``."""
    out: dict[int, set[str]] = {}
    for r in summary.stragglers:
        out.setdefault(r, set()).add("straggler")
    for s in summary.slow:
        out.setdefault(s.rank, set()).add("straggler")
    for r in summary.failing:
        out.setdefault(r.rank, set()).add("failed")
    pointed = set(summary.hang)
    for rec in records:
        if _hang_points_at(rec, pointed):
            out.setdefault(rec.rank, set()).add("hang")
    return {r: " ".join(sorted(c)) for r, c in out.items()}


def _hang_points_at(rec: Any, pointed: set[int]) -> bool:
    """Once a hang was judged, the ranks its reason names (``pointed``: the one the others waited for, though
    every rank has exited since); before, a live rank that is stopped or says it waits in a collective."""
    if pointed:
        return rec.rank in pointed
    return not rec.exited and (rec.process == "stopped" or WAITING in rec.collectives)


def fill(rec: Any) -> str:
    """The cell's fill: ``stopped`` (its daemon stopped it when the attempt ended: ``progress.stopped_on_request``),
    ``failed`` (``progress.is_failed``, or the failed phase), else by phase."""
    if stopped_on_request(rec):
        return "stopped"
    return "failed" if is_failed(rec) or rec.phase == "failed" else FILLS.get(rec.phase, "waiting")


def stage_hue(pp_rank: int, pp: int) -> int:
    lo, hi = STAGE_HUES
    return lo + (hi - lo) * pp_rank // max(1, pp - 1)


def _cell(rec: Any, cfg: ParallelConfig | None, flags: str) -> str:
    c = cfg.dense_grid.coords(rec.rank) if cfg else {"pp": 0, "tp": 0, "dp": 0}
    hue, look = stage_hue(c["pp"], cfg.pp) if cfg else STAGE_HUES[0], fill(rec)
    title = (f"rank {rec.rank} on {rec.node or '-'} · pp {c['pp']} tp {c['tp']} dp {c['dp']} · {rec.phase}"
             f" · step {rec.step}{' · ' + flags if flags else ''}")
    return (f'<span class="rank-cell fill-{look} ph-{e(rec.phase)} {flags}" data-rank="{rec.rank}" '
            f'data-pp="{c["pp"]}" data-phase="{e(rec.phase)}" data-fill="{look}" style="--hue:{hue}" '
            f'title="{e(title)}">'
            f'<b>{rec.rank}</b><i>{e(SHORT.get(rec.phase, rec.phase[:6]))}</i></span>')


def _node_row(k: int, name: str, recs: list[Any], cfg: ParallelConfig | None, flags: dict[int, str]) -> str:
    boxes, current, group = [], None, []
    for rec in recs:
        first = _tp_first(cfg, rec.rank)
        if first != current and group:
            boxes.append(f'<span class="tp-group" data-tp-group="{current}">{"".join(group)}</span>')
            group = []
        current = first
        group.append(_cell(rec, cfg, flags.get(rec.rank, "")))
    if group:
        boxes.append(f'<span class="tp-group" data-tp-group="{current}">{"".join(group)}</span>')
    return f'<div class="node-row"><span class="node-name">{k}: {e(name or "-")}</span>{"".join(boxes)}</div>'


def rank_grid(job: Any, cfg: ParallelConfig | None, records: list[Any], summary: Any, win: Window) -> str:
    """The grid of ``win``'s nodes; ``records`` are the ranks of that window, in rank order."""
    flags = marks(summary, records)
    by_rank = {r.rank: r for r in records}
    rows = []
    for k in range(win.first, win.first + win.count):
        recs = [by_rank[r] for r in ranks_of_node(k, win.slots) if r in by_rank]
        rows.append(_node_row(k, job.nodes[k] if k < len(job.nodes) else "", recs, cfg, flags))
    pager = ""
    if win.pages > 1:
        links = [f'<a href="?page={p}" data-page="{p}"{" class=cur" if p == win.page else ""}>{p + 1}</a>'
                 for p in sorted({0, max(0, win.page - 1), win.page, min(win.pages - 1, win.page + 1), win.pages - 1})]
        pager = (f'<nav class="pager">nodes {win.first}–{win.first + win.count - 1} of {win.total}: '
                 f'{" ".join(links)}</nav>')
    stages = f"{cfg.pp} pipeline stage(s), tp groups of {cfg.tp}" if cfg else "layout unknown"
    key = " ".join(f'<span class="key fill-{f}">{f}</span>' for f in ("waiting", "running", "done", "stopped",
                                                                        "failed"))
    return (f'<section id="rank-grid" data-cells="{len(records)}" data-page="{win.page}">'
            f'<p class="legend">{stages} (the top stripe); fill: {key}; outline: straggler · failed · hang</p>'
            f'{pager}{"".join(rows)}</section>')
