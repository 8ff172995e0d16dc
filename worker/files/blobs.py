"""Shipped workdirs on this node: fetched once per digest, verified, extracted safely, cached.

``STATE_DIR/workdirs/<hex>/`` holds the extracted archive once ``STATE_DIR/workdirs/<hex>.done`` exists;
it is built in a temporary directory beside it and renamed into place, so a crash leaves no half
workdir that counts as complete. Extraction streams the archive through tarfile's ``data`` filter (no
absolute paths, no ``..``, no links leading out, no device files), and no member is written at or through a link an
earlier member made (``_through_link``: the data filter alone, before Python 3.11.13, could be led out by such
chains), counting the decompressed bytes as they
arrive: it stops past the spec's ``python.workdir_max_unpacked_mb`` (or the node's cap) or past MAX_RATIO
times the packed bytes, so a compression bomb writes less than its limit. Concurrent Assigns of one digest
share one fetch; the cache is bounded, least recently used trees evicted, pinned (running) ones kept.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import IO, Any, AsyncIterator, Callable

from rankctl.contract.files import safepath

DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
MAX_EXTRACTED_BYTES = 8 << 30  # the node's own cap on one archive, whatever its spec allows
MAX_MEMBERS = 1_000_000
MAX_RATIO = 100  # unpacked / packed bytes, past RATIO_FLOOR: more is a compression bomb
RATIO_FLOOR = 16 << 20  # an archive may always unpack to this much, whatever its ratio
CACHE_BYTES = 20 << 30  # the node's workdir cache, by default (least recently used trees are evicted)
READ = 1 << 20


class FetchFailed(RuntimeError):
    """A workdir could not be fetched or extracted: one line saying why."""


class _Meter(io.RawIOBase):
    """The archive's decompressed stream, counted as it arrives: FetchFailed once it passes ``limit`` bytes
    or ``MAX_RATIO`` times the compressed bytes read (the bytes, not the tar headers, which can lie)."""

    def __init__(self, raw: IO[bytes], limit: int, what: str) -> None:
        self.raw, self.gz, self.limit, self.what, self.total = raw, gzip.GzipFile(fileobj=raw), limit, what, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:  # noqa: ANN001 - a writable buffer
        data = self.gz.read(len(buf))
        self.total += len(data)
        if self.total > self.limit:
            raise FetchFailed(f"unpacks past {self.what} (stopped at {self.limit} bytes)")
        packed = max(self.raw.tell(), 1)
        if self.total > RATIO_FLOOR and self.total > MAX_RATIO * packed:
            raise FetchFailed(f"unpacks to more than {MAX_RATIO}x its packed size, a compression bomb "
                              f"(stopped at {self.total} bytes from {packed} packed)")
        buf[:len(data)] = data
        return len(data)


def _check(m: tarfile.TarInfo, count: int) -> None:
    if m.name.startswith("/") or ".." in m.name.split("/"):
        raise FetchFailed(f"the archive holds {m.name!r}, a path leading outside the workdir")
    if count > MAX_MEMBERS:
        raise FetchFailed(f"the archive holds more than {MAX_MEMBERS} files")
    if not (m.isreg() or m.isdir() or m.issym()) or m.issparse():
        raise FetchFailed(f"the archive holds {m.name!r}, which is not a file, a directory or a symlink")


def _through_link(name: str, links: set[str]) -> str | None:
    """The earlier symlink member that ``name`` (a member's name) is at or below, or None."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return next(("/".join(parts[:i]) for i in range(1, len(parts) + 1) if "/".join(parts[:i]) in links), None)


def extract(archive: Path, dest: Path, max_bytes: int = MAX_EXTRACTED_BYTES,
            what: str = "") -> None:
    """Extract the tar.gz ``archive`` into the new directory ``dest``, streaming: FetchFailed for an unsafe
    member, or once the decompressed bytes pass ``max_bytes`` (``what`` names that limit) or MAX_RATIO;
    less than the limit is written then (the caller removes ``dest``)."""
    dest.mkdir()
    what = what or f"the node's cap of {max_bytes} bytes"
    try:
        with open(archive, "rb") as raw, tarfile.open(fileobj=_Meter(raw, max_bytes, what), mode="r|") as tar:
            links: set[str] = set()
            for count, m in enumerate(tar, 1):
                _check(m, count)
                if (link := _through_link(m.name, links)) is not None:
                    raise FetchFailed(f"the archive holds {m.name!r}, written through its own symlink {link!r}: "
                                      "rankctl writes a workdir through no symbolic link")
                tar.extract(m, dest, filter="data")
                if m.issym():
                    links.add("/".join(p for p in m.name.split("/") if p not in ("", ".")))
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise FetchFailed(f"unsafe or unreadable archive: {exc}") from None


class WorkdirCache:
    """``path(digest)``: the extracted workdir, fetched through ``fetch(digest) -> async chunks`` if needed.

    The cache holds at most ``max_bytes`` of extracted trees: after each extraction the least recently used
    ones are removed, never one ``pin``ned by a live run (``pin(digest)`` when a run starts using the tree,
    ``unpin(digest)`` when it ends; pins count, so two runs of one digest need two unpins)."""

    def __init__(self, state_dir: Path, max_bytes: int = CACHE_BYTES) -> None:
        self.root = Path(state_dir) / "workdirs"
        self.max_bytes = max_bytes
        self._pending: dict[str, asyncio.Future[Path]] = {}
        self._pins: dict[str, int] = {}
        self.fetches = 0  # archives fetched (the rest came from the cache)

    def _hex(self, digest: str) -> str:
        m = DIGEST_RE.fullmatch(digest or "")
        if m is None:
            raise FetchFailed(f"workdir blob {str(digest)[:80]!r} is not sha256:<64 hex digits>")
        return m.group(1)

    def pin(self, digest: str) -> None:
        hx = self._hex(digest)
        self._pins[hx] = self._pins.get(hx, 0) + 1

    def unpin(self, digest: str) -> None:
        hx = self._hex(digest)
        left = self._pins.pop(hx, 0) - 1
        if left > 0:
            self._pins[hx] = left

    def pinned(self) -> dict[str, int]:
        """hex digest -> runs using its tree."""
        return dict(self._pins)

    async def path(self, digest: str, fetch: Callable[[str], AsyncIterator[Any]],
                   max_bytes: int | None = None, *, pin: bool = False) -> Path:
        """``max_bytes``: what the spec lets it unpack to (``registry.blob_limit_of``); None: the node's cap.
        ``pin``: pinned from the call on (no eviction can slip in before the caller pins), unpinned if it fails."""
        hx = self._hex(digest)
        if pin:
            self.pin(digest)
        try:
            return await self._path(digest, hx, fetch, max_bytes)
        except BaseException:
            if pin:
                self.unpin(digest)
            raise

    async def _path(self, digest: str, hx: str, fetch: Callable[[str], AsyncIterator[Any]],
                    max_bytes: int | None) -> Path:
        done = self.root / f"{hx}.done"
        if done.exists():
            os.utime(done, follow_symlinks=False)  # its use time, for eviction (a link's own: never its target's)
            return self.root / hx
        if hx not in self._pending:
            self._pending[hx] = asyncio.ensure_future(self._fetch(digest, hx, fetch, max_bytes))
            self._pending[hx].add_done_callback(lambda _: self._pending.pop(hx, None))
        return await asyncio.shield(self._pending[hx])

    async def _fetch(self, digest: str, hx: str, fetch: Callable[[str], AsyncIterator[Any]],
                     max_bytes: int | None) -> Path:
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
            limit = min(max_bytes or MAX_EXTRACTED_BYTES, MAX_EXTRACTED_BYTES)
            what = (f"python.workdir_max_unpacked_mb={max_bytes >> 20}" if max_bytes and limit == max_bytes
                    else f"the node's cap of {limit} bytes")
            await asyncio.to_thread(extract, archive, tmp / "tree", limit, what)
            final = self.root / hx
            shutil.rmtree(final, ignore_errors=True)  # an incomplete one from before a crash
            os.replace(tmp / "tree", final)
            os.close(safepath.open_write(str(self.root), str(self.root / f"{hx}.done")))  # a link there: refused
            self.fetches += 1
            return final
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            await asyncio.to_thread(self.evict, {hx, *self._pins})

    def evict(self, keep: set[str]) -> list[str]:
        """Remove the least recently used trees until the cache holds at most ``max_bytes``; never one in
        ``keep`` (the one just extracted and the pinned ones). Returns the digests' hex removed. Runs on a
        worker thread: it walks the trees (O(files in the cache), once per extraction)."""
        trees = [(p.lstat().st_mtime, p.name[:-5]) for p in self.root.glob("*.done")]
        sizes = {hx: _tree_bytes(self.root / hx) for _, hx in trees}
        used, removed = sum(sizes.values()), []
        for _, hx in sorted(trees):
            if used <= self.max_bytes:
                break
            if hx in keep:
                continue
            (self.root / f"{hx}.done").unlink(missing_ok=True)  # first: a half-removed tree never counts as done
            shutil.rmtree(self.root / hx, ignore_errors=True)
            used -= sizes[hx]
            removed.append(hx)
        return removed


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
