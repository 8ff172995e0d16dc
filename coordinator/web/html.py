"""HTML building blocks of the dashboard: the page shell, tables, escaping, ages. Pure text."""

from __future__ import annotations

from html import escape
from typing import Any, Iterable
from urllib.parse import quote

NAV = (("/", "jobs"), ("/nodes", "nodes"), ("/plan", "plan"), ("/metrics", "metrics"))


def e(value: Any) -> str:
    """Escaped text of any value ("" for None)."""
    return "" if value is None else escape(str(value), quote=True)


def job_href(job_id: str, tail: str = "") -> str:
    return f"/jobs/{quote(job_id, safe='')}{tail}"


def age(seconds: float) -> str:
    """3 s, 4 min, 2.5 h, 3.1 d."""
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def number(v: Any, unit: str = "") -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "–"
    return f"{v:,.0f}{unit}" if abs(v) >= 1000 else f"{v:.4g}{unit}"


def state_badge(state: str) -> str:
    return f'<span class="state st-{e(state.lower())}">{e(state)}</span>'


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], table_id: str = "") -> str:
    """A table of already-escaped cells."""
    tid = f' id="{e(table_id)}"' if table_id else ""
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table{tid}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(title: str, body: str, who: str = "", script: bool = False) -> str:
    """A whole page: navigation, the viewer's identity, ``body``; ``script`` loads dashboard.js."""
    nav = " ".join(f'<a href="{href}">{name}</a>' for href, name in NAV)
    you = f'<span class="who">{e(who)}</span>' if who else ""
    js = '<script src="/static/dashboard.js" defer></script>' if script else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{e(title)} · rankctl</title>'
            f'<link rel="stylesheet" href="/static/dashboard.css">{js}</head>'
            f'<body><header><b>rankctl</b> {nav}{you}</header><main><h1>{e(title)}</h1>{body}</main></body></html>')
