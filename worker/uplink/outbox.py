"""The rank reports a daemon has yet to send: every part that reports hands them here, the coordinator
session (``worker.uplink.session``) is the only reader. ``worker.uplink.reportbuf`` numbers and keeps them; a phase
change, exit or error wakes the session's writer at once, a step report waits for its report tick."""

from __future__ import annotations

import asyncio

from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.uplink.reportbuf import ReportBuffer


class Outbox:
    """``buffer`` holds the reports; ``wake`` tells the writer there is something to send, ``hurry`` ends
    its wait for the report tick."""

    def __init__(self, maxlen: int) -> None:
        self.buffer = ReportBuffer(maxlen)
        self.wake = asyncio.Event()
        self.hurry = asyncio.Event()

    def report(self, job_id: str, attempt: int, status: pb.RankStatus, result_json: str = "", *,
               step_only: bool = False) -> None:
        """Keep one report; ``step_only`` (a running rank's next step) may replace its previous one and waits."""
        self.buffer.add(job_id, attempt, status, result_json, step_only=step_only)
        self.wake.set()
        if not step_only:
            self.hurry.set()
