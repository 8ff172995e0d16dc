"""The coordinator's state on etcd: a replicated log of change sets, folded into snapshots.

Every store transaction of the leader is one *log entry* (``PREFIX/log/<seq>``: the transaction's row
changes, ``coordinator.store.mirror``, zlib-compressed JSON), written by one etcd transaction that is *fenced*:
it compares the election key's create revision with the one this leader won it at, and that the entry
does not exist yet. A deposed leader (its lease expired while it was stopped or cut off) thus writes
nothing: its transaction fails and it steps down (``Deposed``). An entry larger than ``PART_BYTES`` is
staged first as parts (``PREFIX/part/<seq>/<i>``), each in its own fenced transaction; the entry that
names them is written last, so a reader never sees half of one. Every request stays within etcd's
defaults (1.5 MiB per request, 128 operations per transaction).

When the log has grown past the size of the last snapshot (at least ``SNAPSHOT_MIN_BYTES``), the leader
writes the whole database (SQLite ``serialize``, compressed) as ``PREFIX/snap/<seq>/<i>`` chunks, then in one
fenced transaction points ``PREFIX/snapshot`` at it and deletes the entries and parts it covers, and compacts
etcd's history: the store's size stays proportional to the state, and each byte written is written about
twice at most.

A reader (a standby, a leader taking over, ``ctl coordinator migrate``) loads the snapshot and the entries
after it at one etcd revision, then follows new entries with a watch from the next revision.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import grpc
import structlog
from aetcd.rpc import rpc_pb2 as rpc

from rankctl.coordinator.store import mirror
from rankctl.coordinator.ha.etcd import Etcd, Unreachable, prefix_end
from rankctl.coordinator.store.database import StoreError

log = structlog.get_logger("rankctl.coordinator")
PART_BYTES = 1 << 20          # an entry, part or snapshot chunk; etcd takes 1.5 MiB per request
SNAPSHOT_MIN_BYTES = 4 << 20  # log bytes before the first snapshot


class Deposed(StoreError):
    """This coordinator's leadership ended: its write was refused by the fence; nothing was changed."""


@dataclass(frozen=True)
class Fence:
    """The election key and the create revision at which this coordinator won it."""

    key: bytes
    revision: int
    holder: str


@dataclass
class Loaded:
    snapshot: bytes | None         # a serialized SQLite database, or None (no snapshot yet)
    entries: list[tuple[int, list]] = field(default_factory=list)  # (seq, changes) after it, in order
    revision: int = 0               # the etcd revision they were read at
    seq: int = 0                    # the last entry's seq (the snapshot's when no entry follows)


def _seq_key(base: bytes, seq: int) -> bytes:
    return base + b"%020d" % seq


class Journal:
    """The log of one store prefix on ``etcd``; ``fence()`` gives the leader's Fence (None: not leading)."""

    def __init__(self, etcd: Etcd, prefix: str, fence: Callable[[], Fence | None],
                 on_deposed: Callable[[str], None] = lambda why: None) -> None:
        self.etcd, self.fence, self.on_deposed = etcd, fence, on_deposed
        p = prefix.encode()
        self.log_key, self.part_key, self.snap_key = p + b"/log/", p + b"/part/", p + b"/snap/"
        self.pointer = p + b"/snapshot"
        self.seq = 0                    # the newest entry in the local copy
        self.since_snapshot = 0         # entry bytes written since the newest snapshot
        self.snapshot_bytes = 0
        self.entries_written = 0
        self._snapshotting = threading.Lock()

    # -- reading ---------------------------------------------------------------------------------
    def load(self) -> Loaded:
        """The snapshot and every later entry, read at one revision (retried when compacted meanwhile)."""
        for _ in range(5):
            try:
                return self._load_once()
            except grpc.RpcError as exc:
                if exc.code() is not grpc.StatusCode.OUT_OF_RANGE:  # ErrCompacted: read again, newer
                    raise
        return self._load_once()

    def _load_once(self) -> Loaded:
        first = self.etcd.range(self.pointer)
        rev = first.header.revision
        out = Loaded(None, revision=rev)
        if first.kvs:
            pointer = json.loads(first.kvs[0].value)
            out.seq = pointer["seq"]
            base = _seq_key(self.snap_key, pointer["seq"]) + b"/"
            data = b"".join(kv.value for kv in self.etcd.scan(base, prefix_end(base), revision=rev, page=16))
            out.snapshot = zlib.decompress(data)
        start = _seq_key(self.log_key, out.seq + 1)
        for kv in self.etcd.scan(start, prefix_end(self.log_key), revision=rev, page=64):
            seq = int(kv.key[len(self.log_key):])
            out.entries.append((seq, self.changes_of(seq, kv.value, revision=rev)))
            out.seq = seq
        self.since_snapshot = len(out.entries) * 1024  # their sizes unread: roughly 1 KiB each
        return out

    def changes_of(self, seq: int, value: bytes, *, revision: int = 0) -> list:
        record = mirror.decode(value)
        if "parts" in record:
            base = _seq_key(self.part_key, seq) + b"/"
            data = b"".join(kv.value for kv in self.etcd.scan(base, prefix_end(base), revision=revision, page=8))
            record = mirror.decode(data)
        return record["changes"]

    def seq_of(self, key: bytes) -> int | None:
        """The seq of a log entry's key (None for any other key)."""
        if not key.startswith(self.log_key):
            return None
        return int(key[len(self.log_key):])

    # -- writing ---------------------------------------------------------------------------------
    def _fenced(self, fence: Fence) -> rpc.Compare:
        return rpc.Compare(key=fence.key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                           create_revision=fence.revision)

    def _fence_or_refuse(self, what: str) -> Fence:
        fence = self.fence()
        if fence is None:
            raise Deposed(f"the coordinator could not store {what}: it no longer leads; nothing was changed")
        return fence

    def commit(self, changes: list, what: str) -> None:
        """Append one entry (the next seq); StoreError when etcd is unreachable, Deposed when fenced out."""
        fence = self._fence_or_refuse(what)
        seq, cid = self.seq + 1, f"{fence.holder}:{fence.revision}:{self.seq + 1}"
        body = mirror.encode({"id": cid, "changes": changes})
        try:
            if len(body) > PART_BYTES:
                for i in range(0, len(body), PART_BYTES):
                    key = _seq_key(self.part_key, seq) + b"/%06d" % (i // PART_BYTES)
                    self._put_fenced(fence, key, body[i:i + PART_BYTES], what)
                value = mirror.encode({"id": cid, "parts": -(-len(body) // PART_BYTES)})
            else:
                value = body
            key = _seq_key(self.log_key, seq)
            req = rpc.TxnRequest(
                compare=[self._fenced(fence), rpc.Compare(key=key, target=rpc.Compare.CREATE,
                                                          result=rpc.Compare.EQUAL, create_revision=0)],
                success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))],
                failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))])
            resp = self.etcd.txn(req)
        except Unreachable as exc:
            raise StoreError(f"the coordinator could not store {what}: {exc}; nothing was changed") from None
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            if not (kvs and mirror.decode(kvs[0].value).get("id") == cid):  # else: our own retried write
                self.on_deposed("a fenced write was refused")
                raise Deposed(f"the coordinator could not store {what}: another coordinator leads now; "
                              "nothing was changed")
        self.seq = seq
        self.since_snapshot += len(body)
        self.entries_written += 1

    def probe(self) -> None:
        """Return when the store answers, this leader still holds its fence and no entry follows the newest one
        it wrote; else ``Unreachable``, or ``Deposed`` (fenced out, or a write whose answer was lost is in the
        store: this copy is behind it) after resigning."""
        fence = self._fence_or_refuse("a change")
        held = self.etcd.get(fence.key)
        if held is None or held.create_revision != fence.revision:
            self.on_deposed("its election key is gone")
            raise Deposed("the coordinator could not store a change: another coordinator leads now; nothing was changed")
        if self.etcd.get(_seq_key(self.log_key, self.seq + 1)) is not None:
            self.on_deposed("a write whose answer was lost is in the store")
            raise Deposed("the coordinator could not store a change: the store holds a newer entry than its copy; "
                          "nothing was changed")

    submit = commit   # as a store's replica (a standby's copy, which writes nothing; a leader's is a Replicator)

    def _put_fenced(self, fence: Fence, key: bytes, value: bytes, what: str) -> None:
        resp = self.etcd.txn(rpc.TxnRequest(compare=[self._fenced(fence)], success=[
            rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))]))
        if not resp.succeeded:
            self.on_deposed("a fenced write was refused")
            raise Deposed(f"the coordinator could not store {what}: another coordinator leads now; nothing was changed")

    # -- snapshots -------------------------------------------------------------------------------
    def snapshot_due(self) -> bool:
        return (self.since_snapshot >= max(SNAPSHOT_MIN_BYTES, self.snapshot_bytes)
                and not self._snapshotting.locked())

    def write_snapshot(self, database: bytes, seq: int, *, raise_errors: bool = False) -> None:
        """Store ``database`` (the state after entry ``seq``) and drop what it covers. Runs off the event loop;
        one at a time. Errors are logged (raised with ``raise_errors``): the log stays whole, a later snapshot
        tries again."""
        if not self._snapshotting.acquire(blocking=False):
            return
        started = time.monotonic()
        try:
            fence = self._fence_or_refuse("a snapshot")
            data = zlib.compress(database, 1)
            base = _seq_key(self.snap_key, seq) + b"/"
            for i in range(0, len(data), PART_BYTES):
                self._put_fenced(fence, base + b"%06d" % (i // PART_BYTES), data[i:i + PART_BYTES], "a snapshot")
            old = self.etcd.get(self.pointer)
            ops = [rpc.RequestOp(request_put=rpc.PutRequest(key=self.pointer, value=json.dumps(
                       {"seq": seq, "bytes": len(data), "at": time.time()}).encode())),
                   rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                       key=self.log_key, range_end=_seq_key(self.log_key, seq + 1))),
                   rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                       key=self.part_key, range_end=_seq_key(self.part_key, seq + 1)))]
            if old is not None:
                old_base = _seq_key(self.snap_key, json.loads(old.value)["seq"]) + b"/"
                ops.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                    key=old_base, range_end=prefix_end(old_base))))
            resp = self.etcd.txn(rpc.TxnRequest(compare=[self._fenced(fence)], success=ops))
            if not resp.succeeded:
                raise Deposed("the snapshot was fenced out: another coordinator leads now")
            self.since_snapshot, self.snapshot_bytes = 0, len(data)
            self.etcd.compact(resp.header.revision)
            log.info("store.snapshot", seq=seq, bytes=len(data), seconds=round(time.monotonic() - started, 3))
        except (StoreError, Unreachable, grpc.RpcError) as exc:
            if raise_errors:
                raise
            log.warning("store.snapshot_failed", seq=seq, error=str(exc))
        finally:
            self._snapshotting.release()
