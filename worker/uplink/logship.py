"""Rank logs stay on this node: answer the coordinator's FetchLogs, and keep each log bounded.

A rank's stdout and stderr go to ``{run_dir}/rank-{rank}.log`` (``contract.files.rankfiles``). The
coordinator reads them on demand (``answer_fetch``, blocking file IO: call it off the event
loop). The launcher keeps each log bounded as its bytes arrive (``worker.runs.rankio``: rotation
into ``.log.1`` by rename).
Lines are cut at ``MAX_LINE_BYTES``, marked. An answer holds what the program printed; rankctl's
own records (marked lines, ``contract.files.logrecords``) only when the fetch asks for ``records``. Files are opened without following symlinks and
must be regular files: the rank, which owns its run dir, cannot point the daemon elsewhere.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

from rankctl.contract.files.logrecords import RECORD_MARK_BYTE
from rankctl.contract.files.rankfiles import log_path
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.files.paths import Refused, run_dir_for

MAX_LINE_BYTES = 4096
MAX_LINES = 5000            # lines per answer (also the largest tail)
MAX_CHUNK_BYTES = 1 << 20   # bytes of the file read per offset answer: its text stays under ~1 MiB
MAX_TAIL_BYTES = 4 << 20    # bytes read back from the end for a tail


def answer_fetch(state_dir: Path, req: pb.FetchLogs) -> pb.LogChunk:
    """The LogChunk answering ``req``: never raises for a bad request or an unreadable file.

    ``tail > 0``: the last ``tail`` lines (a partial last line included), ``next_offset`` = the
    file's size. Else complete lines from byte ``offset`` (a partial last line waits; an offset
    inside a line skips to the next one), at most ``max_lines``, ``next_offset`` after the last
    line read. An offset past the end means the log was rotated: reading restarts at 0, marked.
    A missing file (the rank has not written yet) is no lines at ``next_offset`` 0. Only
    ``req.records`` keeps rankctl's record lines; skipped lines count toward no limit but the bytes read.
    """
    out = pb.LogChunk(request_id=req.request_id)
    problem = _request_problem(req)
    if problem:
        out.error = problem
        return out
    try:
        path = log_path(str(run_dir_for(state_dir, req.job_id, req.attempt)), req.rank)
        lines, out.next_offset = _read(path, req)
    except Refused as exc:
        out.error = str(exc)
    except FileNotFoundError:
        pass
    except OSError as exc:
        out.error = f"cannot read the log of rank {req.rank}: {exc.strerror or exc}"
    else:
        out.lines.extend(lines)
    return out


def _request_problem(req: pb.FetchLogs) -> str | None:
    for what, value in (("rank", req.rank), ("offset", req.offset), ("tail", req.tail)):
        if value < 0:
            return f"{what} {value} must not be negative"
    return None


def _read(path: str, req: pb.FetchLogs) -> tuple[list[str], int]:
    max_lines = min(req.max_lines, MAX_LINES) if req.max_lines > 0 else MAX_LINES
    with _open_log(path, os.O_RDONLY) as f:
        size = os.fstat(f.fileno()).st_size
        if req.tail > 0:
            return read_tail(f, size, min(req.tail, max_lines), req.records), size
        if req.offset > size:  # rotated (truncated) since the reader's last answer
            lines, end = read_from(f, 0, max_lines - 1, req.records)
            return [f"[rankctl: the log was rotated; older lines are in {os.path.basename(path)}.1]"] + lines, end
        return read_from(f, req.offset, max_lines, req.records)


def _open_log(path: str, flags: int):  # noqa: ANN202 - a binary file object
    """``path`` opened (not through a symlink, never blocking on a FIFO); a regular file or OSError."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{os.path.basename(path)} is not a regular file")
    return os.fdopen(fd, "r+b" if flags & os.O_RDWR else "rb")


def cut(raw: bytes) -> str:
    """One line as text, cut at ``MAX_LINE_BYTES`` and marked when longer."""
    if len(raw) <= MAX_LINE_BYTES:
        return raw.decode("utf-8", "replace")
    return raw[:MAX_LINE_BYTES].decode("utf-8", "replace") + f" [rankctl: line cut at {MAX_LINE_BYTES} bytes]"


def _program_output(raw: bytes) -> bool:
    return not raw.startswith(RECORD_MARK_BYTE)


def _everything(raw: bytes) -> bool:
    return True


Keep = Callable[[bytes], bool]


def read_tail(f, size: int, n: int, records: bool = True) -> list[str]:  # noqa: ANN001 - a binary file
    """The last ``n`` lines of the first ``size`` bytes of ``f``, reading back at most ``MAX_TAIL_BYTES``,
    and as many of them as fit in ``MAX_CHUNK_BYTES`` of text. Without ``records``, rankctl's record
    lines (``contract.files.logrecords``) are skipped and not counted."""
    start = max(0, size - MAX_TAIL_BYTES)
    pos, data, starts = size, b"", 0  # starts: the lines kept that begin after a newline in data
    while pos > start and starts <= n:
        step = min(64 << 10, pos - start)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
        newlines = data[:step].count(b"\n")
        starts += newlines if records else newlines - data[:step + 1].count(b"\n" + RECORD_MARK_BYTE)
    pieces = data.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()   # the file ends with a newline
    if pos > 0 and len(pieces) > 1:
        pieces.pop(0)  # the end of a line that began before what was read
    if not records:
        pieces = [raw for raw in pieces if _program_output(raw)]
    lines, used = [], 0
    for raw in reversed(pieces[-n:]):
        text = cut(raw)
        used += len(text)
        if used > MAX_CHUNK_BYTES and lines:
            break
        lines.append(text)
    return lines[::-1]


def _lines(data: bytes, pos: int, max_lines: int, keep: Keep = _everything) -> tuple[list[str], int]:
    """Complete lines of ``data`` from index ``pos`` that ``keep`` keeps, and the index after the last
    line read; a remainder longer than ``MAX_LINE_BYTES`` is too long to wait for its newline: it is cut now."""
    lines: list[str] = []
    while len(lines) < max_lines:
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        if keep(data[pos:nl]):
            lines.append(cut(data[pos:nl]))
        pos = nl + 1
    if len(lines) < max_lines and len(data) - pos > MAX_LINE_BYTES:
        if keep(data[pos:]):
            lines.append(cut(data[pos:]))
        pos = len(data)
    return lines, pos


def read_from(f, offset: int, max_lines: int, records: bool = True) -> tuple[list[str], int]:  # noqa: ANN001
    """Complete lines from ``offset`` within one ``MAX_CHUNK_BYTES`` window, and the offset after them
    (``f``: a binary file; without ``records``, rankctl's record lines are skipped).

    Starting inside a line (the byte before ``offset`` is no newline, e.g. after a line cut before
    its end arrived) skips to the next line.
    """
    inside = False
    if offset > 0:
        f.seek(offset - 1)
        inside = f.read(1) != b"\n"
    f.seek(offset)
    data = f.read(MAX_CHUNK_BYTES)
    pos = 0
    if inside:
        nl = data.find(b"\n")
        if nl < 0:
            return [], offset + len(data)
        pos = nl + 1
    lines, pos = _lines(data, pos, max_lines, _everything if records else _program_output)
    return lines, offset + pos
