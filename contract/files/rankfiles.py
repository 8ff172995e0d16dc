"""The files a rank process and its node's daemon share, under the run directory the daemon made.

``rank-R.status.jsonl``: the rank appends one flushed line per status record (``contract.files.rankstatus``
holds the record and its line); the daemon tails it, keeping a partial last line pending until its newline.
``rank-R.log``: the rank's stdout and stderr, with rankctl's own records among them, each marked
(``contract.files.logrecords``). ``saved.fifo`` (one per run directory, made by the daemon): a rank writes a byte
into it when one of its checkpoint or snapshot steps is complete, marker included; the daemon pushes the
step to the job's replica peer at once instead of at its next poll turn. ``rank-R.control.json``: the
daemon's requests to the rank, replaced whole by a rename; the rank polls its mtime once per step::

    {"checkpoint_at": 17}      # save a checkpoint at the end of step 17 (ctl drain)

Every rank saves such a checkpoint at the same step (the ranks agree on it: S, or a later step when no rank had
the request by S) and from then on reports that step in each step record's metrics as ``SAVED_ON_REQUEST``: the
coordinator moves a drained job once the step every rank saved is complete, never on "passed S" alone.

The daemon makes the run directory through no symbolic link below its state dir (``worker.runs.assign``); every file
in it is opened with ``open_own``, so that whatever a rank (the user's code) planted at a file's name, a link,
a FIFO or a hard link to a file elsewhere, is replaced, never written through.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from typing import Any, Callable

SAVED_ON_REQUEST = "saved_on_request"   # a step record's metric: the step of the last checkpoint saved on request
STATUS_RE = re.compile(r"^rank-(\d+)\.status\.jsonl$")


def status_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.status.jsonl")


def log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.log")


def control_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank-{rank}.control.json")


def open_own(path: str, flags: int = os.O_WRONLY, mode: int = 0o644, *, keep: bool = False) -> int:
    """A descriptor of run-dir file ``path``, a regular file of its own, opened with ``flags`` (``O_CREAT``
    added): a symbolic link, a FIFO, a hard link or (unless ``keep``, for appending: no ``O_TRUNC`` then) any
    file already there is removed first, never followed or written through."""
    flags |= os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK   # (never blocks on a FIFO)
    if keep:
        try:
            fd = os.open(path, flags, mode)
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                return fd
            os.close(fd)
        except OSError:
            pass
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)   # a link goes itself, never its target
    return os.open(path, flags | os.O_EXCL, mode)


def replace_json(path: str, data: Any) -> None:
    """Replace ``path`` with ``data`` as JSON, written to a fresh temporary file (``open_own``) and renamed over
    it (a reader never sees half of it; a link at ``path`` is replaced itself)."""
    tmp = f"{path}.tmp"
    with open(open_own(tmp), "w", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)


def write_control(run_dir: str, rank: int, request: dict[str, Any]) -> None:
    """Replace the rank's control file with ``request`` (a rename: the rank never reads half of it)."""
    replace_json(control_path(run_dir, rank), request)


def read_control(path: str) -> dict[str, Any]:
    """The rank's current control request; {} when there is none or it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def saved_path(run_dir: str) -> str:
    return os.path.join(run_dir, "saved.fifo")


def notify_saved(run_dir: str) -> None:
    """Tell the node's daemon that a save of this rank is complete. Never blocks and never fails: without the
    FIFO (an older daemon, or no run directory: a rank started by hand), a reader or room in the pipe, the
    daemon's poll turn finds the step anyway."""
    if not run_dir:
        return
    try:
        fd = os.open(saved_path(run_dir), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):   # never a file planted there (a hard link to one elsewhere)
            os.write(fd, b"\1")
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointRequests:
    """The daemon's ``{"checkpoint_at": S}`` in the rank's control file: one ``os.stat`` a step; the
    file is read only when it was replaced (the daemon renames a new one into place).

    The ranks agree on the step they save at (``agreed``: one world all-reduce of an int a step), so a rank
    whose daemon delivered the request late saves at the same step as every other rank, never alone at a later
    one that no other rank holds. A request at or below the one already served is stale (a late copy, a resend)."""

    def __init__(self, run_dir: str, rank: int) -> None:
        self.path = control_path(run_dir, rank)
        self._seen: tuple[int, int, int] | None = None
        self.pending: int | None = None
        self.served = -1    # the request last saved for

    def poll(self) -> int | None:
        """The step a checkpoint is asked for and not yet saved, if any."""
        try:
            st = os.stat(self.path)
        except OSError:
            return self.pending
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._seen:
            self._seen = key
            at = read_control(self.path).get("checkpoint_at")
            if isinstance(at, int) and not isinstance(at, bool) and at > self.served:
                self.pending = at
        return self.pending

    def due(self, step: int) -> int | None:
        """The requested step when a checkpoint is to be saved at the end of ``step`` (this rank's view)."""
        at = self.poll()
        return at if at is not None and step >= at else None

    def agreed(self, step: int, world: Callable[[int], int] | None) -> int | None:
        """The requested step when every rank saves at the end of ``step``: the largest request any rank holds
        (``world``: the max over the ranks, a collective every rank calls each step; None with one rank)."""
        at = self.poll()
        if world is not None:
            top = world(-1 if at is None else at)
            at = None if top <= self.served else top
            self.pending = at
        return at if at is not None and step >= at else None

    def saved(self, at: int) -> None:
        self.served, self.pending = max(self.served, at), None
