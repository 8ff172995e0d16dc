"""``ctl config``: named contexts (coordinator address, TLS directory) and the current one.

The file and its rules live in ``cli/contexts.py``; these commands read, change and write it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import click

from rankctl.cli.commands.completion import complete_context_names
from rankctl.cli.context import Ctx, pass_ctx
from rankctl.cli.contexts import Config, Context, address_problem, config_path, load, name_problem, save, selected
from rankctl.cli.errors import EXIT_JOB_FAILED, CtlError
from rankctl.cli.options import SuggestingGroup, example, json_option


def _name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    problem = name_problem(value)
    if problem:
        raise click.BadParameter(problem)
    return value


def _address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    problem = value is not None and address_problem(value)
    if problem:
        raise click.BadParameter(problem)
    return value


def _rewrite(name: str, change: Callable[[Config], Config]) -> Path:
    """Apply ``change`` to the file, whose context ``name`` must exist; the file's path."""
    path = config_path()
    cfg = load(path)
    if name not in cfg.contexts:
        raise CtlError(f"{path}: no context {name!r} (contexts: {', '.join(cfg.contexts) or 'none'})")
    return save(change(cfg), path)


name_argument = click.argument("name", callback=_name, shell_complete=complete_context_names)


@click.group("config", cls=SuggestingGroup, epilog=example("ctl config set-context prod --coordinator head:7420 --tls-dir ~/.rankctl/alice",
                                      "ctl config use-context prod"))
def config() -> None:
    """Named contexts: a coordinator address and a TLS identity directory, chosen per command with
    --context NAME (or RANKCTL_CONTEXT), else the current context. The file is $RANKCTL_CONFIG, else
    config.yaml in your config directory (`ctl config view` names it). For the address and the
    directory, a flag beats the environment, which beats the context, which beats the default."""


@config.command("set-context", epilog=example("ctl config set-context prod --coordinator head:7420"))
@name_argument
@click.option("--coordinator", callback=_address, metavar="HOST:PORT", help="Its coordinator (needed for a new one).")
@click.option("--tls-dir", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Its identity directory (`ctl certs issue`); stored as an absolute path.")
def set_context(name: str, coordinator: str | None, tls_dir: Path | None) -> None:
    """Add context NAME or change the fields given. The first context becomes the current one."""
    path = config_path()
    cfg = load(path)
    old = cfg.contexts.get(name)
    if old is None and coordinator is None:
        raise CtlError(f"context {name!r} is new: give its --coordinator HOST:PORT")
    new = Context(coordinator=coordinator or old.coordinator,
                  tls_dir=str(tls_dir.expanduser().resolve()) if tls_dir else (old.tls_dir if old else None))
    cfg = cfg.with_context(name, new)
    if cfg.current is None:
        cfg = Config(current=name, contexts=cfg.contexts)
    save(cfg, path)
    now = " (the current context)" if cfg.current == name else ""
    click.echo(f"context {name} {'changed' if old else 'added'} in {path}{now}", err=True)


@config.command("use-context", epilog=example("ctl config use-context prod"))
@name_argument
def use_context(name: str) -> None:
    """Make NAME the current context."""
    _rewrite(name, lambda cfg: Config(current=name, contexts=cfg.contexts))
    click.echo(f"current context: {name}", err=True)


@config.command("delete-context", epilog=example("ctl config delete-context old-cluster"))
@name_argument
def delete_context(name: str) -> None:
    """Remove context NAME (when it is the current one, no context is current after)."""
    path = _rewrite(name, lambda cfg: cfg.without(name))
    click.echo(f"context {name} deleted from {path}", err=True)


@config.command("current-context", epilog=example("ctl --context prod config current-context --json"))
@json_option
@pass_ctx
def current_context(ctx: Ctx, as_json: bool) -> None:
    """Print the name of the context commands use: --context / RANKCTL_CONTEXT, else the current one
    (exit 1 when there is none). --json: {"name", "coordinator", "tls_dir"}, the name (or null) and the
    address and directory a command would use, after flags and environment."""
    path = config_path()
    cfg = load(path)
    name = ctx.context or cfg.current
    selected(cfg, name, path)  # an unknown name is an error here too
    if as_json:
        from rankctl.cli.view.console import print_json

        print_json({"name": name, "coordinator": ctx.coordinator, "tls_dir": ctx.tls_dir})
    elif name is None:
        raise CtlError("no current context (`ctl config use-context NAME` sets one)", EXIT_JOB_FAILED)
    else:
        click.echo(name)


def _rows(cfg: Config) -> list[dict]:
    return [{"name": n, "coordinator": c.coordinator, "tls_dir": c.tls_dir, "current": n == cfg.current}
            for n, c in cfg.contexts.items()]


@config.command("get-contexts", epilog=example("ctl config get-contexts --json"))
@json_option
def get_contexts(as_json: bool) -> None:
    """List the contexts. --json: [{"name", "coordinator", "tls_dir", "current"}]."""
    from rankctl.cli.view.console import print_json, stdout_console
    from rankctl.cli.view.render import rows_table

    rows = _rows(load())
    if as_json:
        print_json(rows)
        return
    shown = [{"current": "*" if r["current"] else "", "name": r["name"], "coordinator": r["coordinator"],
              "tls dir": r["tls_dir"] or "-"} for r in rows]
    stdout_console().print(rows_table("contexts", shown) if shown else "no contexts")


@config.command("view", epilog=example("ctl config view --json"))
@json_option
def view(as_json: bool) -> None:
    """Print the config file's path (on stderr) and its settings (YAML; --json: the same as JSON)."""
    import yaml

    from rankctl.cli.view.console import print_json

    path = config_path()
    doc = load(path).to_doc()
    click.echo(f"# {path}{'' if path.exists() else ' (no such file yet)'}", err=True)
    if as_json:
        print_json(doc)
    else:
        click.echo(yaml.safe_dump(doc, sort_keys=False), nl=False)
