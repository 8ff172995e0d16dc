"""``ctl``: the rankctl command line. Subcommands load lazily so ``ctl --help`` stays fast."""

from __future__ import annotations

import importlib
import sys

import click

from rankctl.cli.context import Ctx
from rankctl.cli.errors import EXIT_USAGE

# name -> (module, attribute, one-line help). Modules import only click at top level.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "plan": ("rankctl.cli.plan", "plan", "Validate and explain a rank layout before anything is allocated."),
    "submit": ("rankctl.cli.jobs", "submit", "Submit a job file; print its id."),
    "jobs": ("rankctl.cli.jobs", "jobs", "List jobs."),
    "status": ("rankctl.cli.jobs", "status", "Show one job: state, reason, ranks, result."),
    "watch": ("rankctl.cli.jobs", "watch", "Follow a job live until it ends."),
    "logs": ("rankctl.cli.jobs", "logs", "Print (or follow) the ranks' output."),
    "cancel": ("rankctl.cli.jobs", "cancel", "Cancel a job."),
    "nodes": ("rankctl.cli.nodes", "nodes", "List worker nodes."),
    "drain": ("rankctl.cli.nodes", "drain", "Take a node out of service: no new work, its jobs move off it."),
    "undrain": ("rankctl.cli.nodes", "undrain", "Put a drained node back in service (clears its exclusions)."),
    "coordinator": ("rankctl.cli.daemons", "coordinator", "Run the coordinator service."),
    "worker": ("rankctl.cli.daemons", "worker", "Run a worker daemon for this node."),
    "up": ("rankctl.cli.up", "up", "Run a job on this machine: coordinator + daemons, to its end."),
    "checkpoint": ("rankctl.cli.checkpoint", "checkpoint", "Work with training checkpoints (export)."),
    "certs": ("rankctl.cli.certs", "certs", "Create a CA and issue node and user certificates (mutual TLS)."),
}


class LazyGroup(click.Group):
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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rankctl", prog_name="ctl")
@click.option("--coordinator", envvar="RANKCTL_COORDINATOR", default="127.0.0.1:7420", show_default=True,
              metavar="HOST:PORT", help="Coordinator address (env RANKCTL_COORDINATOR).")
@click.option("--tls-dir", envvar="RANKCTL_TLS_DIR", default=None, metavar="DIR",
              help="Your identity directory (ca.pem, cert.pem, key.pem from `ctl certs issue`) for a coordinator "
                   "that serves mutual TLS (env RANKCTL_TLS_DIR).")
@click.pass_context
def cli(ctx: click.Context, coordinator: str, tls_dir: str | None) -> None:
    """rankctl: a control plane for Megatron-style parallel training."""
    ctx.obj = Ctx(coordinator=coordinator, tls_dir=tls_dir or None)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="ctl", standalone_mode=True)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # last line of defence: no traceback reaches the user
        click.echo(f"error: internal error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_USAGE if isinstance(exc, ValueError) else 1)


if __name__ == "__main__":
    main()
