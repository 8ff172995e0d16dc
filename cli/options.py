"""Options and help pieces every command group shares (docs/cli.md, Conventions)."""

from __future__ import annotations

import click

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")


def example(*lines: str) -> str:
    """A command's epilog: its example, the last thing its --help prints (``\\b``: click keeps the lines)."""
    return "\b\nExample:\n" + "\n".join(f"  {line}" for line in lines)
