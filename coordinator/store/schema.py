"""The coordinator database's schema, its version and the checks and upgrades a database gets when opened.

Schema version 2 adds the events' ``data_json`` (a ``step`` event's step and metrics). Version 3 (issue 13)
adds the ``drains`` and ``exclusions`` tables and the attempts' ``cause`` and ``blamed``. Version 4 adds the
jobs' ``submitted_by``; version 5 the jobs' ``allocation_json``; version 6 the ``worker_pools``; version 7 the
attempts' ``fault_json`` (a failed attempt's typed fault, ``coordinator.model.faults.Fault``).
An older database is upgraded in place; a newer one is refused.
"""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 7  # PRAGMA user_version of a database this code writes
WAL_CHECKPOINT_PAGES = 128  # checkpoint the WAL into the database every ~512 KiB
WAL_SIZE_LIMIT = 1 << 20    # and truncate it back to 1 MiB after a checkpoint

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
  cause TEXT NOT NULL DEFAULT '', blamed TEXT NOT NULL DEFAULT '', fault_json TEXT NOT NULL DEFAULT '',
  PRIMARY KEY (job_id, attempt));
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL, seq INTEGER NOT NULL, ts REAL NOT NULL, state TEXT NOT NULL, kind TEXT NOT NULL,
  message TEXT NOT NULL, rank_json TEXT, data_json TEXT, PRIMARY KEY (job_id, seq));
-- a job's events other than per-rank ones (steps, transitions ...): the dashboard's series read only these
CREATE INDEX IF NOT EXISTS events_job_level ON events(job_id, seq) WHERE kind != 'rank';
CREATE TABLE IF NOT EXISTS ranks (
  job_id TEXT NOT NULL, rank INTEGER NOT NULL, node TEXT NOT NULL, phase TEXT NOT NULL, step INTEGER NOT NULL,
  metrics_json TEXT NOT NULL, error TEXT NOT NULL, exit_code INTEGER NOT NULL, exited INTEGER NOT NULL,
  updated_at REAL NOT NULL, result_json TEXT NOT NULL, PRIMARY KEY (job_id, rank));
CREATE TABLE IF NOT EXISTS drains (node TEXT PRIMARY KEY, reason TEXT NOT NULL, since REAL NOT NULL);
CREATE TABLE IF NOT EXISTS worker_pools (id TEXT PRIMARY KEY, created_at REAL NOT NULL, body_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS exclusions (
  job_id TEXT NOT NULL, node TEXT NOT NULL, reason TEXT NOT NULL, since REAL NOT NULL, PRIMARY KEY (job_id, node));
"""
# columns added after a table's first version: (table, column, its definition)
ADDED_COLUMNS = (
    ("events", "data_json", "TEXT"),                          # version 2
    ("attempts", "cause", "TEXT NOT NULL DEFAULT ''"),       # version 3
    ("attempts", "blamed", "TEXT NOT NULL DEFAULT ''"),      # version 3
    ("jobs", "submitted_by", "TEXT NOT NULL DEFAULT ''"),    # version 4
    ("jobs", "allocation_json", "TEXT NOT NULL DEFAULT ''"), # version 5
    ("attempts", "fault_json", "TEXT NOT NULL DEFAULT ''"),  # version 7
)


class StoreUnusable(OSError):
    """The database is corrupt or from a newer rankctl: refused at start."""


def open_checked(db: sqlite3.Connection, where: str, *, wal: bool = True) -> None:
    """Check the database (``where`` names it in errors) and its schema version; create the schema in a new one,
    upgrade an older one. ``wal``: a file database's journal settings (not for an in-memory copy)."""
    try:
        check = db.execute("PRAGMA quick_check").fetchall()
        version = db.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise StoreUnusable(f"{where} is not a usable rankctl database ({exc}); move it away to start "
                            "with an empty state, or restore a backup") from None
    if check != [("ok",)]:
        first = "; ".join(str(row[0]) for row in check[:3])
        raise StoreUnusable(f"{where} is corrupt (PRAGMA quick_check: {first}); move it away to start "
                            "with an empty state, or restore a backup")
    if version > SCHEMA_VERSION:
        raise StoreUnusable(f"{where} has schema version {version}, newer than this rankctl's "
                            f"{SCHEMA_VERSION}; run the rankctl that wrote it")
    if wal:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        # Keep the WAL small: a WAL that outgrows the free space can never be checkpointed into
        # the database again, and the store stays full after space is freed.
        db.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
        db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
    db.execute("PRAGMA foreign_keys=ON")
    db.executescript(SCHEMA)  # an older database gets the tables it lacks
    for table, column, definition in ADDED_COLUMNS:  # ... and the columns (nothing else changes)
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
