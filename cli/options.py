"""Options and help pieces every command group shares (docs/cli.md, Conventions)."""

from __future__ import annotations

from typing import Any

import click

OUTPUTS = ("table", "wide", "json", "yaml")


def json_flag(help_text: str = "Machine-readable JSON on stdout."):  # noqa: ANN201 - a click decorator
    """A command's ``--json`` (parameter ``as_json``); ``ctl --json COMMAND`` moves it there (``cli.globalopts``)."""
    return click.option("--json", "as_json", is_flag=True, help=help_text)


json_option = json_flag()

output_option = click.option(
    "-o", "--output", type=click.Choice(OUTPUTS), default=None,
    help="table (the default), wide (more columns), json (as --json) or yaml (the same document).")


def output_format(output: str | None, as_json: bool) -> str:
    """The one format ``-o`` and ``--json`` ask for; both, disagreeing, is a usage error."""
    if output and as_json and output != "json":
        raise click.UsageError(f"--json and -o {output} ask for different output: give one of them")
    return output or ("json" if as_json else "table")


def print_document(doc: Any, fmt: str) -> None:
    """``doc`` on stdout as JSON (``print_json``) or YAML (block style, keys in their order)."""
    from rankctl.cli.view.console import print_json

    if fmt == "json":
        print_json(doc)
        return
    import yaml

    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, default_flow_style=False, width=float("inf"))
    click.echo(text, nl=False)  # width: a long value stays on its line (grep), as a table row does


def example(*lines: str) -> str:
    """A command's epilog: its example, the last thing its --help prints (``\\b``: click keeps the lines)."""
    return "\b\nExample:\n" + "\n".join(f"  {line}" for line in lines)


log_format = click.option("--log-format", default="auto", show_default=True, envvar="RANKCTL_LOG_FORMAT",
                          type=click.Choice(["auto", "console", "json"]),
                          help="Log lines for people (console) or one JSON object a line (json); auto: console on "
                               "a terminal, else json.")


class SuggestingGroup(click.Group):
    """A command group whose "No such command" names the closest command (``ctl stauts``: did you mean status?)."""

    def resolve_command(self, ctx: click.Context, args: list[str]):  # noqa: ANN201 - click's signature
        from rankctl.contract.names import did_you_mean

        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None and not ctx.resilient_parsing:
            ctx.fail(f"No such command {name!r}.{did_you_mean(name, self.list_commands(ctx))}")
        return super().resolve_command(ctx, args)
