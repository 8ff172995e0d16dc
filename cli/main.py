"""``ctl``: the rankctl command line. Subcommands load lazily so ``ctl --help`` stays fast."""

from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager
from typing import Iterator

# gRPC's C core logs INFO lines ("chttp2_transport.cc ... Got goaway") to stderr by default since it moved to absl
# logging: between the structured lines of a coordinator's or a daemon's log they break --log-format json. Errors
# still show; GRPC_VERBOSITY set in the environment wins. Set before anything imports grpc.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import click

from rankctl.cli.context import Ctx
from rankctl.cli.contexts import CONTEXT_ENV, DEFAULT_COORDINATOR
from rankctl.cli.errors import EXIT_USAGE
from rankctl.cli.commands.completion import complete_context_names
from rankctl.cli.globalopts import hoist, lower_json, option_spec
from rankctl.cli.options import SuggestingGroup

# name -> (module, attribute, one-line help). Modules import only click at top level.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "plan": ("rankctl.cli.commands.plan", "plan", "Validate and explain a rank layout before anything is allocated."),
    "submit": ("rankctl.cli.commands.jobs", "submit", "Submit a job file; print its id."),
    "jobs": ("rankctl.cli.commands.jobs", "jobs", "List jobs."),
    "status": ("rankctl.cli.commands.jobs", "status", "Show one job: state, reason, ranks, result."),
    "watch": ("rankctl.cli.commands.jobs", "watch", "Follow a job live until it ends."),
    "logs": ("rankctl.cli.commands.jobs", "logs", "Print (or follow) the ranks' output."),
    "cancel": ("rankctl.cli.commands.jobs", "cancel", "Cancel a job."),
    "nodes": ("rankctl.cli.commands.nodes", "nodes", "List worker nodes."),
    "drain": ("rankctl.cli.commands.nodes", "drain", "Take a node out of service: no new work, its jobs move off it."),
    "undrain": ("rankctl.cli.commands.nodes", "undrain", "Put a drained node back in service (clears its exclusions)."),
    "coordinator": ("rankctl.cli.commands.coordinator", "coordinator", "Run the coordinator service (migrate: onto etcd)."),
    "info": ("rankctl.cli.commands.info", "info", "Who answers, who leads, the store and the coordinators seen."),
    "worker": ("rankctl.cli.commands.daemons", "worker", "Run a worker daemon for this node."),
    "slurm": ("rankctl.cli.commands.slurm", "slurm", "Run jobs on Slurm allocations (submit from the login node)."),
    "up": ("rankctl.cli.commands.up", "up", "Run a job on this machine: coordinator + daemons, to its end."),
    "run": ("rankctl.cli.commands.run", "run", "Run a script as torchrun would (its flags), as a rankctl job."),
    "checkpoint": ("rankctl.cli.commands.checkpoint", "checkpoint", "Work with training checkpoints (export)."),
    "certs": ("rankctl.cli.commands.certs", "certs", "Create a CA and issue node and user certificates (mutual TLS)."),
    "config": ("rankctl.cli.commands.config", "config", "Named contexts: coordinator address and TLS directory."),
    "completion": ("rankctl.cli.commands.completion", "completion", "Print the shell completion script (bash, zsh, fish)."),
}


class LazyGroup(SuggestingGroup):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Global options may also follow the subcommand, and --json precede it (``cli/globalopts.py``)."""
        own, command_of = option_spec(self), lambda name: self.get_command(ctx, name)
        try:
            args = lower_json(args, own, command_of)
        except click.UsageError:
            if not ctx.resilient_parsing:  # completing: offer what there is, never an error
                raise
        return super().parse_args(ctx, hoist(args, own, command_of))

    def make_context(self, *args, **kwargs) -> click.Context:  # noqa: ANN002, ANN003 - click's signature
        with _reader_gone_ok():  # `ctl --help | head -1`
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context):  # noqa: ANN201 - click's signature
        with _reader_gone_ok():
            return super().invoke(ctx)


@contextmanager
def _reader_gone_ok() -> Iterator[None]:
    """A closed stdout (`| head`) ends ``ctl`` with exit 0: the reader has what it wanted. Click itself
    would exit 1, as if the command had failed."""
    try:
        yield
    except BrokenPipeError:
        quiet_stdout()
        raise click.exceptions.Exit(0) from None


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail again
    (the SIGPIPE note in Python's ``signal`` docs)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # not a real file (CliRunner)
        pass
    finally:
        os.close(devnull)


EPILOG = """\b
Global options (--coordinator, --tls-dir, --context) go before or after the subcommand; so
does --json, for a command that prints JSON.
Exit codes: 0 ok, 1 job failed, 2 usage or refused, 3 coordinator unreachable.

\b
Example:
  ctl --context prod jobs --state RUNNING --json
"""


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.version_option(package_name="rankctl", prog_name="ctl")
@click.option("--coordinator", envvar="RANKCTL_COORDINATOR", default=None, metavar="HOST:PORT",
              help=f"Coordinator address, or several (A,B,C: the coordinators of one store; calls go to the leader) "
                   f"(env RANKCTL_COORDINATOR; else the context's; else {DEFAULT_COORDINATOR}).")
@click.option("--tls-dir", envvar="RANKCTL_TLS_DIR", default=None, metavar="DIR",
              help="Your identity directory (ca.pem, cert.pem, key.pem from `ctl certs issue`) for a coordinator "
                   "that serves mutual TLS (env RANKCTL_TLS_DIR; else the context's).")
@click.option("--context", "context_name", envvar=CONTEXT_ENV, default=None, metavar="NAME",
              shell_complete=complete_context_names,
              help=f"Use this context of `ctl config` for this command (env {CONTEXT_ENV}; else the current one).")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable JSON on stdout: the command's own --json, which this moves to.")
@click.pass_context
def cli(ctx: click.Context, coordinator: str | None, tls_dir: str | None, context_name: str | None,
        as_json: bool) -> None:
    """rankctl: a control plane for Megatron-style parallel training."""
    ctx.obj = Ctx.from_options(coordinator, tls_dir, context_name)


def main(argv: list[str] | None = None) -> None:
    try:
        code = _run(argv)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # last line of defence: no traceback reaches the user
        click.echo(f"error: internal error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_USAGE if isinstance(exc, ValueError) else 1)
    sys.exit(code)


def _run(argv: list[str] | None) -> int | str | None:
    """Run ``ctl``; its exit code, after stdout is flushed (a reader that left early is no failure)."""
    try:   # not click's standalone mode: it turns Ctrl-C into "Aborted!" and exit 1, which means "the job failed"
        returned = cli.main(args=argv, prog_name="ctl", standalone_mode=False)
        code: int | str | None = returned if isinstance(returned, int) else 0
    except click.exceptions.Abort:   # Ctrl-C (or EOF at a prompt)
        click.echo("interrupted", err=True)
        code = 130
    except click.UsageError as exc:   # one line in our form, not Click's usage block
        path = exc.ctx.command_path if exc.ctx is not None else "ctl"
        text = "; ".join(line.strip() for line in exc.format_message().splitlines() if line.strip())
        click.echo(f"error: {text} (see `{path} --help`)", err=True)
        code = exc.exit_code
    except click.ClickException as exc:
        exc.show()
        code = exc.exit_code
    except SystemExit as exc:
        code = exc.code
    except BrokenPipeError:
        code = 0
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()
        code = 0
    return code


if __name__ == "__main__":
    main()
