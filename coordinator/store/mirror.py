"""Row-level change capture of the coordinator's SQLite database, for a store that replicates it (etcd).

Temporary triggers record the primary key of every row a transaction inserts, updates or deletes
(``_dirty``, a temp table: never part of the database itself). ``collect`` turns them into *changes*,
``[table, key, row]`` with the row as a column -> value dict, or ``None`` for a deleted row; ``apply``
writes changes into another copy of the database. A change set is one transaction's whole effect, so
applying a replicated log of them in order rebuilds the same database on a standby.
"""

from __future__ import annotations

import json
import sqlite3
import zlib
from typing import Any

# each replicated table and its primary key columns
KEYS: dict[str, tuple[str, ...]] = {
    "nodes": ("name",), "jobs": ("seqno",), "attempts": ("job_id", "attempt"), "events": ("job_id", "seq"),
    "ranks": ("job_id", "rank"), "drains": ("node",), "worker_pools": ("id",), "exclusions": ("job_id", "node"),
}
Change = list  # [table, [key values], {column: value} | None]


def install(db: sqlite3.Connection) -> None:
    """Create the capture triggers on this connection (temp objects: they vanish with it)."""
    db.execute("CREATE TEMP TABLE IF NOT EXISTS _dirty (tbl TEXT NOT NULL, pk TEXT NOT NULL, PRIMARY KEY (tbl, pk))")
    for table, cols in KEYS.items():
        for event, ref in (("INSERT", "NEW"), ("UPDATE", "NEW"), ("DELETE", "OLD")):
            pk = "json_array(" + ", ".join(f"{ref}.{c}" for c in cols) + ")"
            db.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS _cap_{table}_{event.lower()} AFTER {event} ON main.{table} "
                       f"BEGIN INSERT OR IGNORE INTO _dirty VALUES ('{table}', {pk}); END")


def _where(cols: tuple[str, ...]) -> str:
    return " AND ".join(f"{c}=?" for c in cols)


def collect(db: sqlite3.Connection) -> list[Change]:
    """The open transaction's changes so far (each touched row once, as it is now); clears the record."""
    out: list[Change] = []
    for table, pk in db.execute("SELECT tbl, pk FROM temp._dirty").fetchall():
        key = json.loads(pk)
        cur = db.execute(f"SELECT * FROM main.{table} WHERE {_where(KEYS[table])}", key)
        row = cur.fetchone()
        out.append([table, key, dict(zip([d[0] for d in cur.description], row)) if row is not None else None])
    db.execute("DELETE FROM temp._dirty")
    return out


def discard(db: sqlite3.Connection) -> None:
    """Forget what was recorded (a rolled-back transaction, or changes applied from the log)."""
    db.execute("DELETE FROM temp._dirty")


def apply(db: sqlite3.Connection, changes: list[Change]) -> None:
    """Write ``changes`` into ``db`` (inside the caller's transaction); nothing is recorded for replication."""
    for table, key, row in changes:
        cols = KEYS.get(table)
        if cols is None:
            continue  # a table of a newer rankctl: not ours to know
        if row is None:
            db.execute(f"DELETE FROM main.{table} WHERE {_where(cols)}", key)
        else:
            names = list(row)
            db.execute(f"INSERT OR REPLACE INTO main.{table} ({', '.join(names)}) "
                       f"VALUES ({', '.join('?' * len(names))})", [row[n] for n in names])
    discard(db)


def encode(record: dict[str, Any]) -> bytes:
    return zlib.compress(json.dumps(record, separators=(",", ":")).encode(), 1)


def decode(data: bytes) -> dict[str, Any]:
    return json.loads(zlib.decompress(data))
