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

    def __init__(self, file: TextIO | None = None, name: str | None = None) -> None:
        super().__init__(file)
        self.name = name  # structlog.get_logger(NAME): the "logger" key

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except (OSError, ValueError):
            SafePrintLogger.dropped += 1

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


class SafeStreamHandler(logging.StreamHandler):
    """The root handler for the stdlib ``logging`` records (grpc, asyncio, aiohttp): like
    SafePrintLogger, a record that cannot be written is dropped and counted, never raised or printed."""

    dropped = 0

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        SafeStreamHandler.dropped += 1


LOG_FORMATS = ("auto", "console", "json")


def _add_logger_name(logger: object, method: str, event_dict: dict) -> dict:
    """``logger``: the stdlib record's name, or the name given to ``structlog.get_logger``."""
    record = event_dict.get("_record")
    name = record.name if record is not None else getattr(logger, "name", None)
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


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


class _MarkedJSON(structlog.processors.JSONRenderer):
    """One JSON object a line, after ``mark`` (a rank's records: ``contract.logrecords``)."""

    def __init__(self, mark: str) -> None:
        super().__init__()
        self.mark = mark

    def __call__(self, logger: object, name: str, event_dict: dict) -> str:
        return self.mark + super().__call__(logger, name, event_dict)


def _pre_chain() -> list:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _add_logger_name,
        structlog.processors.TimeStamper(fmt="iso"),
    ]


def record_logger(stream: TextIO, name: str, mark: str, *, level: int = logging.INFO):  # noqa: ANN201 - a BoundLogger
    """A structlog logger of its own, apart from structlog's global configuration (a rank leaves that to its
    user's code): each event one JSON line after ``mark`` on ``stream``, with the contextvars bound."""
    processors = [*_pre_chain(), structlog.processors.format_exc_info, _MarkedJSON(mark)]
    return structlog.wrap_logger(SafePrintLogger(stream, name), processors=processors,
                                 wrapper_class=structlog.make_filtering_bound_logger(level))


def _unroute_stdlib() -> logging.Logger:
    """Take our handler off the root logger (a forked rank inherits the launcher's)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, SafeStreamHandler)]:
        root.removeHandler(old)
    logging.captureWarnings(False)
    return root


def _route_stdlib(stream: TextIO, level: int, pre_chain: list, renderer: structlog.types.Processor) -> None:
    """Replace our root handler (never stack them): stdlib records get ``pre_chain`` and ``renderer``."""
    root = _unroute_stdlib()
    handler = SafeStreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
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
    pre_chain = _pre_chain()
    structlog.configure(
        processors=[*pre_chain, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *args: SafePrintLogger(stream, args[0] if args else None),
        cache_logger_on_first_use=False,
    )
    if stdlib:
        _route_stdlib(stream, level, pre_chain, renderer)
    else:
        _unroute_stdlib()
