"""``ctl up``: run one job on this machine, start to finish, and tear everything down."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rankctl.cli.context import Ctx
from rankctl.cli.errors import CtlError
from rankctl.cli.options import example, log_format

if TYPE_CHECKING:
    from rankctl.contract.spec import JobSpec


def _cluster_shape(spec: "JobSpec", nodes: int | None, slots: int | None) -> tuple[int, int]:
    from rankctl.contract.limits import MAX_SLOTS_PER_NODE, MAX_WORLD_SIZE

    res = spec.resources
    n = res.nodes if nodes is None else nodes  # a flag given as 0 is refused below, not the default
    s = res.slots_per_node if slots is None else slots
    if n < 1 or s < 1:
        raise CtlError(f"--nodes={n} and --slots={s} must be at least 1")
    if s > MAX_SLOTS_PER_NODE or n * s > MAX_WORLD_SIZE:
        raise CtlError(f"--nodes={n} x --slots={s}: at most {MAX_SLOTS_PER_NODE} slots per node "
                       f"and {MAX_WORLD_SIZE} in all")
    least = res.fewest_nodes   # an elastic job (resources.min_nodes) starts on fewer nodes
    if n < least or s < res.slots_per_node:
        need = f"{least}..{res.nodes}" if least < res.nodes else f"{res.nodes}"
        raise CtlError(
            f"the job needs resources.nodes={need} x resources.slots_per_node={res.slots_per_node}, "
            f"but up would start {n} node(s) x {s} slot(s); raise --nodes/--slots or use --set resources..."
        )
    return n, s


def _keep_log(root: Path, tmp: bool, job: Any) -> None:
    """The components' log of a run that did not succeed is kept (``kept_log``) and named."""
    from rankctl.cli.local import kept_log
    from rankctl.cli.view.render import state_name

    if job is not None and state_name(job.state) == "SUCCEEDED":
        return
    path = kept_log(root, "rankctl-up-", tmp)
    if path is not None:
        click.echo(f"the coordinator's and daemons' log: {path}", err=True)


@click.command("up", epilog=example("ctl up examples/comm-check.yaml --nodes 2 --slots 2 --json"))
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--nodes", type=int, default=None, help="Local worker daemons (default: the job's resources.nodes).")
@click.option("--slots", type=int, default=None, help="Slots per daemon (default: resources.slots_per_node).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a job-file field.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep state, logs and checkpoints here (default: a temporary directory, removed).")
@click.option("--json", "as_json", is_flag=True, help="Print the final status as JSON alone on stdout.")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--verbose", is_flag=True,
              help="Show the coordinator's and daemons' log records on stderr (default: in the state dir's "
                   "components.log).")
@log_format
def up(job_file: str, nodes: int | None, slots: int | None, overrides: tuple[str, ...],
       state_dir: Path | None, as_json: bool, log_level: str, verbose: bool, log_format: str) -> None:
    """Start a coordinator and worker daemons here, run JOB_FILE to its end, print the result. What the
    ranks print is shown as it comes (on stderr), each line after [rank R]."""
    from rankctl.cli.view.follow import exit_for, follow_job
    from rankctl.cli.jobread import read_job_file
    from rankctl.cli.local import LocalCluster, component_logs
    from rankctl.cli.workdir import pack_workdir, ship
    from rankctl.cli.view.console import print_json, shared_output, stdout_console
    from rankctl.cli.view.render import job_to_dict, job_view

    read = read_job_file(job_file, overrides)
    n, s = _cluster_shape(read.spec, nodes, slots)
    packed = pack_workdir(read.spec)  # shipped as ctl submit ships it: the ranks run in the nodes' copies
    tmp = state_dir is None
    root = Path(tempfile.mkdtemp(prefix="rankctl-up-")) if tmp else state_dir
    click.echo(f"starting a coordinator and {n} worker daemon(s) x {s} slot(s) under {root}", err=True)
    log = component_logs(root, verbose, log_level, log_format)
    job = None
    try:
        with LocalCluster(n, s, root, log=log) as cluster:
            ctx = Ctx(coordinator=cluster.address)
            with ctx.client() as client:
                job = client.submit(read.text, read.sets + ship(client, packed), job_file)
            click.echo(f"submitted {job.id}", err=True)
            # progress on stderr; one final status: where stdout is seen too (a terminal, or both streams into one
            # file or pipe), the live view leaves nothing and the status printed on stdout replaces it (--json:
            # stdout holds the JSON alone)
            job = follow_job(ctx, job.id, live=True, transient=shared_output() and not as_json,
                             printed=True)   # what the ranks print, [rank R] first, above the live view
    finally:
        if log is not None:
            log.close()
            _keep_log(root, tmp, job)
        if tmp:
            shutil.rmtree(root, ignore_errors=True)
    if as_json:
        print_json(job_to_dict(job))
    else:
        stdout_console().print(job_view(job))
    exit_for(job)
