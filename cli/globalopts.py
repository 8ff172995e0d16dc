"""Global options after the subcommand: ``ctl jobs --coordinator X`` is ``ctl --coordinator X jobs``.

A global option that follows the subcommand moves in front of it, unless the subcommand (or one of its
own subcommands) defines an option of that name itself: ``ctl worker --coordinator`` and
``ctl worker --tls-dir`` stay the daemon's. Both ``--opt value`` and ``--opt=value`` move; ``--``
ends the scan (what follows is an argument), and so does the first argument of a command that takes no options
after its arguments (``ctl run train.py --coordinator X`` passes the flag to the script). The other way,
``ctl --json COMMAND`` moves the flag to the command (``lower_json``).
"""

from __future__ import annotations

from typing import Callable

import click

GLOBAL_OPTIONS = ("--coordinator", "--tls-dir", "--context")

OptionSpec = dict[str, bool]  # option string -> whether it takes a value


def option_spec(command: click.Command) -> OptionSpec:
    """The options ``command`` itself defines."""
    spec: OptionSpec = {}
    for param in command.params:
        if isinstance(param, click.Option):
            takes_value = not (param.is_flag or param.count)
            spec.update({opt: takes_value for opt in (*param.opts, *param.secondary_opts)})
    return spec


def chain_spec(command: click.Command, args: list[str]) -> OptionSpec:
    """The options of ``command`` and, for a group, of the subcommand ``args`` name (and so on down)."""
    own = option_spec(command)
    commands = getattr(command, "commands", None)
    at = _subcommand_index(args, own) if commands else None
    sub = commands.get(args[at]) if at is not None else None
    return {**own, **chain_spec(sub, args[at + 1:])} if sub is not None else own


def _subcommand_index(args: list[str], own: OptionSpec) -> int | None:
    """Where the subcommand's name is: the first word that is neither the group's option nor its value."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return i
        i += 2 if own.get(arg) else 1
    return None


def _global_name(arg: str) -> str | None:
    name = arg.split("=", 1)[0]
    return name if name in GLOBAL_OPTIONS else None


def hoist(args: list[str], own: OptionSpec, command_of: Callable[[str], click.Command | None]) -> list[str]:
    """``args`` with the global options that follow the subcommand moved in front of it.

    ``own``: the group's options; ``command_of(name)``: the subcommand (None: no such command)."""
    at = _subcommand_index(args, own)
    command = command_of(args[at]) if at is not None else None
    if command is None:
        return args
    spec = chain_spec(command, args[at + 1:])
    # ``ctl run SCRIPT ARGS`` (no interspersed arguments): what follows SCRIPT is the script's, moved nowhere
    passes = (command.context_settings or {}).get("allow_interspersed_args", True) is False
    moved, kept, i = [], args[:at + 1], at + 1
    while i < len(args):
        arg, name = args[i], _global_name(args[i])
        if arg == "--" or (passes and not arg.startswith("-")):
            kept += args[i:]
            break
        take = 2 if (spec.get(arg) or (name and name not in spec and "=" not in arg)) else 1
        (moved if name and name not in spec else kept).extend(args[i:i + take])
        i += take
    return args[:at] + moved + kept[at:]


JSON_FLAG = "--json"


def _group_flag_at(args: list[str], own: OptionSpec, end: int, flag: str) -> list[int]:
    """Where ``flag`` stands among the group's own options in ``args[:end]`` (never as another's value)."""
    found, i = [], 0
    while i < end:
        if args[i] == flag:
            found.append(i)
        i += 2 if own.get(args[i]) else 1
    return found


def lower_json(args: list[str], own: OptionSpec, command_of: Callable[[str], click.Command | None]) -> list[str]:
    """``ctl --json COMMAND ...`` is ``ctl COMMAND ... --json``: the flag given before the subcommand moves to the
    end (in front of a ``--``), where the command that prints JSON takes it; a command without one refuses it."""
    at = _subcommand_index(args, own)
    command = command_of(args[at]) if at is not None else None
    found = _group_flag_at(args, own, at, JSON_FLAG) if command is not None else []
    if not found:
        return args
    rest = args[at:]
    if JSON_FLAG not in chain_spec(command, rest[1:]):
        raise click.UsageError(f"--json: `ctl {args[at]}` has no JSON output ({JSON_FLAG} is for commands that "
                               "print results)")
    head = [arg for i, arg in enumerate(args[:at]) if i not in found]
    end = rest.index("--") if "--" in rest else len(rest)
    return head + rest[:end] + [JSON_FLAG] + rest[end:]
