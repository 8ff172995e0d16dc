"""Where ``ctl`` output goes: results on stdout (``--json``: JSON only), everything else on stderr.

On a terminal rich draws as usual (its width, colour unless ``NO_COLOR``). On a pipe or a file the
output is for programs: no colour, no highlighting, and no wrapping at all (one line per table row),
whatever ``COLUMNS`` says: shells and CI runners export it by accident, and ``grep``/``awk`` need rows
whole. docs/cli.md, Output.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any

PIPE_WIDTH = 100_000  # "unlimited": a rich table never grows past its content unless told to expand


def is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real file (CliRunner)
        return False


def shared_output() -> bool:
    """stdout and stderr reach the same place (a terminal, or one file or pipe: ``2>&1``): what is printed on stdout
    is seen by whoever reads stderr."""
    if is_terminal(sys.stdout):
        return True
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (AttributeError, ValueError, OSError):   # not real files (CliRunner)
        return False
    return (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)


def _console(stderr: bool):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if is_terminal(stream):
        return Console(stderr=stderr, no_color=bool(os.environ.get("NO_COLOR")) or None)
    return Console(stderr=stderr, width=PIPE_WIDTH, soft_wrap=True, no_color=True, color_system=None,
                   highlight=False, emoji=False, force_terminal=False)


def stdout_console():
    """For results (tables, a job's view): stdout."""
    return _console(stderr=False)


def stderr_console():
    """For progress and live views: stderr."""
    return _console(stderr=True)


def print_json(doc: Any) -> None:
    """One JSON document on stdout (indented)."""
    json.dump(doc, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def print_json_line(doc: Any) -> None:
    """One JSON document on one line (a stream of them: ``logs --json``)."""
    sys.stdout.write(json.dumps(doc, separators=(",", ":"), default=str) + "\n")
    sys.stdout.flush()  # a follower reads each line as it comes
