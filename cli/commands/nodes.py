"""``ctl nodes``, ``ctl drain``, ``ctl undrain``: the worker nodes the coordinator knows, and taking
one out of service and back."""

from __future__ import annotations

import click

from rankctl.cli.commands.completion import complete_node_names
from rankctl.cli.context import Ctx, pass_ctx
from rankctl.cli.options import example, json_option, output_format, output_option, print_document

JOBS_SHOWN = 3  # job ids named per node in the table (--json has them all)


def _few(jobs: list[str]) -> str:
    """A node's jobs in the table: "-" for none, the first ``JOBS_SHOWN`` and how many more."""
    more = f" +{len(jobs) - JOBS_SHOWN}" if len(jobs) > JOBS_SHOWN else ""
    return ", ".join(jobs[:JOBS_SHOWN]) + more if jobs else "-"


def _flags(n: dict) -> str:
    """What the table says beside the state: draining, and the jobs the node is not placed for again."""
    parts = ["draining"] if n["draining"] else []
    if n["excluded_for"]:
        parts.append(f"excluded for {_few(n['excluded_for'])}")
    return "; ".join(parts)


def usage_to_dict(node) -> dict | None:  # noqa: ANN001 - a pb.Node
    """The node's last reported use (``Node.usage``), None when it reported none."""
    if not node.HasField("usage"):
        return None
    u = node.usage
    return {"cpu_percent": u.cpu_percent, "memory_used_bytes": u.memory_used_bytes,
            "memory_total_bytes": u.memory_total_bytes,
            "gpus": [{"index": g.index, "utilization": g.utilization, "memory_used_bytes": g.memory_used_bytes,
                      "memory_total_bytes": g.memory_total_bytes} for g in u.gpus],
            "sample_time": u.sample_time.seconds + u.sample_time.nanos / 1e9 if u.HasField("sample_time") else None}


def _gib(used: int, total: int) -> str:
    return f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB" if total else "-"


def _usage_cells(u: dict | None) -> dict[str, str]:
    """The table's cpu, memory and gpu use cells: "-" where the node reported nothing."""
    if u is None:
        return {"cpu": "-", "memory": "-", "gpu use": "-"}
    gpus = u["gpus"]
    gpu = "-"
    if gpus:
        mean = sum(g["utilization"] for g in gpus) / len(gpus)
        mem = _gib(sum(g["memory_used_bytes"] for g in gpus), sum(g["memory_total_bytes"] for g in gpus))
        gpu = f"{mean:.0f}% {mem}" if len(gpus) == 1 else f"{len(gpus)}x avg {mean:.0f}% {mem}"
    return {"cpu": f"{u['cpu_percent']:.0f}%", "memory": _gib(u["memory_used_bytes"], u["memory_total_bytes"]),
            "gpu use": gpu}


@click.command("nodes", epilog=example("ctl nodes --json | jq -r '.[] | select(.state == \"READY\") | .name'"))
@output_option
@json_option
@pass_ctx
def nodes(ctx: Ctx, output: str | None, as_json: bool) -> None:
    """List nodes: name, address, slots, state (READY when connected), the jobs holding slots there ("-":
    none; a drained node is empty when it shows none), CPU, memory and GPU use as last
    reported ("-": none yet), whether it is draining and the jobs it is excluded from (its ranks failed
    in two attempts in a row; `ctl undrain NODE` clears them). -o wide adds the hostname and each GPU."""
    from rankctl.cli.view.console import stdout_console
    from rankctl.cli.view.render import node_to_dict, rows_table, when

    fmt = output_format(output, as_json)
    with ctx.client() as client:
        found = [{**node_to_dict(n), "usage": usage_to_dict(n)} for n in client.nodes()]
    if fmt in ("json", "yaml"):
        print_document(found, fmt)
        return
    rows = [{"name": n["name"], "address": n["address"], "state": n["state"], "slots": n["slots"],
             "free": n["free_slots"], "jobs": _few(n["jobs"]), "gpus": len(n["gpus"]), **_usage_cells(n["usage"]),
             "last seen": when(n["last_seen"])} for n in found]
    if fmt == "wide":
        for row, n in zip(rows, found):
            row["hostname"] = n["hostname"] or "-"
            row["per gpu"] = " ".join(f"{g['index']}:{g['utilization']:.0f}%" for g in (n["usage"] or {}).get("gpus", [])) or "-"
    if any(n["pool"] for n in found):
        for row, n in zip(rows, found):
            row["pool"] = n["pool"] or "-"
    if any(_flags(n) for n in found):
        for row, n in zip(rows, found):
            row["service"] = _flags(n) or "-"
    stdout_console().print(rows_table("nodes", rows) if rows else "no nodes")


def _answer(answer, as_json: bool, human: str) -> None:  # noqa: ANN001 - a DrainNodeResponse
    if as_json:
        from rankctl.cli.view.console import print_json

        print_json({"node": answer.node.name, "draining": answer.node.draining, "jobs": list(answer.jobs)})
    else:
        click.echo(human)


node_argument = click.argument("node", shell_complete=complete_node_names)


@click.command("drain", epilog=example("ctl drain node-3 --reason 'ECC errors on GPU 5'"))
@node_argument
@click.option("--reason", default="", metavar="TEXT", help="Why (stored, shown in the moved jobs' reasons).")
@json_option
@pass_ctx
def drain(ctx: Ctx, node: str, reason: str, as_json: bool) -> None:
    """Take NODE out of service: it gets no new work and stays connected while its jobs move off it.

    A running train job on it is asked for a checkpoint a couple of steps ahead, then restarts without
    the node and resumes from that checkpoint (at most 60 s later); other jobs restart at once. A drain
    restart does not count against restart.max_restarts. Jobs wait when no other node can take them.
    The drain survives a coordinator restart; `ctl undrain NODE` ends it.
    With --json: {"node", "draining", "jobs"} (the jobs moving off it).
    """
    with ctx.client() as client:
        answer = client.drain(node, reason)
    jobs = list(answer.jobs)
    moving = f"; moving {len(jobs)} job(s) off it: {', '.join(jobs)}" if jobs else "; no job runs on it"
    _answer(answer, as_json, f"node {answer.node.name} is draining: it takes no new work{moving}")


@click.command("undrain", epilog=example("ctl undrain node-3"))
@node_argument
@json_option
@pass_ctx
def undrain(ctx: Ctx, node: str, as_json: bool) -> None:
    """Put NODE back in service: it takes new work again, and it is placed again for the jobs it was
    excluded from after its ranks failed in two attempts in a row (those exclusions are cleared).
    With --json: {"node", "draining", "jobs"} (the jobs it may run again)."""
    with ctx.client() as client:
        answer = client.drain(node, undrain=True)
    jobs = list(answer.jobs)
    cleared = f"; it may run {', '.join(jobs)} again" if jobs else ""
    _answer(answer, as_json, f"node {answer.node.name} takes work again{cleared}")
