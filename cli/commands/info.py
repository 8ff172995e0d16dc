"""``ctl info``: which coordinator answers, who leads, the store and the coordinators seen."""

from __future__ import annotations

import click

from rankctl.cli.context import Ctx, pass_ctx
from rankctl.cli.options import example, json_option, output_format, output_option, print_document


def info_to_dict(info) -> dict:  # noqa: ANN001 - a pb.GetInfoResponse
    return {"answered_by": {"id": info.id, "address": info.address, "role": info.role},
            "leader": info.leader_address or None, "store": {"kind": info.store_kind, "location": info.store,
                                                              "problem": info.store_problem or None},
            "version": info.version,
            "coordinators": [{"id": m.id, "address": m.address, "version": m.version, "leading": m.leading,
                              "started_at": m.started_at or None} for m in info.members]}


@click.command("info", epilog=example("ctl --coordinator head1:7420,head2:7420 info --json | jq -r .leader"))
@output_option
@json_option
@pass_ctx
def info(ctx: Ctx, output: str | None, as_json: bool) -> None:
    """The coordinator that answers, the leader, the store (kind and location) and every coordinator of the
    store seen, with its version. With several --coordinator addresses, the first that answers says."""
    from rankctl.cli.view.console import stdout_console
    from rankctl.cli.view.render import rows_table

    fmt = output_format(output, as_json)
    with ctx.client() as client:
        doc = info_to_dict(client.info())
    if fmt in ("json", "yaml"):
        print_document(doc, fmt)
        return
    console = stdout_console()
    store = doc["store"]
    console.print(f"leader:   {doc['leader'] or '(none)'}")
    console.print(f"answered: {doc['answered_by']['address']} ({doc['answered_by']['role']}, {doc['version']})")
    console.print(f"store:    {store['kind']} {store['location']}" + (f"  PROBLEM: {store['problem']}"
                                                                       if store["problem"] else ""), markup=False)
    rows = [{"address": m["address"], "id": m["id"], "role": "leader" if m["leading"] else "standby",
             "version": m["version"]} for m in doc["coordinators"]]
    console.print(rows_table("coordinators", rows))
