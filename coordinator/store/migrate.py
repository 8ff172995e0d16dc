"""``ctl coordinator migrate``: copy a stopped coordinator's SQLite state dir onto an empty etcd prefix.

The database's rows are copied into a fresh in-memory database of this rankctl's schema (an older one is
upgraded on the way), which becomes the prefix's first snapshot; its blobs follow. The migration holds the
prefix's election key while it writes, so no coordinator can lead on the prefix meanwhile, and it refuses a
prefix that holds any state already.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from aetcd.rpc import rpc_pb2 as rpc

from rankctl.coordinator.store import mirror
from rankctl.coordinator.ha.etcd import Etcd, EtcdTLS, StoreURL, Unreachable, prefix_end
from rankctl.coordinator.ha.etcdblobs import EtcdBlobs
from rankctl.coordinator.ha.journal import Fence, Journal
from rankctl.coordinator.store.schema import open_checked
from rankctl.coordinator.store.database import Store


class MigrationError(Exception):
    """The migration cannot run: what stops it and what to do."""


def _rows(store: Store) -> list:
    db = store._db  # noqa: SLF001 - the store's own module family reads its rows
    out = []
    for table in mirror.KEYS:
        cur = db.execute(f"SELECT * FROM {table}")
        names = [d[0] for d in cur.description]
        out.extend([table, [], dict(zip(names, row))] for row in cur.fetchall())
    return out


def migrate_state_dir(state_dir: Path, url: StoreURL, tls: EtcdTLS | None) -> dict[str, int]:
    """Copy ``state_dir`` onto ``url``; the figures copied (rows by table, blobs)."""
    if not (state_dir / "coordinator.db").exists():
        raise MigrationError(f"--from {state_dir}: no coordinator.db there (not a coordinator's state dir)")
    source = Store(state_dir)  # locked: a coordinator still running on it refuses the migration
    etcd = Etcd(url, tls)
    try:
        changes = _rows(source)
        memory = sqlite3.connect(":memory:", isolation_level=None)
        open_checked(memory, "the migrated copy", wal=False)
        memory.execute("BEGIN")
        mirror.install(memory)
        mirror.apply(memory, changes)
        memory.execute("COMMIT")
        return _write(etcd, url, memory.serialize(), changes, state_dir)
    except Unreachable as exc:
        raise MigrationError(str(exc)) from None
    finally:
        source.close()
        etcd.close()


def _write(etcd: Etcd, url: StoreURL, database: bytes, changes: list, state_dir: Path) -> dict[str, int]:
    p = url.prefix.encode()
    held = etcd.range(p + b"/", prefix_end(p + b"/"), limit=1, keys_only=True)
    if held.kvs:
        raise MigrationError(f"the store {url} holds state already ({held.kvs[0].key.decode()}); migrate into an "
                             "empty prefix (another /prefix in --store), or remove that one with etcdctl del --prefix")
    lease = etcd.grant(60)
    key = p + b"/leader"
    resp = etcd.txn(rpc.TxnRequest(
        compare=[rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=0)],
        success=[rpc.RequestOp(request_put=rpc.PutRequest(
            key=key, value=json.dumps({"id": "migrate", "address": ""}).encode(), lease=lease))]))
    if not resp.succeeded:
        raise MigrationError(f"a coordinator leads on {url}: stop it first")
    fence = Fence(key, resp.header.revision, "migrate")
    try:
        journal = Journal(etcd, url.prefix, fence=lambda: fence)
        journal.write_snapshot(database, 0, raise_errors=True)
        blobs = EtcdBlobs(etcd, url.prefix, lambda: fence, quota_bytes=1 << 62)
        count = 0
        for path in sorted((state_dir / "blobs").glob("*")) if (state_dir / "blobs").is_dir() else []:
            if len(path.name) == 64 and path.is_file():
                owner = state_dir / "blob-owners" / path.name
                blobs.push(path.name, path, owner.read_text() if owner.exists() else "")
                count += 1
    finally:
        etcd.revoke(lease)
    figures: dict[str, int] = {}
    for table, _, _ in changes:
        figures[table] = figures.get(table, 0) + 1
    figures["blobs"] = count
    return figures
