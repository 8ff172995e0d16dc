"""Blobs (packed workdirs) on a replicated store, so that a new leader has every blob its jobs still need.

Each coordinator keeps its blobs as files (``coordinator.store.blobs``); on etcd a blob is also stored as
``PREFIX/blobdata/<hex>/<i>`` chunks of at most 1 MiB and a ``PREFIX/blobmeta/<hex>`` record (size, owner,
time) written last, every write fenced by the leader's election key. An upload is acknowledged only once
its blob is on etcd. Standbys copy the blobs they lack while they wait (``pull_missing``), and a leader that
lacks one when it is asked for fetches it first. The bytes on etcd are bounded (``quota_bytes``, refused
past it, naming the bound); the blob GC deletes a collected blob here too.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from aetcd.rpc import rpc_pb2 as rpc

from rankctl.coordinator.ha.etcd import Etcd, prefix_end
from rankctl.coordinator.ha.journal import Deposed, Fence

CHUNK = 1 << 20
STORE_QUOTA_BYTES = 512 << 20   # blob bytes on etcd (its own default quota is 2 GiB for everything)


class EtcdBlobs:
    def __init__(self, etcd: Etcd, prefix: str, fence: Callable[[], Fence | None],
                 quota_bytes: int = STORE_QUOTA_BYTES) -> None:
        self.etcd, self.fence, self.quota_bytes = etcd, fence, quota_bytes
        self.meta_key, self.data_key = (prefix + "/blobmeta/").encode(), (prefix + "/blobdata/").encode()

    def listing(self) -> dict[str, dict]:
        """hex -> meta of every blob on the store."""
        return {kv.key[len(self.meta_key):].decode(): json.loads(kv.value)
                for kv in self.etcd.scan(self.meta_key, prefix_end(self.meta_key))}

    def used(self) -> int:
        return sum(m.get("size", 0) for m in self.listing().values())

    def push(self, hx: str, path: Path, owner: str) -> None:
        """Store the file ``path`` as blob ``hx`` (blocking). BlobQuota past the bound, Deposed when fenced out,
        Unreachable when etcd does not answer."""
        size = path.stat().st_size
        if self.etcd.get(self.meta_key + hx.encode()) is not None:
            return
        used = self.used()
        if used + size > self.quota_bytes:
            raise OverflowError(f"the store holds {used} bytes of blobs and takes at most {self.quota_bytes} "
                                f"bytes of blobs in all; this blob is {size} bytes (the GC frees blobs no job uses)")
        base = self.data_key + hx.encode() + b"/"
        with open(path, "rb") as f:
            i = 0
            while data := f.read(CHUNK):
                self._put(base + b"%06d" % i, data)
                i += 1
        self._put(self.meta_key + hx.encode(), json.dumps({"size": size, "owner": owner, "at": time.time(),
                                                          "chunks": i}).encode())

    def _put(self, key: bytes, value: bytes) -> None:
        fence = self.fence()
        if fence is None:
            raise Deposed("this coordinator no longer leads; the blob was not stored")
        resp = self.etcd.txn(rpc.TxnRequest(
            compare=[rpc.Compare(key=fence.key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                                 create_revision=fence.revision)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))]))
        if not resp.succeeded:
            raise Deposed("another coordinator leads now; the blob was not stored")

    def delete(self, hx: str) -> None:
        fence = self.fence()
        if fence is None:
            return
        base = self.data_key + hx.encode() + b"/"
        self.etcd.txn(rpc.TxnRequest(
            compare=[rpc.Compare(key=fence.key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                                 create_revision=fence.revision)],
            success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=self.meta_key + hx.encode())),
                     rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=base, range_end=prefix_end(base)))]))

    def pull(self, hx: str, root: Path, owners: Path, meta: dict | None = None) -> bool:
        """Copy blob ``hx`` into ``root`` (its owner into ``owners``); False when the store lacks it."""
        if meta is None:
            kv = self.etcd.get(self.meta_key + hx.encode())
            if kv is None:
                return False
            meta = json.loads(kv.value)
        base = self.data_key + hx.encode() + b"/"
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".pull-")
        try:
            with os.fdopen(fd, "wb") as f:
                for kv in self.etcd.scan(base, prefix_end(base), page=4):
                    f.write(kv.value)
                f.flush()
                os.fsync(f.fileno())
            if os.path.getsize(tmp) != meta.get("size"):
                return False
            (owners / hx).write_text(meta.get("owner", ""))
            os.utime(tmp, (meta.get("at", time.time()),) * 2)
            os.replace(tmp, root / hx)
            return True
        finally:
            Path(tmp).unlink(missing_ok=True)

    def pull_missing(self, root: Path, owners: Path) -> int:
        """Copy every blob of the store that ``root`` lacks; how many were copied."""
        got = 0
        for hx, meta in self.listing().items():
            if not (root / hx).exists() and self.pull(hx, root, owners, meta):
                got += 1
        return got
