"""Options and help pieces every command group shares (docs/cli.md, Conventions)."""

from __future__ import annotations

import click

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")


def example(*lines: str) -> str:
    """A command's epilog: its example, the last thing its --help prints (``\\b``: click keeps the lines)."""
    return "\b\nExample:\n" + "\n".join(f"  {line}" for line in lines)


log_format = click.option("--log-format", default="auto", show_default=True, envvar="RANKCTL_LOG_FORMAT",
                          type=click.Choice(["auto", "console", "json"]),
                          help="Log lines for people (console) or one JSON object a line (json); auto: console on "
                               "a terminal, else json.")
