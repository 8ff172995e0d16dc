"""Exit codes and the one error type every command raises: a message, never a traceback."""

from __future__ import annotations

import click

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


class CtlError(click.ClickException):
    """A user-facing failure: printed as ``error: <message>`` on stderr, exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = code

    def show(self, file=None) -> None:  # noqa: ANN001 - click's signature
        click.echo(f"error: {self.format_message()}", err=True)
