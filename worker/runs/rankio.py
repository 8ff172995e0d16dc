"""A rank's stdout and stderr, bounded as the bytes arrive (issue 24 item 3).

The rank writes into a pipe; the launcher's loop copies it into ``rank-R.log``
(``contract.files.rankfiles``), and once a generation reaches ``generation_bytes`` (cut at a line end
when one is near) renames it to ``rank-R.log.1``, dropping the older one. A rank's log on disk
is so at most two generations, and ``generation_bytes(n)`` keeps the ``n`` ranks of one job on a
node within ``JOB_LOG_BYTES``. A burst blocks the writer on the full pipe; it never lands whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from rankctl.contract.files.rankfiles import open_own

GENERATION_BYTES = 64 << 20   # one generation of one rank's log (the rotation size)
JOB_LOG_BYTES = 1 << 30       # every log of one job attempt on one node, all generations
MIN_GENERATION_BYTES = 1 << 20
READ_BYTES = 1 << 20
F_SETPIPE_SZ = 1031


def generation_bytes(local_ranks: int, cap: int = GENERATION_BYTES, job_cap: int = JOB_LOG_BYTES) -> int:
    """The rotation size that keeps ``local_ranks`` logs of two generations each within ``job_cap``."""
    return max(MIN_GENERATION_BYTES, min(cap, job_cap // (2 * max(1, local_ranks))))


def output_pipe(path: str | None = None) -> tuple[int, int]:
    """(read end, write end) for a rank's stdout/stderr; the read end non-blocking, both close-on-exec.

    With ``path`` (``{log}.out``) the pipe is a FIFO opened there and unlinked at once: it works as an
    anonymous pipe, but ``/proc/PID/fd/1`` of a rank still names its job's run dir."""
    if path is None:
        r, w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(r, False)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.mkfifo(path, 0o600)
        try:
            r = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                w = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                os.close(r)
                raise
            os.set_blocking(w, True)
        finally:
            os.unlink(path)
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, F_SETPIPE_SZ, READ_BYTES)
    return r, w


class RankLog:
    """The log file of one rank, fed from its pipe's read end ``fd``."""

    def __init__(self, path: str, fd: int, generation: int = GENERATION_BYTES) -> None:
        self.path = path
        self.fd = fd
        self.generation = generation
        self._out = self._open()
        self.size = os.fstat(self._out).st_size

    def _open(self) -> int:
        """The log, a regular file of its own: whatever else the rank put at its path (a symlink, a FIFO, a hard
        link) is replaced (``contract.files.rankfiles.open_own``)."""
        return open_own(self.path, os.O_WRONLY | os.O_APPEND, keep=True)

    def pump(self) -> bool:
        """Copy what the pipe holds now; False once every writer has closed it (EOF)."""
        while True:
            try:
                data = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                return True
            if not data:
                return False
            self.write(data)

    def write(self, data: bytes) -> None:
        while data:
            room = self.generation - self.size
            if room <= 0:
                self._rotate()
                continue
            cut = len(data) if len(data) <= room else (data.rfind(b"\n", 0, room) + 1 or room)
            self._write_all(data[:cut])
            data = data[cut:]
            if data:
                self._rotate()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._out, view)
            except OSError:  # a full disk: the bytes are dropped, the rank is never blocked by it
                return
            view = view[n:]
            self.size += n

    def _rotate(self) -> None:
        os.close(self._out)
        with contextlib.suppress(OSError):
            os.replace(self.path, f"{self.path}.1")
        self._out = self._open()
        self.size = os.fstat(self._out).st_size

    def close(self) -> None:
        """Copy what is left (non-blocking) and close both ends of ours."""
        with contextlib.suppress(OSError):
            self.pump()
        for fd in (self.fd, self._out):
            with contextlib.suppress(OSError):
                os.close(fd)
