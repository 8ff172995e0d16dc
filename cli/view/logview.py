"""``ctl logs`` lines: what a rank printed as it is, rankctl's records (``--records``) parsed.

A record line (``contract.files.logrecords``) is never shown as JSON text: ``--json`` gives its object
under ``"record"``, and a person reads ``[rankctl LEVEL] EVENT key=value ...``.
"""

from __future__ import annotations

import json
from typing import Any

from rankctl.contract.files.logrecords import RECORD_MARK, is_record, parse_record

# bound by the runtime's structlog context, the same on every record of a rank: not repeated on each line
CONTEXT_KEYS = ("job", "attempt", "node", "rank", "event", "level", "timestamp", "logger")


def line_doc(rank: int, attempt: int, text: str) -> dict[str, Any]:
    """``--json``: {"rank", "attempt", "line"} for what the program printed, {"rank", "attempt", "record"}
    for a record; a record cut too long to parse is {"rank", "attempt", "record": null, "line"}."""
    if not is_record(text):
        return {"rank": rank, "attempt": attempt, "line": text}
    record = parse_record(text)
    doc: dict[str, Any] = {"rank": rank, "attempt": attempt, "record": record}
    if record is None:
        doc["line"] = text[len(RECORD_MARK):]
    return doc


def _value(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"), default=str)
    return json.dumps(text) if not text or any(c.isspace() or c in "\"=" for c in text) else text


def record_text(record: dict[str, Any]) -> str:
    """One record for a person: its time, level and event, then its own fields."""
    fields = " ".join(f"{k}={_value(v)}" for k, v in record.items() if k not in CONTEXT_KEYS)
    head = f"{record.get('timestamp', '')} [rankctl {record.get('level', 'info')}] {record.get('event', '')}"
    return f"{head.strip()} {fields}".rstrip()


def line_text(rank: int, text: str, prefixed: bool) -> str:
    """One line for a person (``[rank R] `` in front when several ranks are shown)."""
    if is_record(text):
        record = parse_record(text)
        text = record_text(record) if record is not None else "[rankctl] " + text[len(RECORD_MARK):]
    return f"[rank {rank}] {text}" if prefixed else text
