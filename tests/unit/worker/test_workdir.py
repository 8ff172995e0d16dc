"""Packing a workdir (ignore rules, a deterministic digest, the cap) and extracting one safely: pure, no cluster."""

from __future__ import annotations

import io
import os
import re
import tarfile
import time
from pathlib import Path

import pytest

from rankctl.cli.errors import CtlError
from rankctl.cli.workdir import IgnoreRules, TooLarge, pack, pack_workdir, walk
from rankctl.kinds.spec import build_spec
from rankctl.worker.files.blobs import FetchFailed, extract


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def kept(root: Path) -> list[str]:
    return [rel for rel, _ in walk(root, IgnoreRules.of(root))]


def test_ignore_rules_follow_gitignore_for_the_common_cases(tmp_path: Path) -> None:
    tree(tmp_path, {
        ".gitignore": "# comment\n*.pyc\nbuild/\n/top.txt\ndata/**/*.bin\n!keep.pyc\n",
        "a.py": "", "x.pyc": "", "keep.pyc": "", "pkg/y.pyc": "", "pkg/top.txt": "", "top.txt": "",
        "build/out": "", "pkg/build/out": "", "data/d/e.bin": "", "data/e.txt": "", ".git/HEAD": "",
    })
    assert kept(tmp_path) == [".gitignore", "a.py", "data", "data/d", "data/e.txt", "keep.pyc", "pkg",
                              "pkg/top.txt"]


def test_rankctlignore_wins_over_gitignore(tmp_path: Path) -> None:
    tree(tmp_path, {".rankctlignore": "big.dat\n__pycache__/\n", ".gitignore": "*.py\n", "t.py": "",
                    "big.dat": "", "__pycache__/t.pyc": ""})
    assert kept(tmp_path) == [".gitignore", ".rankctlignore", "t.py"]


def test_the_same_tree_packs_to_the_same_digest(tmp_path: Path) -> None:
    files = {"t.py": "print(1)\n", "pkg/m.py": "x = 1\n", "pkg/sub/n.txt": "n"}
    a, b = tree(tmp_path / "a", files), tree(tmp_path / "b", dict(reversed(list(files.items()))))
    os.utime(b / "t.py", (time.time() - 1000, time.time() - 1000))
    digest_a, size_a = pack(a, io.BytesIO(), 1 << 20)
    assert pack(b, io.BytesIO(), 1 << 20) == (digest_a, size_a)
    (b / "t.py").write_text("print(2)\n")
    assert pack(b, io.BytesIO(), 1 << 20)[0] != digest_a


def test_packing_stops_at_the_cap(tmp_path: Path) -> None:
    tree(tmp_path, {"t.py": ""})
    (tmp_path / "big.bin").write_bytes(os.urandom(3 << 20))
    with pytest.raises(TooLarge):
        pack(tmp_path, io.BytesIO(), 1 << 20)
    spec = build_spec({"name": "w", "kind": "python",
                       "python": {"entrypoint": "t.py", "workdir": str(tmp_path), "workdir_max_mb": 1}})
    with pytest.raises(CtlError, match=rf"python.workdir {tmp_path} packs to more than 1 MiB .*workdir_max_mb=1"):
        pack_workdir(spec)


def test_a_symlink_leading_outside_is_refused_at_packing(tmp_path: Path) -> None:
    tree(tmp_path, {"w/t.py": "", "outside.txt": ""})
    (tmp_path / "w" / "in").symlink_to("t.py")
    digest, _ = pack(tmp_path / "w", io.BytesIO(), 1 << 20)  # a link inside is kept
    (tmp_path / "w" / "out").symlink_to("../outside.txt")
    with pytest.raises(CtlError, match="symlink out -> ../outside.txt leads outside the workdir"):
        pack(tmp_path / "w", io.BytesIO(), 1 << 20)


def _archive(path: Path, members: list[tarfile.TarInfo]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isreg() else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname, m.size = kind, link, 1 if kind == tarfile.REGTYPE else 0
    return m


@pytest.mark.parametrize("member", [
    _member("../x"), _member("a/../../x"), _member("/etc/x"),
    _member("link", tarfile.SYMTYPE, "../../outside"), _member("abs", tarfile.SYMTYPE, "/etc/passwd"),
    _member("dev", tarfile.CHRTYPE),
], ids=["dotdot", "nested-dotdot", "absolute", "escaping-symlink", "absolute-symlink", "device"])
def test_extraction_refuses_what_would_leave_the_workdir(tmp_path: Path, member: tarfile.TarInfo) -> None:
    archive = _archive(tmp_path / "a.tar.gz", [_member("ok.py"), member])
    with pytest.raises(FetchFailed):
        extract(archive, tmp_path / "out")
    assert not (tmp_path / "x").exists() and not (tmp_path.parent / "x").exists()


@pytest.mark.parametrize("written", ["l/x", "./l/x", "l"])
def test_extraction_never_writes_at_or_through_a_link_of_the_archive(tmp_path: Path, written: str) -> None:
    """Issue 43 item 1: a member written through a symlink an earlier member made (a chain the data filter of
    older Pythons could be led out by) is refused, naming the member and the rule; a link alone is kept."""
    members = [_member("sub", tarfile.DIRTYPE), _member("sub/y"), _member("l", tarfile.SYMTYPE, "sub")]
    extract(_archive(tmp_path / "ok.tar.gz", members), tmp_path / "ok")
    assert os.readlink(tmp_path / "ok" / "l") == "sub"
    archive = _archive(tmp_path / "a.tar.gz", [*members, _member(written)])
    with pytest.raises(FetchFailed, match=f"{written!r}, written through its own symlink 'l'.*no symbolic link"):
        extract(archive, tmp_path / "out")
    assert not (tmp_path / "out" / "sub" / "x").exists() and (tmp_path / "out" / "sub" / "y").read_text() == "x"


def test_extraction_round_trips_a_packed_tree_and_caps_bytes(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"t.py": "print(1)\n", "pkg/m.py": "x = 1\n"})
    (src / "t.py").chmod(0o755)
    with open(tmp_path / "a.tar.gz", "wb") as f:
        pack(src, f, 1 << 20)
    extract(tmp_path / "a.tar.gz", tmp_path / "out")
    assert (tmp_path / "out" / "pkg" / "m.py").read_text() == "x = 1\n"
    assert (tmp_path / "out" / "t.py").stat().st_mode & 0o777 == 0o755
    with pytest.raises(FetchFailed, match="past the node's cap of 4 bytes"):
        extract(tmp_path / "a.tar.gz", tmp_path / "capped", max_bytes=4)


async def _chunks(*parts: bytes):
    for p in parts:
        yield p


def test_the_blob_store_verifies_caps_and_stores_once(tmp_path: Path) -> None:
    import asyncio
    import hashlib

    from rankctl.coordinator.store.blobs import BlobStore
    from rankctl.coordinator.model.errors import InvalidRequest

    store, data = BlobStore(tmp_path, max_bytes=10), b"0123456789"
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    for size, parts, words in [(10, [b"01234", b"x" * 5], "does not match"), (10, [data, b"!"], "larger than"),
                               (11, [data], "at most 10 bytes")]:
        with pytest.raises(InvalidRequest, match=words):
            asyncio.run(store.put(digest, size, _chunks(*parts)))
        assert list(store.root.iterdir()) == []  # nothing left, not even a temporary file
    assert asyncio.run(store.put(digest, 10, _chunks(data[:4], data[4:]))) == 10
    inode = store.path(digest).stat().st_ino
    assert asyncio.run(store.put(digest, 10, _chunks(data))) == 10 and store.path(digest).stat().st_ino == inode
    assert store.count() == 1 and store.missing([digest, "sha256:" + "1" * 64]) == ["sha256:" + "1" * 64]


def test_concurrent_assigns_of_one_digest_fetch_once_and_a_bad_fetch_leaves_nothing(tmp_path: Path) -> None:
    import asyncio
    import hashlib

    from rankctl.worker.files.blobs import WorkdirCache

    src = tree(tmp_path / "src", {"t.py": "print(1)\n"})
    buf = io.BytesIO()
    digest, _ = pack(src, buf, 1 << 20)
    calls = []

    async def fetch(d: str):
        calls.append(d)
        await asyncio.sleep(0.05)
        yield buf.getvalue()

    async def main() -> list[Path]:
        cache = WorkdirCache(tmp_path / "node")
        paths = await asyncio.gather(*(cache.path(digest, fetch) for _ in range(3)))
        return [*paths, await cache.path(digest, fetch)]

    paths = asyncio.run(main())
    assert len(calls) == 1 and len(set(paths)) == 1 and (paths[0] / "t.py").read_text() == "print(1)\n"
    wrong = "sha256:" + hashlib.sha256(b"other").hexdigest()
    with pytest.raises(FetchFailed, match="arrived with"):
        asyncio.run(WorkdirCache(tmp_path / "other").path(wrong, fetch))
    assert list((tmp_path / "other" / "workdirs").iterdir()) == []


def test_a_link_planted_at_a_workdirs_done_marker_is_never_written_through(tmp_path: Path) -> None:
    """Issue 43 item 1: a python job's code, whose cwd is the node's workdir cache, plants a link at the next
    digest's ``.done``: the daemon refuses it, naming the path and the rule, and creates nothing where it points."""
    import asyncio

    from rankctl.contract.files import safepath
    from rankctl.worker.files.blobs import WorkdirCache

    buf = io.BytesIO()
    digest, _ = pack(tree(tmp_path / "src", {"t.py": "print(1)\n"}), buf, 1 << 20)

    async def fetch(d: str):
        yield buf.getvalue()

    cache, target = WorkdirCache(tmp_path / "node"), tmp_path / "outside" / "created"
    (tmp_path / "outside").mkdir()
    cache.root.mkdir(parents=True)
    link = cache.root / f"{digest.split(':')[1]}.done"
    link.symlink_to(target)
    with pytest.raises(safepath.UnsafePath, match="is a symbolic link.*through no symbolic link"):
        asyncio.run(cache.path(digest, fetch))
    assert not target.exists() and link.is_symlink()


def bomb(path: Path, unpacked: int, *, name: str = "zeros.bin") -> Path:
    """A tar.gz of one file of ``unpacked`` zero bytes, written streaming (never ``unpacked`` bytes in memory)."""

    class Zeros(io.RawIOBase):
        def __init__(self) -> None:
            self.left = unpacked

        def readable(self) -> bool:
            return True

        def readinto(self, buf) -> int:  # noqa: ANN001
            n = min(len(buf), self.left)
            buf[:n] = bytes(n)
            self.left -= n
            return n

    with tarfile.open(str(path), "w|gz") as tar:  # stream mode deflates at level 9
        info = tarfile.TarInfo(name)
        info.size = unpacked
        tar.addfile(info, io.BufferedReader(Zeros(), 1 << 20))
    return path


def _written(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_a_compression_bomb_stops_at_the_ratio_with_less_than_it_written(tmp_path: Path) -> None:
    from rankctl.worker.files.blobs import MAX_RATIO, RATIO_FLOOR

    archive = bomb(tmp_path / "b.tar.gz", 256 << 20)  # ~250 KiB packed: over 1000x
    packed = archive.stat().st_size
    with pytest.raises(FetchFailed, match=f"more than {MAX_RATIO}x its packed size"):
        extract(archive, tmp_path / "out")
    assert 0 < _written(tmp_path / "out") <= max(MAX_RATIO * packed, RATIO_FLOOR) + (1 << 20)


def test_extraction_stops_at_the_unpacked_limit_before_writing_past_it(tmp_path: Path) -> None:
    archive = bomb(tmp_path / "b.tar.gz", 8 << 20)  # under the ratio floor: only the limit stops it
    what = "python.workdir_max_unpacked_mb=2"
    with pytest.raises(FetchFailed, match=f"unpacks past {what}"):
        extract(archive, tmp_path / "out", max_bytes=2 << 20, what=what)
    assert _written(tmp_path / "out") <= 2 << 20
    extract(archive, tmp_path / "whole", max_bytes=9 << 20)  # the same archive, under a larger limit
    assert _written(tmp_path / "whole") == 8 << 20


def test_the_unpacked_limit_defaults_to_four_times_the_packed_cap_and_is_checked_at_submit() -> None:
    from rankctl.kinds.registry import blob_limit_of
    from rankctl.kinds.spec import SpecError

    spec = build_spec({"name": "j", "kind": "python", "python": {"entrypoint": "t.py", "workdir_max_mb": 3}})
    assert blob_limit_of(spec) == 12 << 20
    spec = build_spec({"name": "j", "kind": "python", "python": {"entrypoint": "t.py", "workdir_max_unpacked_mb": 5}})
    assert blob_limit_of(spec) == 5 << 20
    with pytest.raises(SpecError, match="workdir_max_unpacked_mb"):
        build_spec({"name": "j", "kind": "python", "python": {"entrypoint": "t.py", "workdir_max_unpacked_mb": 0}})


def test_the_node_cache_evicts_the_least_recently_used_tree_but_never_a_pinned_one(tmp_path: Path) -> None:
    import asyncio
    import hashlib

    from rankctl.worker.files.blobs import WorkdirCache

    archives = {}
    for i in range(3):
        data = bomb(tmp_path / f"{i}.tar.gz", 1 << 20, name=f"f{i}").read_bytes()
        archives["sha256:" + hashlib.sha256(data).hexdigest()] = data
    a, b, c = archives

    async def fetch(digest: str):
        yield archives.get(digest, b"not an archive")

    async def main() -> WorkdirCache:
        cache = WorkdirCache(tmp_path / "node", max_bytes=(2 << 20) + 1000)
        await cache.path(a, fetch)
        await cache.path(b, fetch)
        cache.pin(a)  # a runs: b is the one evicted, though a is older
        await cache.path(c, fetch)
        with pytest.raises(FetchFailed):
            await cache.path("sha256:" + "0" * 64, fetch, pin=True)  # not fetched: not left pinned
        await cache.path(c, fetch, pin=True)
        return cache

    cache = asyncio.run(main())
    done = sorted(p.name[:-5] for p in cache.root.glob("*.done"))
    assert done == sorted(d.removeprefix("sha256:") for d in (a, c))
    assert not (cache.root / b.removeprefix("sha256:")).exists()
    assert cache.pinned() == {a.removeprefix("sha256:"): 1, c.removeprefix("sha256:"): 1}
    cache.unpin(a)
    assert cache.evict(set()) == [] and cache.evict({c.removeprefix("sha256:")}) == []  # 2 MiB: fits


def spec_of(workdir: Path, entry: str = "t.py", **python) -> object:
    return build_spec({"name": "w", "kind": "python", "python": {"entrypoint": entry, "workdir": str(workdir), **python}})


@pytest.mark.parametrize("entry", ["nothere.py", "../outside.py", "sub"])
def test_a_script_that_is_not_a_file_in_the_shipped_workdir_is_refused(tmp_path: Path, entry: str) -> None:
    tree(tmp_path, {"w/t.py": "", "w/sub/x.py": "", "outside.py": ""})
    with pytest.raises(CtlError, match=rf"python.entrypoint '{re.escape(entry)}' is not a file inside python.workdir "
                                       rf"{tmp_path / 'w'}: ctl ships only the workdir"):
        pack_workdir(spec_of(tmp_path / "w", entry))
    assert pack_workdir(spec_of(tmp_path / "w", "sub/x.py")) is not None   # in a subdirectory: fine
    assert pack_workdir(spec_of(tmp_path / "w", "pkg.mod:main")) is not None   # a function names no file


def test_a_loop_of_links_and_any_depth_are_told_apart_from_a_bug(tmp_path: Path) -> None:
    tree(tmp_path, {"w/t.py": ""})
    (tmp_path / "w" / "a").symlink_to("b")
    (tmp_path / "w" / "b").symlink_to("a")
    with pytest.raises(CtlError, match=r"python.workdir .*: symlink a -> b is a loop of links"):
        pack_workdir(spec_of(tmp_path / "w"))
    deep = tmp_path / "deep"
    tree(deep, {"t.py": ""})
    level = deep
    for _ in range(1200):   # deeper than Python's recursion limit (os.makedirs recurses too)
        level = level / "d"
        level.mkdir()
    try:
        packed = pack_workdir(spec_of(deep))
        assert packed is not None and packed.size > 0
        packed.file.close()
    finally:
        while level != deep:   # pytest's clean-up recurses: leave it a shallow tree
            level.rmdir()
            level = level.parent
