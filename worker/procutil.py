"""Small process helpers for the launcher and its rank processes (Linux)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import TextIO

import structlog

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL, *, expected_parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits.

    ``expected_parent`` closes the race where the parent died before the call: if the
    parent is already gone (we were re-parented), exit at once.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(sig))


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (reads /proc, no psutil)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def parse_signal(value: str | int | None, default: int = signal.SIGTERM) -> int:
    """``"SIGKILL"``, ``"KILL"``, ``9`` or None (the default) to a signal number."""
    if value is None:
        return int(default)
    if isinstance(value, int):
        return int(signal.Signals(value))
    name = value.upper()
    return int(signal.Signals[name if name.startswith("SIG") else "SIG" + name])


class SafePrintLogger(structlog.PrintLogger):
    """A print logger that never raises: a log line that cannot be written (a full disk, a closed
    pipe) is dropped, so that logging can never break the operation that logs."""

    dropped = 0

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except (OSError, ValueError):
            SafePrintLogger.dropped += 1

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


def configure_logging(stream: TextIO | None = None, *, level: int | str = logging.INFO) -> None:
    """Configure structlog once per entry point: console on a TTY, JSON lines otherwise.

    Context (job, node, rank) comes from structlog's contextvars, bound by each entry point.
    """
    stream = stream or sys.stderr
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if stream.isatty() else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *_: SafePrintLogger(stream),
        cache_logger_on_first_use=False,
    )
