"""The structlog pieces every rankctl process shares, and the rank's own records.

A print logger that never raises, the processors every entry point runs first (``pre_chain``), and
``record_logger``: a rank's records as marked JSON lines (``contract.files.logrecords``) on a logger of its own,
apart from structlog's global configuration, which a rank leaves to its user's code. ``worker.launcher.procutil``
configures each daemon's logging from these; ``runtime.rank`` writes its records with ``record_logger``.
"""

from __future__ import annotations

import logging
from typing import TextIO

import structlog


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


def add_logger_name(logger: object, method: str, event_dict: dict) -> dict:
    """``logger``: the stdlib record's name, or the name given to ``structlog.get_logger``."""
    record = event_dict.get("_record")
    name = record.name if record is not None else getattr(logger, "name", None)
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


class MarkedJSON(structlog.processors.JSONRenderer):
    """One JSON object a line, after ``mark`` (a rank's records: ``contract.files.logrecords``)."""

    def __init__(self, mark: str) -> None:
        super().__init__()
        self.mark = mark

    def __call__(self, logger: object, name: str, event_dict: dict) -> str:
        return self.mark + super().__call__(logger, name, event_dict)


def pre_chain() -> list:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        add_logger_name,
        structlog.processors.TimeStamper(fmt="iso"),
    ]


def record_logger(stream: TextIO, name: str, mark: str, *, level: int = logging.INFO):  # noqa: ANN201 - a BoundLogger
    """A structlog logger of its own, apart from structlog's global configuration (a rank leaves that to its
    user's code): each event one JSON line after ``mark`` on ``stream``, with the contextvars bound."""
    processors = [*pre_chain(), structlog.processors.format_exc_info, MarkedJSON(mark)]
    return structlog.wrap_logger(SafePrintLogger(stream, name), processors=processors,
                                 wrapper_class=structlog.make_filtering_bound_logger(level))
