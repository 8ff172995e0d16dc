"""Shipping ``python.workdir``: ``ctl`` packs it, content-addressed, and uploads it once.

The archive is a deterministic tar.gz (sorted paths, mtime 0, uid/gid 0, modes kept; regular files,
directories and symlinks that stay inside the workdir; a symlink leading out of it is refused), without
``.git/`` and what the workdir's top-level ``.rankctlignore`` (else ``.gitignore``) excludes. Its size is
counted while packing and capped by ``python.workdir_max_mb``. Its digest is ``sha256:<hex>`` of the
archive; ``ctl`` uploads it unless the coordinator holds it already and adds ``python.workdir_blob``.
No torch or grpc here: ``ship`` takes the connected client.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterator

from rankctl.cli.errors import CtlError
from rankctl.contract.names import shown

if TYPE_CHECKING:
    from rankctl.cli.client import Client
    from rankctl.contract.spec import JobSpec
    from rankctl.kinds.registry import Shipment

IGNORE_FILES = (".rankctlignore", ".gitignore")
CHUNK = 1 << 20
MB = 1 << 20


class TooLarge(Exception):
    """The packed workdir passed its cap (raised while packing, before it is complete)."""


def _glob_regex(glob: str) -> str:
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        elif glob[i] == "[" and (end := glob.find("]", i + 2)) != -1:
            body = glob[i + 1:end]
            out.append("[" + ("^" + body[1:] if body[0] == "!" else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(glob[i + 1] if glob[i] == "\\" and i + 1 < len(glob) else glob[i]))
            i += 2 if glob[i] == "\\" else 1
    return "".join(out)


@dataclass(frozen=True)
class _Rule:
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


class IgnoreRules:
    """gitignore-style patterns of one file at the workdir's top: ``*.pyc``, ``dir/``, ``/anchored``,
    ``a/**/b``, ``!negation``; the last matching pattern wins; an excluded directory is not entered."""

    def __init__(self, lines: list[str]) -> None:
        self.rules: list[_Rule] = []
        for raw in lines:
            line = raw.rstrip("\n").rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = line[1:] if negate else line.removeprefix("\\")
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            if not line:
                continue
            anchored = "/" in line
            body = _glob_regex(line.lstrip("/"))
            self.rules.append(_Rule(re.compile(("" if anchored else "(?:.*/)?") + body), negate, dir_only))

    @classmethod
    def of(cls, workdir: Path) -> "IgnoreRules":
        for name in IGNORE_FILES:
            if (workdir / name).is_file():
                return cls((workdir / name).read_text(errors="replace").splitlines())
        return cls([])

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """``rel``: the path relative to the workdir, with ``/``."""
        if rel == ".git" or rel.startswith(".git/"):
            return True
        out = False
        for rule in self.rules:
            if (is_dir or not rule.dir_only) and rule.regex.fullmatch(rel):
                out = not rule.negate
        return out


def walk(workdir: Path, rules: IgnoreRules) -> Iterator[tuple[str, os.DirEntry]]:
    """(relative path, entry) of everything kept, depth first in name order (parents first); a stack, not
    recursion, so any depth the file system allows is walked."""
    stack: list[Iterator[os.DirEntry]] = []
    prefixes: list[str] = []

    def enter(prefix: str) -> None:
        with os.scandir(workdir / prefix if prefix else workdir) as it:
            stack.append(iter(sorted(it, key=lambda e: e.name)))
        prefixes.append(prefix)
    enter("")
    while stack:
        e = next(stack[-1], None)
        if e is None:
            stack.pop()
            prefixes.pop()
            continue
        rel = f"{prefixes[-1]}{e.name}"
        is_dir = e.is_dir(follow_symlinks=False)
        if rules.ignored(rel, is_dir):
            continue
        yield rel, e
        if is_dir:
            enter(f"{rel}/")


class _Sink:
    """A file that hashes and counts what is written and stops at ``cap`` bytes."""

    def __init__(self, f: IO[bytes], cap: int) -> None:
        self.f, self.cap, self.size, self.sha = f, cap, 0, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.size += len(data)
        if self.size > self.cap:
            raise TooLarge()
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _tarinfo(workdir: Path, rel: str, entry: os.DirEntry) -> tarfile.TarInfo:
    st = entry.stat(follow_symlinks=False)
    info = tarfile.TarInfo(rel)
    info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = st.st_mode & 0o7777, 0, 0, 0, "", ""
    if entry.is_symlink():
        target = os.readlink(entry.path)
        try:
            inside = Path(entry.path).resolve().is_relative_to(workdir.resolve())
        except RuntimeError:   # a loop of links
            raise CtlError(f"python.workdir {workdir}: symlink {rel} -> {target} is a loop of links; remove it or "
                           "ignore it in .rankctlignore") from None
        if not inside or os.path.isabs(target):
            raise CtlError(f"python.workdir {workdir}: symlink {rel} -> {target} leads outside the workdir; "
                           "ignore it in .rankctlignore or copy what it points to")
        info.type, info.linkname = tarfile.SYMTYPE, target
    elif entry.is_dir(follow_symlinks=False):
        info.type = tarfile.DIRTYPE
    elif entry.is_file(follow_symlinks=False):
        info.size = st.st_size
    else:
        raise CtlError(f"python.workdir {workdir}: {rel} is neither a file, a directory nor a symlink")
    return info


def pack(workdir: Path, out: IO[bytes], cap_bytes: int) -> tuple[str, int]:
    """Write the workdir's archive to ``out``; returns (``sha256:<hex>``, size). TooLarge past ``cap_bytes``."""
    sink = _Sink(out, cap_bytes)
    rules = IgnoreRules.of(workdir)
    with gzip.GzipFile(filename="", mode="wb", fileobj=sink, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, entry in walk(workdir, rules):
            info = _tarinfo(workdir, rel, entry)
            if info.isreg():
                with open(entry.path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return f"sha256:{sink.sha.hexdigest()}", sink.size


@dataclass
class Packed:
    workdir: Path
    digest: str
    size: int
    file: IO[bytes]
    field: str  # the spec field that references the blob


def pack_workdir(spec: "JobSpec") -> Packed | None:
    """The directory the job's kind ships (``JobKind.shipment``: a python job's workdir) packed into a
    temporary file (None when there is none); CtlError (exit 2) when it is not a directory here or its
    archive passes the kind's cap."""
    from rankctl.kinds import registry

    hook = registry.get(spec.kind).resolve("shipment")
    what = hook(spec) if hook else None
    if what is None:
        return None
    workdir = Path(what.directory)
    try:
        is_dir = workdir.is_dir()
    except (OSError, ValueError) as exc:
        raise CtlError(f"{what.source} {shown(str(workdir))} cannot be read here: {exc}") from None
    if not is_dir:
        raise CtlError(f"{what.source} {workdir} is not a directory here; ctl packs it and ships it to the nodes")
    if what.inside is not None:
        _check_inside(workdir, what)
    f = tempfile.TemporaryFile(prefix="rankctl-workdir-")
    try:
        digest, size = pack(workdir, f, what.max_mb * MB)
    except OSError as exc:
        f.close()
        raise CtlError(f"{what.source} {workdir} cannot be packed: {shown(str(exc), 300)}") from None
    except TooLarge:
        f.close()
        raise CtlError(f"{what.source} {workdir} packs to more than {what.max_mb} MiB (packing stopped "
                       f"there), over the cap {what.cap}={what.max_mb}: exclude large files "
                       "in its .rankctlignore (or .gitignore) or raise the cap") from None
    except BaseException:
        f.close()
        raise
    return Packed(workdir, digest, size, f, what.field)


def _check_inside(workdir: Path, what: "Shipment") -> None:
    """The file the job runs (``Shipment.inside``) is a file inside the workdir ``ctl`` ships: ranks see nothing
    else of this machine."""
    field, rel = what.inside
    root = workdir.resolve()
    try:
        target = (root / rel).resolve()
        ok = target.is_relative_to(root) and target.is_file()
    except (OSError, RuntimeError, ValueError):
        ok = False
    if not ok:
        raise CtlError(f"{field} {shown(rel)} is not a file inside {what.source} {workdir}: ctl ships only the "
                       "workdir, so the script must be in it (or give an absolute path that exists on the nodes)")


def ship(client: "Client", packed: Packed | None) -> list[str]:
    """Upload the packed workdir unless the coordinator holds it; the override that references it."""
    if packed is None:
        return []
    try:
        if not client.stat_blob(packed.digest):
            packed.file.seek(0)
            client.upload_blob(packed.digest, packed.size, iter(lambda: packed.file.read(CHUNK), b""))
    finally:
        packed.file.close()
    return [f"{packed.field}={packed.digest}"]
