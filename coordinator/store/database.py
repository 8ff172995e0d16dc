"""The coordinator's store: nodes, jobs, attempts, events, ranks, drains, exclusions, worker pools.

Two kinds behind one class. The embedded default is a SQLite (WAL) file under ``--state-dir``. A
replicated store (``--store etcd://...``) is an in-memory SQLite copy of the state kept on etcd: each
transaction's row changes (``coordinator.store.mirror``) go to its ``Replica`` as the copy commits: a standby's
journal (``coordinator.ha.journal``), or a leader's writer thread (``coordinator.ha.replicator``), which stores them
behind the loop; ``coordinator.store.durability`` says when they are stored. A replica that refuses rolls the
transaction back like a refused disk write. Reads never leave the process. The schema and its versions are in
``coordinator.store.schema``. Rank logs are not stored here: they stay on the nodes (``coordinator.logs.logfetch``).

One connection, owned by the coordinator and used from the event loop thread. Writes
happen inside ``transaction()``; the outermost block commits before it returns, so a
write that an RPC acknowledges is on disk first. Each method opens its own (nested)
transaction, so a single call outside a block also commits at once. A write that SQLite
refuses (disk full, I/O error) rolls the whole outermost transaction back and raises
``StoreError``; the core then brings its memory back to what the store holds.

Opening a store takes an exclusive lock on ``state_dir/coordinator.lock`` for the life of
the process (two coordinators never share one state dir), checks the database
(``PRAGMA quick_check``) and its schema version (``PRAGMA user_version``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from rankctl.coordinator.store.rows import _JOB_COLS, _RANK_COLS, _job_from_row, _rank_from_row, _rank_to_json
from rankctl.coordinator.model.errors import CoordinatorError
from rankctl.coordinator.store import mirror
from rankctl.coordinator.store.attempts import AttemptTable
from rankctl.coordinator.model.records import EventRecord, JobRecord, NodeRecord, RankRecord
from rankctl.coordinator.store.durability import AT_ONCE, Durability, Replica
from rankctl.coordinator.store.schema import StoreUnusable, open_checked
from rankctl.coordinator.model.states import JobState

DB_NAME = "coordinator.db"
LOCK_NAME = "coordinator.lock"


class StoreError(CoordinatorError):
    """A write the database refused; nothing of the operation was kept."""

    def __init__(self, message: str, *, full: bool = False) -> None:
        super().__init__(message)
        self.full = full


class StateDirInUse(OSError):
    """Another process holds the state directory's lock."""


def _lock_state_dir(state_dir: Path) -> int:
    """An exclusive, non-blocking flock on the state dir's lock file, holding our PID; returns its fd."""
    path = state_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise StateDirInUse(f"state dir {state_dir} is in use by another coordinator (pid {holder}); "
                                "stop it or choose another --state-dir") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _store_error(exc: sqlite3.Error, what: str, path: Path) -> StoreError:
    text = str(exc)
    full = "full" in text.lower() or getattr(exc, "sqlite_errorcode", None) == 13  # SQLITE_FULL
    where = f" (the file system of {path} is full)" if full else f" ({path})"
    return StoreError(f"the coordinator could not store {what}: {text}{where}; nothing was changed", full=full)


class Store:
    """The coordinator's database under ``state_dir/coordinator.db``; or, with a ``replica``, an in-memory copy
    of a replicated one (``replicated``): each transaction's row changes go to the replica before it commits."""

    def __init__(self, state_dir: Path | str, *, replica: Replica | None = None) -> None:
        self.path = Path(state_dir) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_state_dir(self.path.parent)
        self._depth, self.replica = 0, replica
        self.attempts = AttemptTable(self)   # the attempts table (``coordinator.store.attempts``)
        try:
            if replica is None and self.path.exists() and self.path.stat().st_size == 0:
                raise StoreUnusable(f"{self.path} is empty (0 bytes): a truncated database, not a new one (a new state "
                                    "dir has none); move it away to start with an empty state, or restore a backup")
            self._db = sqlite3.connect(":memory:" if replica else self.path, isolation_level=None,
                                       check_same_thread=False)
            if replica is None:
                open_checked(self._db, str(self.path))
        except BaseException:
            os.close(self._lock_fd)
            raise

    def apply_entries(self, entries: list[tuple[int, list]]) -> None:
        """Replicated changes written by the leader (a standby following it, a leader catching up)."""
        self._db.execute("BEGIN")
        try:
            for _, changes in entries:
                mirror.apply(self._db, changes)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def serialize(self) -> bytes:
        """The whole database as one byte string (a replicated store's snapshot)."""
        return self._db.serialize()


    def close(self) -> None:
        self._db.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def journal_mode(self) -> str:
        return self._db.execute("PRAGMA journal_mode").fetchone()[0]

    @contextmanager
    def transaction(self, what: str = "a change") -> Iterator[None]:
        """Group writes; the outermost block commits on success and rolls back on error.

        Any SQLite error inside (or at COMMIT) rolls back and is raised as ``StoreError``.
        """
        outer = self._depth == 0
        if outer:
            self._run("BEGIN IMMEDIATE", what)
        self._depth += 1
        try:
            yield
        except BaseException as exc:
            self._depth -= 1
            if outer:
                self._rollback()
            if isinstance(exc, sqlite3.Error):
                raise _store_error(exc, what, self.path) from None
            raise
        self._depth -= 1
        if outer:
            try:
                if self.replica is not None and (changes := mirror.collect(self._db)):
                    self.replica.submit(changes, what)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise _store_error(exc, what, self.path) from None
            except BaseException:
                self._rollback()
                raise

    @property
    def in_transaction(self) -> bool:
        """Whether a ``transaction()`` block is open."""
        return self._depth > 0

    def _run(self, sql: str, what: str) -> None:
        try:
            self._db.execute(sql)
        except sqlite3.Error as exc:
            raise _store_error(exc, what, self.path) from None

    def _rollback(self) -> None:
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # SQLite may have rolled back already (e.g. SQLITE_FULL at COMMIT)

    def write(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        """One statement, in the caller's transaction (or one of its own)."""
        with self.transaction():
            return self._db.execute(sql, args)

    def read(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        return self._db.execute(sql, args)

    # -- jobs ----------------------------------------------------------------
    def insert_job(self, job: JobRecord) -> int:
        """Store a new job; its ``seqno`` (submission order), which the job book sets."""
        cur = self.write(
            f"INSERT INTO jobs ({_JOB_COLS}) VALUES (NULL,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", self._job_args(job)
        )
        return int(cur.lastrowid or 0)

    def update_job(self, job: JobRecord) -> None:
        cols = [c.strip() for c in _JOB_COLS.split(",")][1:]
        sets = ", ".join(f"{c}=?" for c in cols[1:])
        args = self._job_args(job)
        self.write(f"UPDATE jobs SET {sets} WHERE id=?", (*args[1:], job.id))

    @staticmethod
    def _job_args(job: JobRecord) -> tuple:
        return (
            job.id, job.name, job.kind, json.dumps(job.spec.to_dict()), job.state.value, job.reason, job.attempt,
            job.world_size, job.slots_per_node, job.created_at, job.finished_at, json.dumps(job.nodes),
            job.rendezvous, json.dumps(job.result) if job.result is not None else None, job.submitted_by,
            json.dumps(job.allocation.to_dict()) if job.allocation is not None else "",
        )

    def load_jobs(self) -> list[JobRecord]:
        """Every job, in submission order."""
        rows = self._db.execute(f"SELECT {_JOB_COLS} FROM jobs ORDER BY seqno").fetchall()
        return [_job_from_row(r) for r in rows]

    # -- events --------------------------------------------------------------
    def append_event(self, event: EventRecord) -> None:
        rank = _rank_to_json(event.rank) if event.rank is not None else None
        data = json.dumps(event.data()) if event.data() is not None else None
        self.write(
            "INSERT INTO events VALUES (?,?,?,?,?,?,?,?)",
            (event.job_id, event.seq, event.ts, event.state.value, event.kind, event.message, rank, data),
        )

    def events(self, job_id: str, after_seq: int = 0, limit: int = 0, *, ranks: bool = True) -> list[EventRecord]:
        """Events after ``after_seq`` in order; ``limit`` > 0 keeps the first ``limit``. ``ranks=False`` leaves
        out the per-rank events (one per rank and phase change): read through a partial index, so a job's
        step series costs its job-level events only, whatever its size."""
        only = "" if ranks else " AND kind != 'rank'"
        rows = self._db.execute(
            "SELECT seq, ts, state, kind, message, rank_json, data_json FROM events WHERE job_id=? AND seq>?"
            f"{only} ORDER BY seq LIMIT ?", (job_id, after_seq, limit if limit > 0 else -1),
        ).fetchall()
        out = []
        for seq, ts, state, kind, msg, r, d in rows:
            data = json.loads(d) if d else {}
            out.append(EventRecord(job_id, seq, ts, JobState(state), kind, msg,
                                   RankRecord(**json.loads(r)) if r else None,
                                   int(data.get("step") or 0), data.get("metrics"), int(data.get("ranks") or 0)))
        return out

    def last_step(self, job_id: str) -> int:
        """The step of the job's newest ``step`` event (0: none)."""
        row = self._db.execute(
            "SELECT data_json FROM events WHERE job_id=? AND kind='step' ORDER BY seq DESC LIMIT 1", (job_id,)
        ).fetchone()
        return int(json.loads(row[0]).get("step") or 0) if row and row[0] else 0

    def last_event_seqs(self) -> dict[str, int]:
        rows = self._db.execute("SELECT job_id, MAX(seq) FROM events GROUP BY job_id").fetchall()
        return dict(rows)

    # -- ranks ---------------------------------------------------------------
    def put_rank(self, job_id: str, r: RankRecord) -> None:
        self.put_ranks([(job_id, r)])

    def put_ranks(self, rows: Iterable[tuple[str, RankRecord]]) -> None:
        """Many ranks' records (job id, record) in one statement."""
        with self.transaction():
            self._db.executemany(
                f"INSERT OR REPLACE INTO ranks (job_id, {_RANK_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                ((job_id, r.rank, r.node, r.phase, r.step, r.metrics_json, r.error, r.exit_code, int(r.exited),
                  r.updated_at, r.result_json) for job_id, r in rows))

    def all_ranks(self) -> dict[str, dict[int, RankRecord]]:
        """job id -> rank -> record, for every job (one query)."""
        out: dict[str, dict[int, RankRecord]] = {}
        for row in self._db.execute(f"SELECT job_id, {_RANK_COLS} FROM ranks ORDER BY job_id, rank"):
            out.setdefault(row[0], {})[row[1]] = _rank_from_row(row[1:])
        return out

    def clear_ranks(self, job_id: str) -> None:
        self.write("DELETE FROM ranks WHERE job_id=?", (job_id,))

    def ranks(self, job_id: str) -> dict[int, RankRecord]:
        rows = self._db.execute(
            f"SELECT {_RANK_COLS} FROM ranks WHERE job_id=? ORDER BY rank", (job_id,)
        ).fetchall()
        return {row[0]: _rank_from_row(row) for row in rows}

    # -- nodes ---------------------------------------------------------------
    def put_node(self, n: NodeRecord) -> None:
        self.write(
            "INSERT OR REPLACE INTO nodes VALUES (?,?,?,?,?,?,?)",
            (n.name, n.address, n.slots, json.dumps(n.hardware), n.session, n.last_seq, n.last_seen),
        )

    def set_node_seqs(self, seqs: Iterable[tuple[str, int]]) -> None:
        """Many nodes' last stored report numbers, (name, last_seq), in one statement (a group commit's)."""
        with self.transaction():
            self._db.executemany("UPDATE nodes SET last_seq=? WHERE name=?", ((seq, name) for name, seq in seqs))

    def load_nodes(self) -> list[NodeRecord]:
        rows = self._db.execute("SELECT * FROM nodes ORDER BY name").fetchall()
        return [NodeRecord(n, a, s, json.loads(h), sess, seq, seen) for n, a, s, h, sess, seq, seen in rows]

    # -- drains and exclusions ---------------------------------------------------
    def set_drain(self, node: str, reason: str, since: float) -> None:
        self.write("INSERT OR REPLACE INTO drains VALUES (?,?,?)", (node, reason, since))

    def clear_drain(self, node: str) -> None:
        self.write("DELETE FROM drains WHERE node=?", (node,))

    def load_drains(self) -> dict[str, str]:
        """node -> the reason it was drained."""
        return dict(self._db.execute("SELECT node, reason FROM drains ORDER BY node").fetchall())

    # -- worker pools (ctl slurm workers) ----------------------------------------
    def save_pool(self, pool_id: str, created_at: float, body: dict) -> None:
        self.write("INSERT OR REPLACE INTO worker_pools VALUES (?,?,?)", (pool_id, created_at, json.dumps(body)))

    def load_pools(self) -> list[dict]:
        return [json.loads(b) for (b,) in self._db.execute("SELECT body_json FROM worker_pools ORDER BY created_at")]

    def add_exclusion(self, job_id: str, node: str, reason: str, since: float) -> None:
        self.write("INSERT OR REPLACE INTO exclusions VALUES (?,?,?,?)", (job_id, node, reason, since))

    def clear_exclusions(self, *, job_id: str | None = None, node: str | None = None) -> None:
        """Forget the exclusions of a job (it ended) or of a node (ctl undrain)."""
        if job_id is not None:
            self.write("DELETE FROM exclusions WHERE job_id=?", (job_id,))
        if node is not None:
            self.write("DELETE FROM exclusions WHERE node=?", (node,))

    def load_exclusions(self) -> dict[str, dict[str, str]]:
        """job id -> node -> why it is not placed for that job again."""
        out: dict[str, dict[str, str]] = {}
        for job_id, node, reason in self._db.execute("SELECT job_id, node, reason FROM exclusions ORDER BY job_id"):
            out.setdefault(job_id, {})[node] = reason
        return out


def replicated(state_dir: Path | str, replica: Replica, snapshot: bytes | None, entries: list[tuple[int, list]],
               where: str) -> Store:
    """A copy of a replicated database: ``snapshot`` (serialized) with ``entries`` applied after it."""
    store = Store(state_dir, replica=replica)
    try:
        if snapshot is not None:
            store._db.deserialize(snapshot)
        open_checked(store._db, where, wal=False)
        mirror.install(store._db)
        store.apply_entries(entries)
    except BaseException:
        store.close()
        raise
    return store


def durability(store: Store) -> Durability:
    """When the store's committed transactions are stored (its replica's, if that stores behind the loop)."""
    return store.replica if isinstance(store.replica, Durability) else AT_ONCE


def restore(store: Store, image: bytes) -> None:
    """A replicated store's copy back to ``image`` (what etcd holds: the writes after it were refused), on a
    connection of its own: the capture triggers of one whose database was replaced would not fire."""
    assert not store.in_transaction, "restore inside a transaction"
    db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    db.deserialize(image)
    open_checked(db, "the stored copy", wal=False)   # the connection's pragmas (foreign keys) as at the start
    mirror.install(db)
    old, store._db = store._db, db  # noqa: SLF001 - the store's own module
    old.close()


def prune_events(store: Store, finished_before: float, limit: int) -> int:
    """Delete about ``limit`` events (at least that many when there are) of jobs that finished before
    ``finished_before``; each job keeps its last event, so its numbering goes on. How many were deleted.
    Per job through the events' primary key: no scan of the whole history."""
    db, deleted = store._db, 0  # noqa: SLF001 - the store's own module
    for (job_id,) in db.execute("SELECT id FROM jobs WHERE finished_at > 0 AND finished_at < ?",
                                (finished_before,)).fetchall():
        first, last = db.execute("SELECT MIN(seq), MAX(seq) FROM events WHERE job_id=?", (job_id,)).fetchone()
        if first is None or first == last:
            continue
        upto = min(last, first + limit - deleted)
        deleted += store.write("DELETE FROM events WHERE job_id=? AND seq < ?", (job_id, upto)).rowcount  # noqa: SLF001
        if deleted >= limit:
            break
    return deleted
