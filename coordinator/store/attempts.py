"""The attempts table: one row a job's attempt (its nodes, rendezvous, start and end, state, reason, cause, the
node its failure is blamed on, the typed fault it failed with).

``Store.attempts`` is an ``AttemptTable`` over the store's connection: its writes join the caller's transaction
(``Store.transaction``), its reads see them.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Protocol

from rankctl.coordinator.model.records import JobRecord


class Rows(Protocol):
    """What the table needs of the store (``Store``): one statement written in the caller's transaction, one read."""

    def write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor: ...

    def read(self, sql: str, args: tuple = ()) -> sqlite3.Cursor: ...


class AttemptTable:
    """The attempts of every job, stored."""

    def __init__(self, store: Rows) -> None:
        self._store = store

    def put(self, job: JobRecord, started_at: float) -> None:
        """The job's current attempt, as placed."""
        self._store.write(
            "INSERT OR REPLACE INTO attempts (job_id, attempt, nodes_json, rendezvous, started_at, finished_at, "
            "state, reason) VALUES (?,?,?,?,?,?,?,?)",
            (job.id, job.attempt, json.dumps(job.nodes), job.rendezvous, started_at, 0.0, job.state.value,
             job.reason),
        )

    def finish(self, job: JobRecord) -> None:
        """The job ended: its current attempt ends with it."""
        self._store.write(
            "UPDATE attempts SET finished_at=?, state=?, reason=? WHERE job_id=? AND attempt=?",
            (job.finished_at, job.state.value, job.reason, job.id, job.attempt),
        )

    def end(self, job_id: str, attempt: int, ts: float, state: str, reason: str, cause: str = "failure") -> None:
        """Close one attempt (a restart's: the job itself goes on); ``cause`` "failure", "drain" or "grow"."""
        self._store.write(
            "UPDATE attempts SET finished_at=?, state=?, reason=?, cause=? WHERE job_id=? AND attempt=?",
            (ts, state, reason, cause, job_id, attempt),
        )

    def blame(self, job_id: str, attempt: int, node: str) -> None:
        """The node an attempt's failure is attributed to ("" for none)."""
        self._store.write("UPDATE attempts SET blamed=? WHERE job_id=? AND attempt=?", (node, job_id, attempt))

    def store_fault(self, job_id: str, attempt: int, fault_json: str) -> None:
        """The typed fault an attempt failed with (``Fault.to_json``; "" for none): it survives a restart and a
        failover."""
        self._store.write("UPDATE attempts SET fault_json=? WHERE job_id=? AND attempt=?", (fault_json, job_id, attempt))

    def fault(self, job_id: str, attempt: int) -> str:
        """The typed fault one attempt failed with, as stored ("": none, or it did not fail)."""
        return self._one("SELECT fault_json FROM attempts WHERE job_id=? AND attempt=?", (job_id, attempt), "")

    def nodes(self, job_id: str, attempt: int) -> list[str]:
        """The nodes one stored attempt ran on ([] when it has no row)."""
        return json.loads(self._one("SELECT nodes_json FROM attempts WHERE job_id=? AND attempt=?",
                                    (job_id, attempt), "[]"))

    def blamed(self, job_id: str, attempt: int) -> str:
        """The node one attempt's failure was attributed to ("": none, or it did not fail)."""
        return self._one("SELECT blamed FROM attempts WHERE job_id=? AND attempt=?", (job_id, attempt), "")

    def drained(self, job_id: str) -> int:
        """How many of the job's attempts ended because a node of theirs was drained."""
        return int(self._one("SELECT COUNT(*) FROM attempts WHERE job_id=? AND cause='drain'", (job_id,), 0))

    def listed(self, job_id: str, last: int = 0) -> list[dict]:
        """The job's attempts, oldest first (``last`` > 0: only the newest ``last``), with how many nodes each ran
        on but not their names, and each one's stored fault (``fault_json``, "" for none)."""
        cur = self._store.read(
            "SELECT * FROM (SELECT job_id, attempt, rendezvous, started_at, finished_at, state, reason, cause, "
            "fault_json, json_array_length(nodes_json) AS nodes FROM attempts "
            "WHERE job_id=? ORDER BY attempt DESC LIMIT ?) ORDER BY attempt", (job_id, last if last > 0 else -1))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]

    def _one(self, sql: str, args: tuple, default: Any) -> Any:
        row = self._store.read(sql, args).fetchone()
        return row[0] if row else default
