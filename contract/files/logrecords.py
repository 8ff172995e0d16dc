"""rankctl's own records in a rank's log, told apart from what the program printed.

A rank's stdout and stderr go to one file (``contract.files.rankfiles.log_path``); rankctl's structured
records (structlog, in the rank process) go to the same file, in order, each line starting with
``RECORD_MARK``: the ASCII record separator, as in RFC 7464 JSON text sequences. The daemon drops
those lines from a fetch unless it asks for records; a reader parses them with ``parse_record``.
"""

from __future__ import annotations

import json
from typing import Any

RECORD_MARK = "\x1e"
RECORD_MARK_BYTE = RECORD_MARK.encode()


def is_record(line: str | bytes) -> bool:
    """Whether a log line is one of rankctl's records (not what the program printed)."""
    return line[:1] == (RECORD_MARK_BYTE if isinstance(line, bytes) else RECORD_MARK)


def parse_record(line: str) -> dict[str, Any] | None:
    """A record line's object; None when it is no record or is not a JSON object (e.g. cut)."""
    if not is_record(line):
        return None
    try:
        doc = json.loads(line[len(RECORD_MARK):])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
