"""Shell completion: ``ctl completion SHELL`` prints click's script; job ids and node names complete
from the coordinator (one short ListJobs / ListNodes; nothing, silently, when it does not answer),
context names (``--context``, ``ctl config use-context``) from the config file."""

from __future__ import annotations

import click
from click.shell_completion import CompletionItem

CONNECT_TIMEOUT = 1.0
CALL_TIMEOUT = 2.0
JOBS_OFFERED = 200  # the newest jobs: ListJobs' first page
SHELLS = ("bash", "zsh", "fish")


def _root_ctx(ctx: click.Context):  # noqa: ANN202 - a Ctx
    """The global options as parsed so far (the group's callback does not run while completing)."""
    from rankctl.cli.context import Ctx

    root = ctx.find_root()
    if isinstance(root.obj, Ctx):
        return root.obj
    params = root.params
    return Ctx.from_options(params.get("coordinator"), params.get("tls_dir"), params.get("context_name"))


def _ask(ctx: click.Context, call) -> list:  # noqa: ANN001 - call(stub) -> items
    """``call(stub)`` against the coordinator, or [] on any failure: completion never prints an error."""
    try:
        from rankctl.cli.client import Client

        target = _root_ctx(ctx)
        with Client(target.coordinator, connect_timeout=CONNECT_TIMEOUT, tls_dir=target.tls_dir) as client:
            return call(client.stub)
    except Exception:  # noqa: BLE001 - unreachable, refused, a bad config: offer nothing
        return []


def complete_job_ids(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    from rankctl.cli.view.render import state_name
    from rankctl.proto import rankctl_pb2 as pb

    def call(stub) -> list:  # noqa: ANN001
        return list(stub.ListJobs(pb.ListJobsRequest(page_size=JOBS_OFFERED), timeout=CALL_TIMEOUT).jobs)

    return [CompletionItem(j.id, help=f"{j.name} {state_name(j.state)}".strip())
            for j in _ask(ctx, call) if j.id.startswith(incomplete)]


def complete_node_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    from rankctl.cli.view.render import node_state_name
    from rankctl.proto import rankctl_pb2 as pb

    def call(stub) -> list:  # noqa: ANN001
        return list(stub.ListNodes(pb.ListNodesRequest(), timeout=CALL_TIMEOUT).nodes)

    return [CompletionItem(n.name, help=node_state_name(n.state) + (" draining" if n.draining else ""))
            for n in _ask(ctx, call) if n.name.startswith(incomplete)]


def complete_context_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The config file's contexts, each with its coordinator as the help; nothing when the file is bad."""
    from rankctl.cli.contexts import load
    from rankctl.cli.errors import CtlError

    try:
        contexts = load().contexts
    except CtlError:
        return []
    return [CompletionItem(name, help=c.coordinator or "") for name, c in contexts.items() if name.startswith(incomplete)]


@click.command("completion", epilog="\b\nExample:\n  ctl completion bash > ~/.local/share/bash-completion/completions/ctl")
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the completion script for SHELL on stdout. Load it from your shell's start-up file:

    \b
      bash: eval "$(ctl completion bash)"     (~/.bashrc)
      zsh:  eval "$(ctl completion zsh)"      (~/.zshrc)
      fish: ctl completion fish | source      (~/.config/fish/config.fish)
    """
    from click.shell_completion import get_completion_class

    root = click.get_current_context().find_root().command  # ctl itself (no import of cli.main: no cycle)
    script = get_completion_class(shell)(root, {}, "ctl", "_CTL_COMPLETE").source()
    click.echo(script)
