"""The coordinator's blob store: content-addressed files under ``STATE_DIR/blobs/<hex>`` (packed workdirs).

A blob is received into a temporary file beside the store, capped in size while it arrives,
verified against its sha256 digest, fsynced and renamed into place; a wrong digest or an
oversize upload leaves nothing. A blob already stored is never written again. File I/O runs
on worker threads (``asyncio.to_thread``), one chunk at a time.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import AsyncIterator, Iterable

from rankctl.coordinator.errors import CoordinatorError, InvalidRequest

DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
CHUNK = 1 << 20
MAX_BLOB_BYTES = 1 << 30  # the python kind's largest workdir_max_mb, packed


class BlobMissing(CoordinatorError):
    """A spec references a blob this coordinator does not hold (FAILED_PRECONDITION)."""


def hex_of(digest: str) -> str:
    """The 64 hex digits of ``sha256:<hex>``; InvalidRequest otherwise."""
    m = DIGEST_RE.fullmatch(digest or "")
    if m is None:
        raise InvalidRequest(f"blob digest {digest[:80]!r} is not sha256:<64 lower-case hex digits>")
    return m.group(1)


class BlobStore:
    def __init__(self, state_dir: Path | str, max_bytes: int = MAX_BLOB_BYTES) -> None:
        self.root = Path(state_dir) / "blobs"
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def path(self, digest: str) -> Path:
        return self.root / hex_of(digest)

    def size(self, digest: str) -> int | None:
        """The stored blob's size, or None when it is not stored."""
        try:
            return self.path(digest).stat().st_size
        except FileNotFoundError:
            return None

    def count(self) -> int:
        return sum(1 for p in self.root.iterdir() if DIGEST_RE.fullmatch(f"sha256:{p.name}"))

    def missing(self, digests: Iterable[str]) -> list[str]:
        return [d for d in digests if self.size(d) is None]

    async def put(self, digest: str, size: int, chunks: AsyncIterator[bytes]) -> int:
        """Store ``chunks`` as ``digest`` (declared ``size`` bytes); returns the size. An existing blob is
        kept (the upload is drained, not written). InvalidRequest for a wrong size, digest or cap."""
        final = self.path(digest)
        if not 0 <= size <= self.max_bytes:
            raise InvalidRequest(f"blob of {size} bytes: at most {self.max_bytes} bytes are accepted")
        if final.exists():
            async for _ in chunks:
                pass
            return final.stat().st_size
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                got, sha = await self._receive(f, size, chunks)
                await asyncio.to_thread(os.fsync, f.fileno())
            if got != size or f"sha256:{sha}" != digest:
                raise InvalidRequest(f"upload of {digest} does not match: {got} bytes with sha256:{sha}, "
                                     f"declared {size} bytes")
            os.replace(tmp, final)
            return size
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

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
        try:
            f = await asyncio.to_thread(open, self.path(digest), "rb")
        except FileNotFoundError:
            raise BlobMissing(f"blob {digest} is not stored on the coordinator") from None
        try:
            while data := await asyncio.to_thread(f.read, CHUNK):
                yield data
        finally:
            f.close()
