"""Job commands: submit, jobs, status, watch, logs, cancel (following a job: ``cli.view.follow``)."""

from __future__ import annotations

import sys

import click

from rankctl.cli.commands.completion import complete_job_ids
from rankctl.cli.context import Ctx, pass_ctx
from rankctl.cli.view.follow import SHOWN_RANKS, exit_for, follow_job
from rankctl.cli.options import example, json_flag, json_option, output_format, output_option, print_document

job_id_argument = click.argument("job_id", shell_complete=complete_job_ids)

MAX_RANK = 2**31 - 1   # what the wire's int32 fields hold (a larger --rank/--tail/--ranks was 'internal error')


@click.command("submit", epilog=example("ctl submit examples/comm-check.yaml --set resources.nodes=2 --wait"))
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a job-file field.")
@click.option("--watch", "watch_", is_flag=True, help="Show live progress on stderr until the job ends.")
@click.option("--wait", is_flag=True, help="Block until the job ends; exit 0 only on SUCCEEDED.")
@click.option("--queue-anyway", is_flag=True,
              help="Accept a job larger than the cluster's nodes and let it wait for nodes.")
@json_option
@pass_ctx
def submit(ctx: Ctx, job_file: str, overrides: tuple[str, ...], watch_: bool, wait: bool, queue_anyway: bool,
           as_json: bool) -> None:
    """Submit JOB_FILE; print the job id alone on stdout. A python.workdir is packed and shipped with it.

    With --json: {"id", "name", "kind", "state", "world_size"}; with --wait or --watch too, only the
    final status (as `ctl status --json`) once the job ends."""
    from rankctl.cli.view.console import print_json
    from rankctl.cli.view.render import job_to_dict, state_name
    from rankctl.cli.jobread import read_job_file
    from rankctl.cli.workdir import pack_workdir, ship

    read = read_job_file(job_file, overrides)
    packed = pack_workdir(read.spec)  # before connecting: an oversize workdir is refused here
    with ctx.client() as client:
        job = client.submit(read.text, read.sets + ship(client, packed), job_file, queue_anyway=queue_anyway)
    if not as_json:
        click.echo(job.id)
        sys.stdout.flush()
    elif not (watch_ or wait):
        print_json({"id": job.id, "name": job.name, "kind": job.kind, "state": state_name(job.state),
                    "world_size": job.world_size})
    if watch_ or wait:
        final = follow_job(ctx, job.id, live=watch_)
        if as_json:
            print_json(job_to_dict(final))
        exit_for(final)


@click.command("jobs", epilog=example("ctl jobs --state RUNNING --state PENDING --limit 20 -o wide"))
@click.option("--limit", type=click.IntRange(0, MAX_RANK), default=0,
              help="Newest N jobs (0: all, fetched page by page).")
@click.option("--state", "states", multiple=True, metavar="STATE",
              type=click.Choice(["PENDING", "PLACED", "STARTING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED",
                                 "RESTARTING"], case_sensitive=False),
              help="Only jobs in this state (repeatable).")
@output_option
@json_option
@pass_ctx
def jobs(ctx: Ctx, limit: int, states: tuple[str, ...], output: str | None, as_json: bool) -> None:
    """List jobs, newest first. -o json (as --json) and -o yaml: job summaries (docs/cli.md, JSON shapes);
    -o wide: name, kind, attempt, nodes and the whole reason too."""
    from rankctl.cli.view.console import stdout_console
    from rankctl.cli.view.render import job_to_dict, rows_table

    fmt = output_format(output, as_json)
    with ctx.client() as client:
        found = [job_to_dict(j) for j in client.jobs(limit, [s.upper() for s in states])]
    if fmt in ("json", "yaml"):
        print_document(found, fmt)
        return
    rows = [_job_row(j, wide=fmt == "wide") for j in found]
    stdout_console().print(rows_table("jobs", rows) if rows else "no jobs")


NODES_IN_ROW = 4  # node names in a wide row; the rest are counted


def _job_row(j: dict, wide: bool) -> dict:
    from rankctl.cli.view.render import when

    if not wide:
        return {"id": j["id"], "state": j["state"], "world": j["world_size"], "created": when(j["created_at"]),
                "reason": j["reason"][:60]}
    nodes = j["nodes"][:NODES_IN_ROW] + ([f"+{len(j['nodes']) - NODES_IN_ROW}"] if len(j["nodes"]) > NODES_IN_ROW else [])
    count = j.get("node_count") or 0   # ListJobs names no nodes (its pages stay bounded): how many, then
    return {"id": j["id"], "name": j["name"], "kind": j["kind"], "state": j["state"], "attempt": j["attempt"],
            "world": j["world_size"], "nodes": ",".join(nodes) or (str(count) if count else "-"),
            "created": when(j["created_at"]),
            "finished": when(j["finished_at"]), "by": j["submitted_by"] or "-", "reason": j["reason"]}


def _rank_span(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    first, _, last = value.partition("-")
    if not (first.isascii() and first.isdigit() and (last.isdigit() and last.isascii() or not last)) \
            or int(last or first) < int(first) or int(last or first) > MAX_RANK:
        raise click.BadParameter(f"{value!r} is not a rank range A-B with 0 <= A <= B <= {MAX_RANK} (or one rank A)")
    return int(first), int(last or first)


@click.command("status", epilog=example("ctl status train-0a1b2c --ranks 0-127"))
@job_id_argument
@click.option("--ranks", "span", metavar="A-B", callback=_rank_span,
              help="Ranks A to B (or one rank A), fetched page by page, instead of the first page.")
@json_option
@pass_ctx
def status(ctx: Ctx, job_id: str, span: tuple[int, int] | None, as_json: bool) -> None:
    """Show JOB_ID (id or name): state, reason, rank summary (phases, steps, stragglers, failing ranks),
    the first 64 ranks, result. With --json, "ranks" holds the coordinator's first page (256 ranks)
    or the --ranks range; when that is not every rank, "ranks_shown" ({first, last}) and
    "next_rank_offset" (null: no more) say which."""
    from rankctl.cli.view.console import print_json, stdout_console
    from rankctl.cli.view.render import job_to_dict, job_view

    with ctx.client() as client:
        if span is not None:
            job = client.get_ranks(job_id, *span)
        else:
            job = client.get(job_id, rank_limit=0 if as_json else SHOWN_RANKS)
    if span is not None and not job.ranks:
        click.echo(f"no ranks in {span[0]}-{span[1]}: job {job.id} has ranks 0-{job.world_size - 1}", err=True)
    if as_json:
        print_json(job_to_dict(job))
    else:
        stdout_console().print(job_view(job, max_ranks=len(job.ranks) if span is not None else SHOWN_RANKS))


@click.command("watch", epilog=example("ctl watch train-0a1b2c --json > final.json"))
@job_id_argument
@json_option
@pass_ctx
def watch(ctx: Ctx, job_id: str, as_json: bool) -> None:
    """Follow JOB_ID live (state, per-rank phase and step, on stderr) until it ends; exit 0 only on
    SUCCEEDED. With --json, the final status (as `ctl status --json`) on stdout."""
    from rankctl.cli.view.console import print_json
    from rankctl.cli.view.render import job_to_dict

    job = follow_job(ctx, job_id, live=True)  # on stderr
    if as_json:
        print_json(job_to_dict(job))
    exit_for(job)


@click.command("logs", epilog=example("ctl logs train-0a1b2c --rank 0 --follow | grep loss"))
@job_id_argument
@click.option("--rank", type=click.IntRange(0, MAX_RANK), default=None,
              help="Only this rank (default: all ranks, each line after [rank R]).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--tail", type=click.IntRange(0, MAX_RANK), default=0,
              help="Only the last N lines per rank (0: all kept).")
@click.option("--records", is_flag=True,
              help="Also rankctl's own records (phases, steps, errors) among the lines, as [rankctl LEVEL] EVENT key=value.")
@json_flag('One JSON object a line: {"rank", "attempt", "line"}; a record (--records): {"rank", "attempt", "record"}.')
@pass_ctx
def logs(ctx: Ctx, job_id: str, rank: int | None, follow: bool, tail: int, records: bool, as_json: bool) -> None:
    """Print what the ranks printed (stdout and stderr), whole lines however long, in rank order."""
    from rankctl.cli.view.console import print_json_line
    from rankctl.cli.view.logview import line_doc, line_text

    printed = 0
    with ctx.client() as client:
        for line in client.logs(job_id, rank, follow, tail, records):
            printed += 1
            if as_json:
                print_json_line(line_doc(line.rank, line.attempt, line.line))
            else:
                click.echo(line_text(line.rank, line.line, prefixed=rank is None))
        if not printed and rank is not None:
            click.echo(_nothing_printed(client.get(job_id, rank_limit=0), rank), err=True)


def _nothing_printed(job, rank: int) -> str:  # noqa: ANN001 - a pb.Job
    """What to say when one rank's log is empty: a train job's step lines come from its last rank."""
    said = f"rank {rank} of {job.id} printed nothing"
    last = job.world_size - 1
    if job.kind == "train" and rank != last:
        said += f"; a train job's step lines come from its last rank (the last pipeline stage): ctl logs {job.id} " \
                f"--rank {last}"
    return said


@click.command("cancel", epilog=example("ctl cancel train-0a1b2c --reason 'wrong data path'"))
@job_id_argument
@click.option("--reason", default="", help="Why (in the job's reason: \"cancelled: REASON\"; default \"cancelled by user\").")
@json_option
@pass_ctx
def cancel(ctx: Ctx, job_id: str, reason: str, as_json: bool) -> None:
    """Cancel JOB_ID: its ranks are stopped on every node."""
    from rankctl.cli.view.console import print_json
    from rankctl.cli.view.render import job_to_dict, state_name

    with ctx.client() as client:
        job = client.cancel(job_id, reason)
    if state_name(job.state) != "CANCELLED":   # it had ended: the coordinator leaves an ended job as it is
        click.echo(f"{job.id} had already ended {state_name(job.state)}: nothing to cancel", err=True)
    if as_json:
        print_json(job_to_dict(job))
    else:
        click.echo(f"{job.id} {state_name(job.state)}")
