"""SQLite (WAL) persistence of the coordinator: nodes, jobs, attempts, events, ranks, logs.

One connection, owned by the coordinator and used from the event loop thread. Writes
happen inside ``transaction()``; the outermost block commits before it returns, so a
write that an RPC acknowledges is on disk first. Each method opens its own (nested)
transaction, so a single call outside a block also commits at once.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rankctl.coordinator.records import EventRecord, JobRecord, LogRecord, NodeRecord, RankRecord
from rankctl.coordinator.states import JobState

DB_NAME = "coordinator.db"
LOG_LINES_PER_RANK = 5000

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
  name TEXT PRIMARY KEY, address TEXT NOT NULL, slots INTEGER NOT NULL, hardware_json TEXT NOT NULL,
  session TEXT NOT NULL, last_seq INTEGER NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
  seqno INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL,
  spec_json TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL, attempt INTEGER NOT NULL,
  world_size INTEGER NOT NULL, slots_per_node INTEGER NOT NULL, created_at REAL NOT NULL,
  finished_at REAL NOT NULL, nodes_json TEXT NOT NULL, rendezvous TEXT NOT NULL, result_json TEXT);
CREATE INDEX IF NOT EXISTS jobs_name ON jobs(name);
CREATE TABLE IF NOT EXISTS attempts (
  job_id TEXT NOT NULL, attempt INTEGER NOT NULL, nodes_json TEXT NOT NULL, rendezvous TEXT NOT NULL,
  started_at REAL NOT NULL, finished_at REAL NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL,
  PRIMARY KEY (job_id, attempt));
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL, seq INTEGER NOT NULL, ts REAL NOT NULL, state TEXT NOT NULL, kind TEXT NOT NULL,
  message TEXT NOT NULL, rank_json TEXT, PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS ranks (
  job_id TEXT NOT NULL, rank INTEGER NOT NULL, node TEXT NOT NULL, phase TEXT NOT NULL, step INTEGER NOT NULL,
  metrics_json TEXT NOT NULL, error TEXT NOT NULL, exit_code INTEGER NOT NULL, exited INTEGER NOT NULL,
  updated_at REAL NOT NULL, result_json TEXT NOT NULL, PRIMARY KEY (job_id, rank));
CREATE TABLE IF NOT EXISTS logs (
  id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, attempt INTEGER NOT NULL,
  rank INTEGER NOT NULL, line TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS logs_rank ON logs(job_id, rank, id);
"""

_JOB_COLS = (
    "seqno, id, name, kind, spec_json, state, reason, attempt, world_size, slots_per_node, "
    "created_at, finished_at, nodes_json, rendezvous, result_json"
)
_RANK_COLS = "rank, node, phase, step, metrics_json, error, exit_code, exited, updated_at, result_json"


def _job_from_row(row: tuple) -> JobRecord:
    (seqno, jid, name, kind, spec, state, reason, attempt, world, spn, created, finished, nodes, rdv, res) = row
    return JobRecord(
        id=jid, name=name, kind=kind, spec=json.loads(spec), state=JobState(state), reason=reason,
        world_size=world, slots_per_node=spn, created_at=created, attempt=attempt, finished_at=finished,
        nodes=json.loads(nodes), rendezvous=rdv, result=json.loads(res) if res else None, seqno=seqno,
    )


def _rank_from_row(row: tuple) -> RankRecord:
    rank, node, phase, step, metrics, error, code, exited, updated, result = row
    return RankRecord(rank, node, phase, step, metrics, error, code, bool(exited), updated, result)


def _rank_to_json(r: RankRecord) -> str:
    return json.dumps(r.__dict__, separators=(",", ":"))


class Store:
    """The coordinator's database under ``state_dir/coordinator.db``."""

    def __init__(self, state_dir: Path | str, *, log_lines_per_rank: int = LOG_LINES_PER_RANK) -> None:
        self.path = Path(state_dir) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.log_lines_per_rank = log_lines_per_rank
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        self._depth = 0

    def close(self) -> None:
        self._db.close()

    def journal_mode(self) -> str:
        return self._db.execute("PRAGMA journal_mode").fetchone()[0]

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group writes; the outermost block commits on success and rolls back on error."""
        if self._depth == 0:
            self._db.execute("BEGIN IMMEDIATE")
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self._db.execute("ROLLBACK")
            raise
        self._depth -= 1
        if self._depth == 0:
            self._db.execute("COMMIT")

    def _write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self.transaction():
            return self._db.execute(sql, args)

    # -- jobs ----------------------------------------------------------------
    def insert_job(self, job: JobRecord) -> None:
        """Store a new job; sets ``job.seqno`` (submission order)."""
        cur = self._write(
            f"INSERT INTO jobs ({_JOB_COLS}) VALUES (NULL,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", self._job_args(job)
        )
        job.seqno = cur.lastrowid

    def update_job(self, job: JobRecord) -> None:
        cols = [c.strip() for c in _JOB_COLS.split(",")][1:]
        sets = ", ".join(f"{c}=?" for c in cols[1:])
        args = self._job_args(job)
        self._write(f"UPDATE jobs SET {sets} WHERE id=?", (*args[1:], job.id))

    @staticmethod
    def _job_args(job: JobRecord) -> tuple:
        return (
            job.id, job.name, job.kind, json.dumps(job.spec), job.state.value, job.reason, job.attempt,
            job.world_size, job.slots_per_node, job.created_at, job.finished_at, json.dumps(job.nodes),
            job.rendezvous, json.dumps(job.result) if job.result is not None else None,
        )

    def load_jobs(self) -> list[JobRecord]:
        """Every job, in submission order."""
        rows = self._db.execute(f"SELECT {_JOB_COLS} FROM jobs ORDER BY seqno").fetchall()
        return [_job_from_row(r) for r in rows]

    # -- attempts ------------------------------------------------------------
    def put_attempt(self, job: JobRecord, started_at: float) -> None:
        self._write(
            "INSERT OR REPLACE INTO attempts VALUES (?,?,?,?,?,?,?,?)",
            (job.id, job.attempt, json.dumps(job.nodes), job.rendezvous, started_at, 0.0, job.state.value,
             job.reason),
        )

    def finish_attempt(self, job: JobRecord) -> None:
        self._write(
            "UPDATE attempts SET finished_at=?, state=?, reason=? WHERE job_id=? AND attempt=?",
            (job.finished_at, job.state.value, job.reason, job.id, job.attempt),
        )

    def attempts(self, job_id: str) -> list[dict]:
        cur = self._db.execute("SELECT * FROM attempts WHERE job_id=? ORDER BY attempt", (job_id,))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]

    # -- events --------------------------------------------------------------
    def append_event(self, event: EventRecord) -> None:
        rank = _rank_to_json(event.rank) if event.rank is not None else None
        self._write(
            "INSERT INTO events VALUES (?,?,?,?,?,?,?)",
            (event.job_id, event.seq, event.ts, event.state.value, event.kind, event.message, rank),
        )

    def events(self, job_id: str, after_seq: int = 0) -> list[EventRecord]:
        rows = self._db.execute(
            "SELECT seq, ts, state, kind, message, rank_json FROM events WHERE job_id=? AND seq>? ORDER BY seq",
            (job_id, after_seq),
        ).fetchall()
        return [
            EventRecord(job_id, seq, ts, JobState(state), kind, msg, RankRecord(**json.loads(r)) if r else None)
            for seq, ts, state, kind, msg, r in rows
        ]

    def last_event_seqs(self) -> dict[str, int]:
        rows = self._db.execute("SELECT job_id, MAX(seq) FROM events GROUP BY job_id").fetchall()
        return dict(rows)

    # -- ranks ---------------------------------------------------------------
    def put_rank(self, job_id: str, r: RankRecord) -> None:
        self._write(
            f"INSERT OR REPLACE INTO ranks (job_id, {_RANK_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (job_id, r.rank, r.node, r.phase, r.step, r.metrics_json, r.error, r.exit_code, int(r.exited),
             r.updated_at, r.result_json),
        )

    def clear_ranks(self, job_id: str) -> None:
        self._write("DELETE FROM ranks WHERE job_id=?", (job_id,))

    def ranks(self, job_id: str) -> dict[int, RankRecord]:
        rows = self._db.execute(
            f"SELECT {_RANK_COLS} FROM ranks WHERE job_id=? ORDER BY rank", (job_id,)
        ).fetchall()
        return {row[0]: _rank_from_row(row) for row in rows}

    # -- nodes ---------------------------------------------------------------
    def put_node(self, n: NodeRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?,?,?)",
            (n.name, n.address, n.slots, json.dumps(n.hardware), n.session, n.last_seq, n.last_seen),
        )

    def set_node_seq(self, name: str, last_seq: int) -> None:
        self._write("UPDATE nodes SET last_seq=? WHERE name=?", (last_seq, name))

    def load_nodes(self) -> list[NodeRecord]:
        rows = self._db.execute("SELECT * FROM nodes ORDER BY name").fetchall()
        return [NodeRecord(n, a, s, json.loads(h), sess, seq, seen) for n, a, s, h, sess, seq, seen in rows]

    # -- logs ----------------------------------------------------------------
    def append_logs(self, job_id: str, attempt: int, rank: int, lines: list[str]) -> None:
        """Append lines and keep only the last ``log_lines_per_rank`` of this rank."""
        with self.transaction():
            self._db.executemany(
                "INSERT INTO logs (job_id, attempt, rank, line) VALUES (?,?,?,?)",
                [(job_id, attempt, rank, line) for line in lines],
            )
            self._db.execute(
                "DELETE FROM logs WHERE job_id=? AND rank=? AND id <= (SELECT id FROM logs WHERE job_id=? "
                "AND rank=? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (job_id, rank, job_id, rank, self.log_lines_per_rank),
            )

    def logs(self, job_id: str, rank: int | None = None, *, after_id: int = 0, tail: int = 0) -> list[LogRecord]:
        """Stored lines after ``after_id`` (all ranks when ``rank`` is None); ``tail`` > 0 keeps the last n."""
        where, args = "job_id=? AND id>?", [job_id, after_id]
        if rank is not None:
            where, args = where + " AND rank=?", [*args, rank]
        sql = f"SELECT id, rank, attempt, line FROM logs WHERE {where} ORDER BY id"
        if tail > 0:
            sql = f"SELECT * FROM ({sql[:-len(' ORDER BY id')]} ORDER BY id DESC LIMIT ?) ORDER BY id"
            args.append(tail)
        return [LogRecord(*row) for row in self._db.execute(sql, args).fetchall()]
