"""Bounds on what a rank's report may put in the job's record: a rank's text is what its process wrote, so a
10 MB error, metrics or result must not make every ``GetJob`` and watch of the job too large to send.

Each function returns the value as it is when within its bound (the common case: one ``len``), else a bounded
stand-in that says what was cut. A phase outside the known set reads as ``unknown`` (the daemon's word for a
status line that is not a record), so the job's per-phase counts stay a handful of short keys.
"""

from __future__ import annotations

import json

from rankctl.contract.resultsize import RESULT_CHARS as _RESULT_CHARS
from rankctl.coordinator.model.records import PHASES

KNOWN_PHASES = frozenset((*PHASES, "unknown"))
ERROR_CHARS = 8_000        # a rank's error (its exception and the traceback's last lines)
ERROR_HEAD = 1_000         # of a longer one: its first characters, then its last
METRICS_CHARS = 16_384     # a step's metrics as JSON
RESULT_CHARS = _RESULT_CHARS   # a rank's result as JSON (the daemon samples long loss lists to fit)
EVIDENCE_CHARS = 8_192     # hang evidence: collective counters (JSON), a stack (the daemon sends <= 4 KiB each)
PREFLIGHT_CHARS = 16_384   # rank 0's pre-flight outcome (JSON; the rank writes <= 4,000 characters)
PROCESS_CHARS = 32         # the daemon's word on the process ("stopped")


def phase(value: str) -> str:
    return value if not value or value in KNOWN_PHASES else "unknown"


def process(text: str) -> str:
    return text if len(text) <= PROCESS_CHARS else "unknown"


def error(text: str) -> str:
    """Its first ``ERROR_HEAD`` and last characters (a traceback's end says the most)."""
    if len(text) <= ERROR_CHARS:
        return text
    cut = len(text) - ERROR_CHARS + 100
    return f"{text[:ERROR_HEAD]}\n... ({cut} characters cut) ...\n{text[ERROR_HEAD + cut:]}"


def metrics(text: str) -> str:
    if len(text) <= METRICS_CHARS:
        return text
    return json.dumps({"cut": f"metrics of {len(text)} characters, over the limit of {METRICS_CHARS}"})


def result(text: str) -> str:
    if len(text) <= RESULT_CHARS:
        return text
    return json.dumps({"unparseable": f"a result of {len(text)} characters, over the limit of {RESULT_CHARS}"})


def collectives(text: str) -> str:
    """JSON: dropped (never cut) when over its bound."""
    return text if len(text) <= EVIDENCE_CHARS else ""


def stack(text: str) -> str:
    return text if len(text) <= EVIDENCE_CHARS else text[-EVIDENCE_CHARS:]
