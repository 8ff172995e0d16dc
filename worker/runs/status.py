"""The daemon side of the rank files (``contract.files.rankfiles``): tail status records and logs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rankctl.contract.files.logrecords import is_record
from rankctl.contract.files.rankfiles import STATUS_RE, status_path
from rankctl.contract.files.rankstatus import RankStatusRecord


@dataclass
class FileTailer:
    """Reads the complete lines appended to one file since the last call.

    ``max_line`` (bytes) cuts a longer line, marked, and skips its rest, even before its
    newline arrives; ``max_read`` bounds the bytes read per call (the rest waits).
    """

    path: str
    offset: int = 0
    max_line: int | None = None
    max_read: int = -1
    _pending: bytes = field(default=b"", repr=False)
    _cutting: bool = field(default=False, repr=False)  # inside a line already shipped cut

    def read_lines(self) -> list[str]:
        """New complete lines (without newline); a trailing partial line waits for the next call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(self.max_read)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        chunks = (self._pending + data).split(b"\n")
        self._pending = chunks.pop()
        if self._cutting and chunks:
            chunks.pop(0)  # the end of the cut line
            self._cutting = False
        lines = [self._text(c) for c in chunks]
        if self.max_line is not None and len(self._pending) > self.max_line:
            if not self._cutting:
                lines.append(self._text(self._pending))
            self._pending, self._cutting = b"", True
        return [line for line in lines if line.strip()]

    def at_end(self) -> bool:
        """Whether every byte written so far has been read."""
        try:
            return self.offset >= os.path.getsize(self.path)
        except OSError:
            return True

    def _text(self, raw: bytes) -> str:
        if self.max_line is None or len(raw) <= self.max_line:
            return raw.decode("utf-8", "replace")
        return raw[: self.max_line].decode("utf-8", "replace") + f" [rankctl: line cut at {self.max_line} bytes]"


class StatusTailer:
    """Polls every ``rank-*.status.jsonl`` under one run directory for new records.

    ``poll()`` returns new records in file order per rank; a line that is not a record
    becomes one with phase ``None`` and the raw text under ``error``.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._tailers: dict[int, FileTailer] = {}

    def _discover(self) -> None:
        try:
            names = os.listdir(self.run_dir)
        except FileNotFoundError:
            return
        for name in names:
            m = STATUS_RE.match(name)
            if m and int(m.group(1)) not in self._tailers:
                self._tailers[int(m.group(1))] = FileTailer(os.path.join(self.run_dir, name))

    def poll(self) -> list[RankStatusRecord]:
        self._discover()
        return [RankStatusRecord.from_line(line, rank)
                for rank in sorted(self._tailers) for line in self._tailers[rank].read_lines()]


def read_status(run_dir: str, rank: int) -> list[RankStatusRecord]:
    """Every record one rank has written so far."""
    return [RankStatusRecord.from_line(line, rank) for line in FileTailer(status_path(run_dir, rank)).read_lines()]


def tail_lines(path: str, n: int = 20, *, max_line: int = 500, block: int = 8192) -> list[str]:
    """The last ``n`` lines the program printed to a file (each cut to ``max_line`` characters; rankctl's own
    records, ``contract.files.logrecords``, left out); [] if missing."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos, data = f.tell(), b""
            while pos > 0 and data.count(b"\n") <= n:
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except FileNotFoundError:
        return []
    text = data.decode("utf-8", "replace")
    lines = [line.rstrip("\r") for line in text.split("\n") if line and not is_record(line)][-n:] if n > 0 else []
    return [line[:max_line] for line in lines]
