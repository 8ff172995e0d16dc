"""Paths under a root with no symbolic-link component: how the daemon and the ranks create, write and delete
the files a job's values name (checkpoint dirs, job names, snapshot, run and log paths).

``base`` is trusted as given (a worker's ``--data-root``, its state dir or its snapshot memory: the operator's
choice). Below it, every operation walks one component at a time through ``O_NOFOLLOW`` directory descriptors
and acts on the last component through its parent's descriptor (``dir_fd``), so a link planted anywhere below
``base`` is refused, not followed, even when it appears during the walk (no check-then-use race). ``..``,
``.``, empty components and a path not under ``base`` as written are refused too. Refusals raise
``UnsafePath`` (a ``PermissionError``) naming the path and the rule; ``problem`` says the same without
creating anything (for checks before a job starts). Reading is not confined here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Iterator, Sequence

RULE = ("rankctl creates, writes and deletes files only under a worker's --data-root or state dir, "
        "through no symbolic link")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(PermissionError):
    """A path the node will not create, write or delete under: one line naming it and the rule."""


def _refusal(path: str, why: str) -> UnsafePath:
    return UnsafePath(errno.EPERM, f"{path!r} {why}: {RULE}")


def parts_under(base: str, path: str) -> list[str]:
    """``path``'s components below ``base`` (``[]`` for ``base`` itself); ``UnsafePath`` when it is not
    under ``base`` as written or has a ``..``, ``.`` or empty component."""
    top = base.rstrip(os.sep) or os.sep
    if path != top and not path.startswith(top.rstrip(os.sep) + os.sep):
        raise _refusal(path, f"is not under {top}")
    rest = path[len(top):].lstrip(os.sep) if path != top else ""
    parts = rest.split(os.sep) if rest else []
    if any(p in ("", ".", "..") for p in parts) or "\x00" in path:
        raise _refusal(path, "has an empty, '.' or '..' component or a NUL character")
    return parts


def base_of(path: str, roots: Sequence[str]) -> str | None:
    """The deepest of ``roots`` that ``path`` lies under as written (no links resolved), or None."""
    under = [r for r in roots if r and _written_under(path, r)]
    return max(under, key=len) if under else None


def _written_under(path: str, root: str) -> bool:
    top = root.rstrip(os.sep) or os.sep
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _step(fd: int, name: str, at: str, path: str, create: bool, mode: int) -> int:
    """The descriptor of directory ``name`` (``at``) in ``fd``, never through a link (made when ``create``)."""
    for _ in range(2):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):  # another writer made it: open it then
                os.mkdir(name, mode, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, name):
                raise _refusal(path, f"passes through the symbolic link {at!r}") from None
            raise
    return os.open(name, _DIR_FLAGS, dir_fd=fd)


def _is_link(fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode)
    except OSError:
        return False


@contextlib.contextmanager
def directory(base: str, path: str, *, create: bool = False, mode: int = 0o777) -> Iterator[int]:
    """A descriptor of directory ``path`` reached from ``base`` through no link (made when ``create``)."""
    fd, at = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), base
    try:
        for name in parts_under(base, path):
            at = os.path.join(at, name)
            fd, old = _step(fd, name, at, path, create, mode), fd
            os.close(old)
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def parent(base: str, path: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """``(descriptor of path's directory, path's last component)``; ``path`` must lie strictly below ``base``."""
    parts_under(base, path)
    head, name = os.path.split(path)
    if not name or path.rstrip(os.sep) == base.rstrip(os.sep):
        raise _refusal(path, f"is not strictly under {base}")
    with directory(base, head, create=create) as fd:
        yield fd, name


def makedirs(base: str, path: str, mode: int = 0o777) -> None:
    """``os.makedirs(path, exist_ok=True)`` through no link below ``base``."""
    with directory(base, path, create=True, mode=mode):
        pass


def open_write(base: str, path: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode: int = 0o666,
               *, create_dirs: bool = False) -> int:
    """A descriptor of file ``path`` opened with ``flags`` (``O_NOFOLLOW`` added: a link there is refused)."""
    with parent(base, path, create=create_dirs) as (fd, name):
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EEXIST) and _is_link(fd, name):
                raise _refusal(path, "is a symbolic link") from None
            raise


def replace(base: str, src: str, dst: str) -> None:
    """``os.replace(src, dst)`` (both below ``base``); a link at ``dst`` is replaced itself, never followed."""
    with parent(base, src) as (sfd, sname), parent(base, dst) as (dfd, dname):
        os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)


def unlink(base: str, path: str, *, missing_ok: bool = True) -> bool:
    """Remove file ``path`` (a link there goes itself, its target stays); False when it was not there."""
    try:
        with parent(base, path) as (fd, name):
            os.unlink(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        if not missing_ok:
            raise
        return False


def rmdir(base: str, path: str) -> bool:
    """Remove empty directory ``path``; False when it is missing, not empty or not a directory."""
    try:
        with parent(base, path) as (fd, name):
            os.rmdir(name, dir_fd=fd)
        return True
    except UnsafePath:
        raise
    except OSError:
        return False


def listdir(base: str, path: str) -> list[str]:
    """The entries of directory ``path`` reached through no link ([] when it is missing)."""
    try:
        with directory(base, path) as fd:
            return os.listdir(fd)
    except FileNotFoundError:
        return []


def problem(base: str, path: str) -> str | None:
    """Why ``path`` could not be created or written through no link below ``base``, or None; creates
    nothing (the components that exist are looked at, a missing tail is fine)."""
    try:
        parts = parts_under(base, path)
    except UnsafePath as exc:
        return exc.strerror
    at = base
    for name in parts:
        at = os.path.join(at, name)
        try:
            st = os.lstat(at)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"{path!r} cannot be looked at ({exc.strerror}): {RULE}"
        if stat.S_ISLNK(st.st_mode):
            return f"{path!r} passes through the symbolic link {at!r}: {RULE}"
        if not stat.S_ISDIR(st.st_mode) and at != path:
            return f"{path!r}: {at!r} is not a directory"
    return None
