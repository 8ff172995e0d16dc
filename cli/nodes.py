"""``ctl nodes``: the worker nodes the coordinator knows."""

from __future__ import annotations

import click

from rankctl.cli.context import Ctx, pass_ctx


@click.command("nodes")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
@pass_ctx
def nodes(ctx: Ctx, as_json: bool) -> None:
    """List nodes: name, address, slots, state (READY when connected)."""
    from rankctl.cli.render import node_to_dict, print_json, rows_table, stdout_console, when

    with ctx.client() as client:
        found = [node_to_dict(n) for n in client.nodes()]
    if as_json:
        print_json(found)
        return
    rows = [{"name": n["name"], "address": n["address"], "state": n["state"], "slots": n["slots"],
             "free": n["free_slots"], "gpus": len(n["gpus"]), "last seen": when(n["last_seen"])} for n in found]
    stdout_console().print(rows_table("nodes", rows) if rows else "no nodes")
