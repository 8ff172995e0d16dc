"""Small process helpers for the launcher and its rank processes (Linux)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import TextIO

import structlog

from rankctl.contract.logformat import SafePrintLogger, pre_chain

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


class SafeStreamHandler(logging.StreamHandler):
    """The root handler for the stdlib ``logging`` records (grpc, asyncio, aiohttp): like
    SafePrintLogger, a record that cannot be written is dropped and counted, never raised or printed."""

    dropped = 0

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        SafeStreamHandler.dropped += 1


LOG_FORMATS = ("auto", "console", "json")


def _renderer(stream: TextIO, fmt: str) -> structlog.types.Processor:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    try:
        tty = fmt == "auto" and stream.isatty()
    except (OSError, ValueError):  # a closed stream
        tty = False
    if fmt == "console" or tty:
        return structlog.dev.ConsoleRenderer(colors=False)
    return structlog.processors.JSONRenderer()


def _unroute_stdlib() -> logging.Logger:
    """Take our handler off the root logger (a forked rank inherits the launcher's)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, SafeStreamHandler)]:
        root.removeHandler(old)
    logging.captureWarnings(False)
    return root


def _route_stdlib(stream: TextIO, level: int, chain: list, renderer: structlog.types.Processor) -> None:
    """Replace our root handler (never stack them): stdlib records get ``chain`` and ``renderer``."""
    root = _unroute_stdlib()
    handler = SafeStreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    ))
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # warnings.warn lines are log records too


def configure_logging(stream: TextIO | None = None, *, level: int | str = logging.INFO, fmt: str = "auto",
                      stdlib: bool = True) -> None:
    """Configure structlog once per entry point (again replaces, never stacks): ``fmt`` "console" for
    human lines, "json" for one JSON object a line, "auto" for console on a TTY and JSON otherwise.

    With ``stdlib`` the root ``logging`` handler renders the stdlib loggers' records (grpc, asyncio,
    aiohttp) the same way; a rank passes False so that its user's code owns the root logger again.
    Context (job, node, rank) comes from structlog's contextvars, bound by each entry point.
    """
    stream = stream or sys.stderr
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    renderer = _renderer(stream, fmt)
    chain = pre_chain()
    structlog.configure(
        processors=[*chain, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *args: SafePrintLogger(stream, args[0] if args else None),
        cache_logger_on_first_use=False,
    )
    if stdlib:
        _route_stdlib(stream, level, chain, renderer)
    else:
        _unroute_stdlib()
