"""The jobs list, the nodes page and the plan page (pure: records in, HTML out)."""

from __future__ import annotations

from typing import Any

from rankctl.coordinator.web.html import age, e, job_href, state_badge, table
from rankctl.coordinator.web.layouts import layout_text
from rankctl.parallel.placement import INTRA_NODE_GROUPS

JOBS_PAGE = 50
NODES_PAGE = 200
PLAN_NODES_SHOWN = 16    # nodes of a plan's placement listed
PLAN_GROUPS_SHOWN = 8    # groups listed per kind
GPUS_SHOWN = 16          # GPUs listed per node
UNSET = "—"              # a figure the node has not reported
GIB = 1 << 30
NODE_COLUMNS = ("name", "address", "state", "slots", "free", "draining", "cpu", "memory", "gpus", "heartbeat", "detail")


def jobs_table(jobs: list[Any], layouts: dict[str, Any], cursor: int, now: float) -> str:
    rows = [[f'<a href="{job_href(j.id)}">{e(j.id)}</a>', e(j.name), state_badge(j.state.value),
             age(now - j.created_at), e(layout_text(layouts.get(j.id))), f"{j.world_size:,}",
             e(j.submitted_by or "–")] for j in jobs]
    more = f'<nav class="pager"><a href="/?before={cursor}">older jobs</a></nav>' if cursor else ""
    empty = "" if jobs else "<p>no jobs yet (ctl submit JOB.yaml)</p>"
    return table(["id", "name", "state", "age", "layout", "world", "submitted by"], rows, "jobs") + empty + more


def _gib(used: int, total: int) -> str:
    return f"{used / GIB:.1f} / {total / GIB:.1f} GiB" if total > 0 else UNSET


def _gpu(g: Any) -> str:
    return f"{g.index}: {g.utilization:.0f}% · {_gib(g.memory_used_bytes, g.memory_total_bytes)}"


def usage_cells(usage: Any) -> list[str]:
    """CPU %, memory and GPU use of a node's last heartbeat (``pb.NodeUsage``; None: not reported yet)."""
    if usage is None:
        return [UNSET] * 3
    gpus = [e(_gpu(g)) for g in usage.gpus[:GPUS_SHOWN]]
    more = [f"… {len(usage.gpus) - GPUS_SHOWN} more"] if len(usage.gpus) > GPUS_SHOWN else []
    return [f'<span class="usage">{cell}</span>' for cell in
            (f"{usage.cpu_percent:.0f}%", _gib(usage.memory_used_bytes, usage.memory_total_bytes),
             "<br>".join(gpus + more) or "none")]


def nodes_table(views: list[Any], page: int, now: float) -> str:
    """One page of ``views`` (``coordinator.jobs.shown.NodeShown``: every node)."""
    shown = views[page * NODES_PAGE:(page + 1) * NODES_PAGE]
    rows = []
    for node in shown:
        s, drain = node.session, node.draining
        heard = s.last_heartbeat if s.status.value == "READY" else s.record.last_seen
        rows.append([e(s.name), e(s.record.address), state_badge(s.status.value), str(s.record.slots), str(node.free),
                     "yes" + (f": {e(drain)}" if drain else "") if drain is not None else "no",
                     *usage_cells(getattr(s, "usage", None)), age(now - heard) + " ago" if heard else "never",
                     e(s.detail)])
    pages = -(-len(views) // NODES_PAGE)
    nav = "" if pages <= 1 else '<nav class="pager">' + " ".join(
        f'<a href="/nodes?page={p}">{p + 1}</a>' for p in sorted({0, max(0, page - 1), page,
                                                                  min(pages - 1, page + 1), pages - 1})) + "</nav>"
    head = f"<p>{len(views)} node(s); {sum(node.free for node in views)} free slot(s)</p>"
    return head + table(NODE_COLUMNS, rows, "nodes") + nav


def plan_form(text: str = "", overrides: str = "") -> str:
    """The form, holding what was typed (the job file and the overrides) when it is shown again; the
    newline after each ``<textarea>`` is the one HTML drops, so a typed leading newline stays."""
    return ('<form id="plan-form" method="post" action="/plan"><p>Paste a job file; nothing is submitted.</p>'
            f'<textarea name="spec" rows="16" cols="90">\n{e(text)}</textarea><br>'
            '<label>overrides (one KEY=VALUE a line) '
            f'<textarea name="set" rows="2" cols="60">\n{e(overrides)}</textarea></label>'
            '<br><button>plan</button></form>')


def plan_errors(errors: list[str]) -> str:
    return '<ul id="plan-errors" class="errors">' + "".join(f"<li>{e(x)}</li>" for x in errors) + "</ul>"


def _kinds(doc: dict) -> tuple[str, list[str]]:
    gpn, rows, warnings = doc["gpus_per_node"], [], []
    for kind, k in doc["kinds"].items():
        rows.append([e(kind), str(k["groups"]), str(k["size"]), str(k["cross_node"])])
        if kind in INTRA_NODE_GROUPS and k["cross_node"] and k["size"] > 1:
            warnings.append(f"{k['cross_node']} of {k['groups']} {kind} groups cross a node boundary "
                            f"({kind} traffic is heavy; keep {kind} groups inside a node of {gpn} slots)")
    return table(["kind", "groups", "size", "cross-node"], rows, "plan-kinds"), warnings


def _groups(doc: dict) -> str:
    if "groups" not in doc:
        return f'<p class="note">{e(doc.get("note", ""))}</p>'
    rows = []
    for kind, groups in doc["groups"].items():
        listed = " ".join(str(g) for g in groups[:PLAN_GROUPS_SHOWN])
        more = f" … {len(groups) - PLAN_GROUPS_SHOWN} more" if len(groups) > PLAN_GROUPS_SHOWN else ""
        rows.append([e(kind), e(listed + more)])
    return table(["kind", f"groups (first {PLAN_GROUPS_SHOWN})"], rows, "plan-groups")


def plan_result(doc: dict, spec: dict) -> str:
    """A PlanJob document (``core.plan``) as HTML: the layout, the groups per kind, the placement."""
    c, gpn = doc["config"], doc["gpus_per_node"]
    nodes = -(-c["world_size"] // gpn)
    vpp = f" vpp={c['vpp']}" if c.get("vpp") else ""
    head = (f'<p id="plan-layout">job {e(spec.get("name"))} ({e(spec.get("kind"))}): world_size={c["world_size"]} '
            f'on {nodes} node(s) x {gpn} slots, order={e(c["order"])}<br>dense: tp={c["tp"]} cp={c["cp"]} '
            f'dp={c["dp"]} pp={c["pp"]}{vpp}<br>'
            f'expert: etp={c.get("etp") or c["tp"]} ep={c["ep"]} edp={c["expert_dp"]} pp={c["pp"]}</p>')
    kinds, warnings = _kinds(doc)
    placement = table(["node", "ranks"], [[str(k), f"{k * gpn}–{(k + 1) * gpn - 1}"]
                                          for k in range(min(nodes, PLAN_NODES_SHOWN))], "plan-placement")
    more = f"<p>… {nodes - PLAN_NODES_SHOWN} more node(s)</p>" if nodes > PLAN_NODES_SHOWN else ""
    warn = "".join(f'<p class="warning">warning: {e(w)}</p>' for w in warnings)
    return (f'<section id="plan-result">{head}{warn}<h2>groups per kind</h2>{kinds}{_groups(doc)}'
            f'<h2>placement (node-major)</h2>{placement}{more}</section>')
