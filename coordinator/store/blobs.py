"""The coordinator's blob store: content-addressed files under ``STATE_DIR/blobs/<hex>`` (packed workdirs).

A blob is received into a temporary file beside the store, capped in size while it arrives,
verified against its sha256 digest, fsynced and renamed into place; a wrong digest, an
oversize upload or a full disk (RESOURCE_EXHAUSTED naming the disk) leaves nothing. A blob already
stored is never written again. File I/O runs on worker threads (``asyncio.to_thread``), one chunk at a time.

Quota: each blob is charged to its first uploader (``STATE_DIR/blob-owners/<hex>`` holds the name; "" without
TLS); an upload that would take the submitter past ``quota_bytes`` is refused (RESOURCE_EXHAUSTED naming the
submitter, the quota and the use). GC (``collect``, off the event loop): a blob no live job and no job finished
within ``retention_s`` references, and not uploaded or asked for (StatBlob) within ``retention_s``, is deleted.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable

import grpc
import structlog

from rankctl.coordinator.api.grpcstatus import os_status
from rankctl.coordinator.model.errors import CoordinatorError, InvalidRequest
from rankctl.coordinator.store.database import StoreError
from rankctl.kinds import registry

DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
CHUNK = 1 << 20
MAX_BLOB_BYTES = 1 << 30  # the python kind's largest workdir_max_mb, packed
QUOTA_BYTES = 10 << 30  # stored blob bytes per submitter, by default
RETENTION_S = 7 * 86400  # a blob unreferenced this long (by live or recently finished jobs) is collected
GC_PERIOD_S = 3600.0  # how often the coordinator collects
log = structlog.get_logger("rankctl.coordinator")


class BlobMissing(CoordinatorError):
    """A spec references a blob this coordinator does not hold (FAILED_PRECONDITION)."""


class BlobRefused(StoreError):
    """The disk under the blob store is full, or the submitter's quota is used up (RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, full=True)


def hex_of(digest: str) -> str:
    """The 64 hex digits of ``sha256:<hex>``; InvalidRequest otherwise."""
    m = DIGEST_RE.fullmatch(digest or "")
    if m is None:
        raise InvalidRequest(f"blob digest {digest[:80]!r} is not sha256:<64 lower-case hex digits>")
    return m.group(1)


class BlobStore:
    """``max_bytes``: one blob's cap; ``quota_bytes``: stored bytes per submitter; ``retention_s``: see ``collect``."""

    def __init__(self, state_dir: Path | str, max_bytes: int = MAX_BLOB_BYTES, *, quota_bytes: int = QUOTA_BYTES,
                 retention_s: float = RETENTION_S, backing: Any = None) -> None:
        self.root = Path(state_dir) / "blobs"
        self.owners = Path(state_dir) / "blob-owners"
        self.root.mkdir(parents=True, exist_ok=True)
        self.owners.mkdir(exist_ok=True)
        self.backing = backing  # a replicated store's copy (``coordinator.ha.etcdblobs.EtcdBlobs``), or None
        if backing is not None:
            backing.pull_missing(self.root, self.owners)
        self.max_bytes, self.quota_bytes, self.retention_s = max_bytes, quota_bytes, retention_s
        self.use: dict[str, int] = {}  # submitter -> stored bytes
        for p in self._stored():
            self._charge(self._owner(p.name), p.stat().st_size)

    def _stored(self) -> list[Path]:
        return [p for p in self.root.iterdir() if DIGEST_RE.fullmatch(f"sha256:{p.name}")]

    def _owner(self, hx: str) -> str:
        try:
            return (self.owners / hx).read_text()
        except FileNotFoundError:
            return ""

    def _charge(self, owner: str, size: int) -> None:
        self.use[owner] = self.use.get(owner, 0) + size
        if self.use[owner] <= 0:
            del self.use[owner]

    def path(self, digest: str) -> Path:
        return self.root / hex_of(digest)

    def size(self, digest: str) -> int | None:
        """The stored blob's size, or None when it is not stored. Asking counts as a use (its mtime is
        renewed): ctl asks before it submits a job naming the blob, so GC keeps it for that submit."""
        path = self.path(digest)
        try:
            os.utime(path)
            return path.stat().st_size
        except FileNotFoundError:
            return None
        except PermissionError:
            return path.stat().st_size

    def count(self) -> int:
        return len(self._stored())

    def missing(self, digests: Iterable[str]) -> list[str]:
        return [d for d in digests if self.size(d) is None]

    async def put(self, digest: str, size: int, chunks: AsyncIterator[bytes], owner: str = "") -> int:
        """Store ``chunks`` as ``digest`` (declared ``size`` bytes) for ``owner`` (the submitter); returns the
        size. An existing blob is kept (the upload is drained, not written). InvalidRequest for a wrong size,
        digest or cap; BlobRefused past the owner's quota or on a full disk; OSError for other causes."""
        final = self.path(digest)
        if not 0 <= size <= self.max_bytes:
            raise InvalidRequest(f"blob of {size} bytes: at most {self.max_bytes} bytes are accepted")
        if final.exists():
            async for _ in chunks:
                pass
            return final.stat().st_size
        used = self.use.get(owner, 0)
        if used + size > self.quota_bytes:
            raise BlobRefused(f"submitter {owner or '(no TLS identity)'!s} would pass the blob quota of "
                              f"{self.quota_bytes} bytes: {used} bytes stored, this upload is {size}")
        self._charge(owner, size)  # reserved before the first await: two uploads at once cannot both fit
        try:
            stored = await self._write(final, digest, size, chunks, owner)
        except OSError as exc:
            self._charge(owner, -size)
            code, message = os_status(exc, self.root)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise BlobRefused(message) from None
            raise
        except BaseException:
            self._charge(owner, -size)
            raise
        if not stored:  # the same blob arrived whole from another upload meanwhile: charged there
            self._charge(owner, -size)
        return size

    async def _write(self, final: Path, digest: str, size: int, chunks: AsyncIterator[bytes], owner: str) -> bool:
        """Whether this upload stored the blob (False: another one stored it first)."""
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                got, sha = await self._receive(f, size, chunks)
                await asyncio.to_thread(os.fsync, f.fileno())
            if got != size or f"sha256:{sha}" != digest:
                raise InvalidRequest(f"upload of {digest} does not match: {got} bytes with sha256:{sha}, "
                                     f"declared {size} bytes")
            if final.exists():  # no await since the check in put: another upload finished first
                Path(tmp).unlink(missing_ok=True)
                return False
            (self.owners / final.name).write_text(owner)
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if self.backing is not None:  # acknowledged only once it is on the replicated store too
            try:
                await asyncio.to_thread(self.backing.push, final.name, final, owner)
            except BaseException as exc:
                final.unlink(missing_ok=True)
                (self.owners / final.name).unlink(missing_ok=True)
                if isinstance(exc, OverflowError):
                    raise BlobRefused(str(exc)) from None
                if isinstance(exc, Exception) and not isinstance(exc, StoreError):
                    raise StoreError(f"the blob {digest} could not be stored: {exc}") from None
                raise
        return True

    def collect(self, referenced: set[str], now: float | None = None) -> list[str]:
        """Delete every blob not in ``referenced`` (digests of live and recently finished jobs) and not used
        (uploaded or asked for) within ``retention_s``; returns the digests deleted. Blocking: run it on a
        worker thread (``collect_loop``)."""
        now = time.time() if now is None else now
        gone = []
        for p in self._stored():
            digest = f"sha256:{p.name}"
            try:
                if digest in referenced or now - p.stat().st_mtime < self.retention_s:
                    continue
                size, owner = p.stat().st_size, self._owner(p.name)
                p.unlink()
            except FileNotFoundError:
                continue
            (self.owners / p.name).unlink(missing_ok=True)
            self._charge(owner, -size)
            if self.backing is not None:
                self.backing.delete(p.name)
            gone.append(digest)
        return gone

    async def _receive(self, f, size: int, chunks: AsyncIterator[bytes]) -> tuple[int, str]:  # noqa: ANN001
        got, sha = 0, hashlib.sha256()
        async for data in chunks:
            got += len(data)
            if got > size:
                raise InvalidRequest(f"upload is larger than its declared {size} bytes")
            sha.update(data)
            await asyncio.to_thread(f.write, data)
        return got, sha.hexdigest()

    async def read(self, digest: str) -> AsyncIterator[bytes]:
        """The stored blob, chunk by chunk; BlobMissing when it is not stored."""
        path = self.path(digest)
        if self.backing is not None and not path.exists():  # taken over before this blob was copied here
            await asyncio.to_thread(self.backing.pull, path.name, self.root, self.owners)
        try:
            f = await asyncio.to_thread(open, path, "rb")
        except FileNotFoundError:
            raise BlobMissing(f"blob {digest} is not stored on the coordinator") from None
        try:
            while data := await asyncio.to_thread(f.read, CHUNK):
                yield data
        finally:
            f.close()


def referenced(jobs: Iterable[Any], now: float, retention_s: float) -> set[str]:
    """The blobs of ``jobs`` (JobRecords) still live or finished within ``retention_s``."""
    out: set[str] = set()
    for job in jobs:
        if not job.finished_at or now - job.finished_at < retention_s:
            out.update(registry.blobs_of(job.spec))
    return out


async def collect_loop(blobs: BlobStore, jobs: Callable[[], Iterable[Any]], *, period_s: float = GC_PERIOD_S,
                       clock: Callable[[], float] = time.time) -> None:
    """Collect ``blobs`` at start and every ``period_s``; ``jobs()``: every job the coordinator holds (a
    snapshot taken on the loop, the rest on a worker thread). Never raises: a failed round is logged."""
    while True:
        try:
            snapshot, now = list(jobs()), clock()
            refs = await asyncio.to_thread(referenced, snapshot, now, blobs.retention_s)
            gone = await asyncio.to_thread(blobs.collect, refs, now)
            if gone:
                log.info("blobs.collected", count=len(gone), blobs=blobs.count())
        except Exception:  # noqa: BLE001 - the loop outlives one bad round
            log.exception("blobs.collect_failed")
        await asyncio.sleep(period_s)
