"""``contract.files.safepath``: paths under a root with no symbolic-link component, on real files under tmp_path."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from rankctl.contract.files import safepath
from rankctl.contract.files.safepath import UnsafePath


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """root/ (the base), outside/ with a file, and links from inside root to outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "ok").mkdir(parents=True)
    outside.mkdir()
    (outside / "victim").write_text("keep me")
    (root / "middle").symlink_to(outside)                 # a link in the middle of a path
    (root / "ok" / "leaf").symlink_to(outside / "victim")  # a link at the leaf
    return {"root": root, "outside": outside}


def test_paths_under_the_root_are_created_written_and_removed(tree) -> None:
    root = str(tree["root"])
    path = os.path.join(root, "a", "b", "c.txt")
    fd = safepath.open_write(root, path, create_dirs=True)
    os.write(fd, b"x")
    os.close(fd)
    safepath.replace(root, path, os.path.join(root, "a", "b", "d.txt"))
    assert safepath.listdir(root, os.path.join(root, "a", "b")) == ["d.txt"]
    assert safepath.unlink(root, os.path.join(root, "a", "b", "d.txt"))
    assert not safepath.unlink(root, os.path.join(root, "a", "b", "d.txt"))
    assert safepath.rmdir(root, os.path.join(root, "a", "b"))
    assert safepath.problem(root, os.path.join(root, "a", "new", "deeper")) is None


def test_a_link_in_the_middle_is_refused_and_nothing_outside_is_touched(tree) -> None:
    root, outside = str(tree["root"]), tree["outside"]
    through = os.path.join(root, "middle", "new", "f")
    for act in (lambda: safepath.makedirs(root, os.path.dirname(through)),
                lambda: safepath.open_write(root, through, create_dirs=True),
                lambda: safepath.unlink(root, os.path.join(root, "middle", "victim")),
                lambda: safepath.listdir(root, os.path.join(root, "middle"))):
        with pytest.raises(UnsafePath, match="passes through the symbolic link '[^']*/root/middle'.*no symbolic link"):
            act()
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_text() == "keep me"
    assert "passes through the symbolic link" in safepath.problem(root, through)


def test_a_link_at_the_leaf_is_refused_for_writing_and_removed_itself(tree) -> None:
    root, outside = str(tree["root"]), tree["outside"]
    leaf = os.path.join(root, "ok", "leaf")
    with pytest.raises(UnsafePath, match="is a symbolic link"):
        safepath.open_write(root, leaf)
    with pytest.raises(UnsafePath, match="is a symbolic link"):
        safepath.open_write(root, leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with pytest.raises(UnsafePath, match="passes through the symbolic link '[^']*/ok/leaf'"):
        safepath.makedirs(root, leaf)
    assert "symbolic link" in safepath.problem(root, leaf)
    fd = safepath.open_write(root, os.path.join(root, "ok", "tmp"))
    os.close(fd)
    safepath.replace(root, os.path.join(root, "ok", "tmp"), leaf)   # replaces the link, not its target
    assert not os.path.islink(leaf) and (outside / "victim").read_text() == "keep me"


@pytest.mark.parametrize("rel", ["../outside/x", "ok/../../outside/x", "ok/./x", "ok//x", "ok/\x00"])
def test_dot_dot_dot_and_empty_components_are_refused(tree, rel: str) -> None:
    root = str(tree["root"])
    with pytest.raises(UnsafePath, match="component"):
        safepath.makedirs(root, f"{root}/{rel}")
    assert "component" in safepath.problem(root, f"{root}/{rel}")
    assert not (tree["outside"] / "x").exists()


@pytest.mark.parametrize("path", ["/etc/x", "/tmp", "relative/x"])
def test_absolute_escapes_and_prefix_tricks_are_refused(tree, path: str) -> None:
    root = str(tree["root"])
    for p in (path, root + "2/x"):   # root2 shares root's prefix but is not under it
        with pytest.raises(UnsafePath, match="is not under"):
            safepath.open_write(root, p, create_dirs=True)
        assert "is not under" in safepath.problem(root, p)
    with pytest.raises(UnsafePath, match="not strictly under"):
        safepath.unlink(root, root)


def test_the_base_is_found_by_its_written_form() -> None:
    roots = ["/data", "/data/deep", "/state"]
    assert safepath.base_of("/data/deep/x", roots) == "/data/deep"
    assert safepath.base_of("/data/x", roots) == "/data"
    assert safepath.base_of("/data2/x", roots) is None and safepath.base_of("/", roots) is None


def test_a_link_swapped_in_during_writes_never_lets_one_through(tree) -> None:
    """Another process turns a directory into a link to outside and back while files are written below it:
    each write either lands inside the root or is refused; nothing ever appears outside."""
    root, outside = str(tree["root"]), tree["outside"]
    flip, stop = Path(root) / "flip", threading.Event()

    def swap() -> None:
        while not stop.is_set():
            try:
                flip.mkdir()
                flip.rmdir()
                flip.symlink_to(outside)
                flip.unlink()
            except OSError:
                pass

    thread = threading.Thread(target=swap)
    thread.start()
    written = refused = 0
    try:
        for i in range(3000):
            try:
                os.close(safepath.open_write(root, os.path.join(root, "flip", f"f{i}"), create_dirs=True))
                written += 1
            except UnsafePath:
                refused += 1
            except OSError:
                pass   # the directory went between steps: fine, nothing was written outside
    finally:
        stop.set()
        thread.join()
    assert sorted(os.listdir(outside)) == ["victim"]
    assert written + refused > 0
