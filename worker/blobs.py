"""Shipped workdirs on this node: fetched once per digest, verified, extracted safely, cached.

``STATE_DIR/workdirs/<hex>/`` holds the extracted archive once ``STATE_DIR/workdirs/<hex>.done`` exists;
it is built in a temporary directory beside it and renamed into place, so a crash leaves no half
workdir that counts as complete. Extraction uses tarfile's ``data`` filter (no absolute paths, no
``..``, no links leading out, no device files) and a cap on the bytes and members extracted.
Concurrent Assigns of one digest share one fetch.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator, Callable

DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
MAX_EXTRACTED_BYTES = 8 << 30
MAX_MEMBERS = 1_000_000


class FetchFailed(RuntimeError):
    """A workdir could not be fetched or extracted: one line saying why."""


def extract(archive: Path, dest: Path, max_bytes: int = MAX_EXTRACTED_BYTES) -> None:
    """Extract the tar.gz ``archive`` into the new directory ``dest``; FetchFailed for an unsafe member."""
    dest.mkdir()
    try:
        with tarfile.open(archive, "r:gz") as tar:
            total = 0
            members = []
            for m in tar:
                if m.name.startswith("/") or ".." in m.name.split("/"):
                    raise FetchFailed(f"the archive holds {m.name!r}, a path leading outside the workdir")
                total += max(m.size, 0)
                members.append(m)
                if total > max_bytes or len(members) > MAX_MEMBERS:
                    raise FetchFailed(f"the archive extracts to more than {max_bytes} bytes or {MAX_MEMBERS} files")
                if not (m.isreg() or m.isdir() or m.issym()):
                    raise FetchFailed(f"the archive holds {m.name!r}, which is not a file, a directory or a symlink")
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise FetchFailed(f"unsafe or unreadable archive: {exc}") from None


class WorkdirCache:
    """``path(digest)``: the extracted workdir, fetched through ``fetch(digest) -> async chunks`` if needed."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / "workdirs"
        self._pending: dict[str, asyncio.Future[Path]] = {}
        self.fetches = 0  # archives fetched (the rest came from the cache)

    def _hex(self, digest: str) -> str:
        m = DIGEST_RE.fullmatch(digest or "")
        if m is None:
            raise FetchFailed(f"workdir blob {str(digest)[:80]!r} is not sha256:<64 hex digits>")
        return m.group(1)

    async def path(self, digest: str, fetch: Callable[[str], AsyncIterator[Any]]) -> Path:
        hx = self._hex(digest)
        if (self.root / f"{hx}.done").exists():
            return self.root / hx
        if hx not in self._pending:
            self._pending[hx] = asyncio.ensure_future(self._fetch(digest, hx, fetch))
            self._pending[hx].add_done_callback(lambda _: self._pending.pop(hx, None))
        return await asyncio.shield(self._pending[hx])

    async def _fetch(self, digest: str, hx: str, fetch: Callable[[str], AsyncIterator[Any]]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{hx[:12]}-"))
        try:
            archive, sha = tmp / "archive.tar.gz", hashlib.sha256()
            with open(archive, "wb") as f:
                async for data in fetch(digest):
                    sha.update(data)
                    await asyncio.to_thread(f.write, data)
            if sha.hexdigest() != hx:
                raise FetchFailed(f"workdir blob {digest} arrived with sha256:{sha.hexdigest()}")
            await asyncio.to_thread(extract, archive, tmp / "tree")
            final = self.root / hx
            shutil.rmtree(final, ignore_errors=True)  # an incomplete one from before a crash
            os.replace(tmp / "tree", final)
            (self.root / f"{hx}.done").touch()
            self.fetches += 1
            return final
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
