"""configure_logging: one format for structlog's events and the stdlib loggers' records (grpc, asyncio)."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog
from click.testing import CliRunner

from rankctl.worker.launcher.procutil import SafeStreamHandler, configure_logging


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_logging():
    root = logging.getLogger()
    level = root.level
    yield
    for handler in [h for h in root.handlers if isinstance(h, SafeStreamHandler)]:
        root.removeHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.reset_defaults()


def log_three_ways() -> None:
    """A structlog event, a grpc stdlib record and an exception (logged by the stdlib)."""
    structlog.get_logger("rankctl.coordinator").info("coordinator listening", address="127.0.0.1:1")
    logging.getLogger("grpc").warning("channel %s closed", "c1")
    try:
        raise RuntimeError("the cause")
    except RuntimeError:
        logging.getLogger("asyncio").exception("task failed")


@pytest.mark.parametrize("stream", [io.StringIO(), Tty()], ids=["pipe", "tty"])
def test_json_gives_one_json_object_a_line_even_on_a_tty(stream: io.StringIO) -> None:
    configure_logging(stream, fmt="json")
    log_three_ways()
    lines = stream.getvalue().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["logger"], r["level"], r["event"]) for r in records] == [
        ("rankctl.coordinator", "info", "coordinator listening"),
        ("grpc", "warning", "channel c1 closed"),
        ("asyncio", "error", "task failed"),
    ]
    assert all(r["timestamp"].endswith("Z") for r in records)
    assert records[0]["address"] == "127.0.0.1:1"
    assert "RuntimeError: the cause" in records[2]["exception"]


def test_a_structlog_exception_is_one_json_line() -> None:
    stream = io.StringIO()
    configure_logging(stream, fmt="json")
    try:
        raise KeyError("k")
    except KeyError:
        structlog.get_logger("rankctl.worker").exception("pump failed", node="n0")
    [line] = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and record["node"] == "n0" and "KeyError: 'k'" in record["exception"]


def test_console_gives_human_lines() -> None:
    stream = io.StringIO()
    configure_logging(stream, fmt="console")
    log_three_ways()
    text = stream.getvalue()
    assert "[info     ] coordinator listening" in text and "address=127.0.0.1:1" in text
    assert "[warning  ] channel c1 closed" in text and "[grpc]" in text
    assert "Traceback (most recent call last)" in text and "RuntimeError: the cause" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_auto_is_console_on_a_tty_and_json_otherwise() -> None:
    for stream, is_json in ((Tty(), False), (io.StringIO(), True)):
        configure_logging(stream)
        logging.getLogger("aiohttp.server").error("bad request")
        line = stream.getvalue().splitlines()[0]
        assert line.startswith("{") is is_json


def test_an_unknown_format_names_the_value_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'yaml' is not one of auto, console, json"):
        configure_logging(io.StringIO(), fmt="yaml")


def test_configuring_again_replaces_the_handler_and_honours_the_level() -> None:
    first, second = io.StringIO(), io.StringIO()
    for _ in range(3):
        configure_logging(first, fmt="json")
    configure_logging(second, fmt="json", level="warning")
    logging.getLogger("grpc._cython.cygrpc").info("debug chatter")
    logging.getLogger("grpc._cython.cygrpc").error("real trouble")
    structlog.get_logger("rankctl.worker").info("quiet")
    assert first.getvalue() == ""
    assert [json.loads(line)["event"] for line in second.getvalue().splitlines()] == ["real trouble"]
    assert sum(isinstance(h, SafeStreamHandler) for h in logging.getLogger().handlers) == 1


def test_without_stdlib_the_root_logger_is_left_to_the_users_code() -> None:
    configure_logging(io.StringIO(), fmt="json")  # the launcher's, inherited by a forked rank
    configure_logging(io.StringIO(), fmt="json", stdlib=False)
    assert not any(isinstance(h, SafeStreamHandler) for h in logging.getLogger().handlers)


def test_a_stdlib_record_that_cannot_be_written_is_dropped_not_raised() -> None:
    class FullDisk(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    before = SafeStreamHandler.dropped
    configure_logging(FullDisk(), fmt="json")
    logging.getLogger("grpc").error("lost")
    assert SafeStreamHandler.dropped == before + 1


def test_the_coordinator_logs_json_lines_with_log_format_json(tmp_path: Path) -> None:
    from rankctl.cli.main import cli

    assert "--log-format" in CliRunner().invoke(cli, ["coordinator", "--help"]).output   # (was a skip: issue 53)
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankctl.cli.main", "coordinator", "--listen", "127.0.0.1:0", "--state-dir",
         str(state), "--log-format", "json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "default"})
    try:
        deadline = time.monotonic() + 60
        while not (state / "address").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (state / "address").exists(), "the coordinator did not start"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    records = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert any(r["event"] == "coordinator listening" for r in records), err
    assert all({"level", "timestamp", "event"} <= r.keys() for r in records)


def test_a_ranks_records_are_marked_json_lines_whatever_its_users_logging_does() -> None:
    """A rank's records share its log with what its program prints: each is one marked JSON line (multi-line
    values included) from a logger of their own; the user's structlog and stdlib logging stay unmarked."""
    from rankctl.contract.files.logrecords import RECORD_MARK, parse_record
    from rankctl.contract.logformat import record_logger

    stream = Tty()
    log = record_logger(stream, "rankctl.rank", RECORD_MARK)
    structlog.configure(processors=[structlog.dev.ConsoleRenderer(colors=False)],
                        logger_factory=structlog.PrintLoggerFactory(stream))  # the user's own configuration
    structlog.contextvars.bind_contextvars(rank=5)
    try:
        log.info("step", step=3, note="two\nlines")
        structlog.get_logger().info("the user's structlog line")
        handler = logging.StreamHandler(stream)
        logging.getLogger("user").addHandler(handler)
        try:
            logging.getLogger("user").warning("the user's own line")
        finally:
            logging.getLogger("user").removeHandler(handler)
    finally:
        structlog.contextvars.clear_contextvars()
    first, *rest = stream.getvalue().rstrip("\n").split("\n")  # not splitlines(): it splits at the mark too
    record = parse_record(first)
    assert record is not None and record["logger"] == "rankctl.rank"
    assert (record["event"], record["step"], record["note"], record["rank"]) == ("step", 3, "two\nlines", 5)
    assert "the user's structlog line" in rest[0] and rest[1] == "the user's own line"
    assert all(parse_record(line) is None and RECORD_MARK not in line for line in rest)
