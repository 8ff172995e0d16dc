"""One rank's status record and its line in ``rank-R.status.jsonl`` (``contract.files.rankfiles`` names the file).

The rank writes records (``runtime.status``), its node's daemon reads them back (``worker.runs.status``) and
converts each once to the wire (``worker.uplink.reporting.to_wire``). The line is a JSON object; a line that is
not one is read as a record with phase None whose ``error`` says so (user code runs in the writer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

PHASES = ("rendezvous", "groups", "running", "done", "failed")  # in order; done or failed ends a rank
UNREADABLE_CHARS = 200  # of a line that is not a record, kept in the record's error


NOTICE_CHARS = 1000   # a notice's length at most
STOPPED = "stopped: "   # how the exit of a rank its daemon stopped on the coordinator's request begins (a Cancel)
PREFLIGHT_CHARS = 4000   # a pre-flight outcome's


@dataclass(frozen=True, kw_only=True)
class RankStatusRecord:
    """What a rank says about itself at one moment. Its line::

        {"ts":1712.3,"rank":3,"phase":"running","step":12,"metrics":{"loss":2.1},"error":null,"result":null}
    """

    rank: int
    phase: str | None                     # one of PHASES; None: the line was not a record
    ts: float | None = None               # unix seconds by the node's clock when the rank wrote it
    step: int | None = None               # the step just finished (running)
    metrics: dict[str, Any] = field(default_factory=dict)  # the kind's figures of that step
    error: str | None = None              # failed: the exception in one line
    result: Any = None                    # done: the kind's result (JSON)
    traceback: tuple[str, ...] = ()       # failed: the traceback's last lines
    wait_s: float | None = None           # since the previous step record: time waiting in collectives
    compute_s: float | None = None        # ... and the rest of that time
    notice: str | None = None             # something for the job's record (an event): a damaged checkpoint ...
    preflight: str | None = None          # rank 0's pre-flight outcome, JSON (``runtime.preflight``)

    def to_line(self) -> str:
        """The record as one line without its newline (key order and separators are the file format)."""
        doc: dict[str, Any] = {"ts": self.ts, "rank": self.rank, "phase": self.phase, "step": self.step,
                               "metrics": self.metrics, "error": self.error, "result": self.result}
        if self.traceback:
            doc["traceback"] = list(self.traceback)
        if self.wait_s is not None:
            doc["wait_s"] = self.wait_s
        if self.compute_s is not None:
            doc["compute_s"] = self.compute_s
        if self.notice:
            doc["notice"] = self.notice
        if self.preflight:
            doc["preflight"] = self.preflight
        return json.dumps(doc, separators=(",", ":"), default=str)

    @classmethod
    def from_line(cls, line: str, rank: int) -> RankStatusRecord:
        """The record of one line of rank ``rank``'s file (the file, not the line, says whose it is)."""
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            return cls(rank=rank, phase=None, error=f"unparseable status line: {line[:UNREADABLE_CHARS]}")
        phase, error, tb = doc.get("phase"), doc.get("error"), doc.get("traceback")
        metrics = doc.get("metrics")
        return cls(
            rank=rank, phase=None if phase is None else str(phase), ts=as_number(doc.get("ts")),
            step=_step(doc.get("step")), metrics=metrics if isinstance(metrics, dict) else {},
            error=None if error is None else str(error), result=doc.get("result"), traceback=_lines(tb),
            wait_s=as_number(doc.get("wait_s")), compute_s=as_number(doc.get("compute_s")),
            notice=str(doc["notice"])[:NOTICE_CHARS] if doc.get("notice") else None,
            preflight=str(doc["preflight"])[:PREFLIGHT_CHARS] if doc.get("preflight") else None,
        )


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number that fits one (None: not a number, a bool, or an integer past
    float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer past float's range
        return None


def _step(value: Any) -> int | None:
    if isinstance(value, float) and math.isfinite(value):
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63 else None


def _lines(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value) if isinstance(value, list) else ()
