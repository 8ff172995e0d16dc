"""``ctl slurm``: a job on its own Slurm allocation (``submit``), or workers for the general queue (``workers``,
``release``, ``pools``), asked for by the coordinator (``coordinator.batch.slurm``, ``coordinator.batch.pools``).

The coordinator (on or reachable from the login node, with Slurm's client commands) stores the job, asks Slurm
for ``resources.nodes + --spares`` nodes with one ``ctl worker`` each, places the job on them only, and ends
the allocation when the job ends. ``--dry-run`` prints the batch script and the sbatch command and submits nothing.
"""

from __future__ import annotations

import json
import shlex
import sys

import click

from rankctl.cli.context import Ctx, pass_ctx
from rankctl.cli.view.follow import exit_for, follow_job
from rankctl.cli.options import SuggestingGroup, example


@click.group("slurm", cls=SuggestingGroup, epilog=example("ctl slurm submit examples/gpt-tp-dp.yaml --spares 1 --wait"))
def slurm() -> None:
    """Run jobs on Slurm allocations (docs/slurm.md)."""


def allocation_options(f):  # noqa: ANN001, ANN201 - a click decorator: the options every allocation takes
    options = [
        click.option("--partition", default="", help="sbatch --partition."),
        click.option("--time", "time_", default="", help="sbatch --time (the allocation's time limit)."),
        click.option("--account", default="", help="sbatch --account."),
        click.option("--qos", default="", help="sbatch --qos."),
        click.option("--gpus-per-node", type=click.IntRange(min=0), default=0, show_default=True,
                     help="sbatch --gres=gpu:N (0: none)."),
        click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="ARG",
                     help="Passed to sbatch as it is, e.g. --sbatch-arg=--constraint=h100 (repeatable)."),
        click.option("--worker-arg", "worker_args", multiple=True, metavar="ARG",
                     help="Added to each `ctl worker`, e.g. --worker-arg=--data-root=/data (repeatable)."),
        click.option("--worker-state-dir", default="", metavar="TEMPLATE",
                     help="Each worker's state dir; {node} and {jobid} expand (default: under the node's $TMPDIR)."),
        click.option("--worker-tls-dir", default="", metavar="TEMPLATE",
                     help="Each worker's identity directory when the coordinator serves TLS; {node} expands "
                          "(ctl certs issue CA --node NODE --out DIR, one per node)."),
        click.option("--ctl", "ctl_path", default="", metavar="PATH",
                     help="The ctl the workers run (default: the coordinator's own)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _request(spares: int, partition: str, time_: str, account: str, qos: str, gpus_per_node: int,
             sbatch_args: tuple[str, ...], worker_args: tuple[str, ...], worker_state_dir: str, worker_tls_dir: str,
             ctl_path: str):  # noqa: ANN202 - an AllocationRequest (imported late: ctl --help stays light)
    from rankctl.cli.errors import CtlError
    from rankctl.coordinator.model.allocation import AllocationRequest

    request = AllocationRequest(spares=spares, partition=partition, time=time_, account=account, qos=qos,
                                extra_args=tuple(sbatch_args), worker_state_dir=worker_state_dir, ctl=ctl_path,
                                gpus_per_node=gpus_per_node, worker_args=tuple(worker_args),
                                worker_tls_dir=worker_tls_dir)
    problems = request.problems()
    if problems:
        raise CtlError("; ".join(problems))
    return request


@slurm.command("submit", epilog=example("ctl slurm submit examples/gpt-tp-dp.yaml --spares 1 --partition gpu "
                                        "--time 2:00:00 --wait"))
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a job-file field.")
@click.option("--spares", type=click.IntRange(min=0), default=0, show_default=True,
              help="Nodes beyond resources.nodes, READY for this job only (a lost node is replaced by one).")
@allocation_options
@click.option("--wait", is_flag=True, help="Block until the job ends; exit 0 only on SUCCEEDED.")
@click.option("--dry-run", is_flag=True, help="Print the batch script and the sbatch command; submit nothing.")
@pass_ctx
def submit(ctx: Ctx, job_file: str, overrides: tuple[str, ...], spares: int, wait: bool, dry_run: bool,
           **allocation: object) -> None:
    """Submit JOB_FILE on a new Slurm allocation of resources.nodes + --spares nodes; print the job id last."""
    from rankctl.cli.jobread import read_job_file
    from rankctl.cli.workdir import pack_workdir, ship
    from rankctl.coordinator.api.convert import allocation_request_to_pb

    read = read_job_file(job_file, overrides)
    request = _request(spares, **allocation)
    if dry_run:
        _print_dry_run(ctx, read.spec, request)
        return
    packed = pack_workdir(read.spec)
    with ctx.client() as client:
        job = client.submit(read.text, read.sets + ship(client, packed), job_file,
                            allocation=allocation_request_to_pb(request))
    click.echo(job.id)
    sys.stdout.flush()
    if wait:
        exit_for(follow_job(ctx, job.id, live=False))


@slurm.command("workers", epilog=example("ctl slurm workers --nodes 16 --slots 8 --gpus-per-node 8 --time 12:00:00"))
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="How many nodes (one worker each).")
@click.option("--slots", type=click.IntRange(min=1), default=1, show_default=True,
              help="Each worker's slots (its GPUs, or CPU ranks).")
@allocation_options
@click.option("--json", "as_json", is_flag=True, help="The pool as JSON.")
@pass_ctx
def workers(ctx: Ctx, nodes: int, slots: int, as_json: bool, **allocation: object) -> None:
    """Start NODES workers on one Slurm allocation for the general queue (any `ctl submit` job may run there);
    print the pool id last. They end with the allocation's time, or on `ctl slurm release ID` (drained first)."""
    from rankctl.coordinator.api.convert import allocation_request_to_pb

    request = _request(0, **allocation)
    with ctx.client() as client:
        pool = client.start_workers(allocation_request_to_pb(request), nodes, slots)
    _show_pool(pool, as_json)


@slurm.command("release", epilog=example("ctl slurm release workers-3f2a1c"))
@click.argument("pool_id")
@click.option("--reason", default="", help="Why, recorded with the pool.")
@click.option("--json", "as_json", is_flag=True, help="The pool as JSON.")
@pass_ctx
def release(ctx: Ctx, pool_id: str, reason: str, as_json: bool) -> None:
    """Release worker pool POOL_ID: its nodes are drained (jobs checkpoint and move off), then its workers exit and
    its Slurm job ends."""
    with ctx.client() as client:
        pool = client.release_workers(pool_id, reason)
    _show_pool(pool, as_json)


@slurm.command("pools", epilog=example("ctl slurm pools --json"))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON.")
@pass_ctx
def pools(ctx: Ctx, as_json: bool) -> None:
    """The worker pools: the open ones and the newest ended."""
    with ctx.client() as client:
        found = client.worker_pools()
    if as_json:
        click.echo(json.dumps([_pool_dict(p) for p in found], indent=2))
        return
    click.echo(f"{'POOL':<16} {'STATE':<10} {'NODES':>5} {'SLOTS':>5} {'SLURM JOB':<22} REASON")
    for p in found:
        slurm_job = f"{p.allocation.id or '-'} ({p.allocation.state})"
        click.echo(f"{p.id:<16} {p.state:<10} {p.nodes:>5} {p.slots:>5} {slurm_job:<22} {p.reason}")


def _pool_dict(p) -> dict:  # noqa: ANN001 - a pb.WorkerPool
    return {"id": p.id, "state": p.state, "reason": p.reason, "nodes": p.nodes, "slots": p.slots,
            "requested_by": p.requested_by,
            "allocation": {"scheduler": p.allocation.request.scheduler, "id": p.allocation.id,
                           "state": p.allocation.state, "nodes": list(p.allocation.nodes),
                           "output": p.allocation.output}}


def _show_pool(pool, as_json: bool) -> None:  # noqa: ANN001 - a pb.WorkerPool
    if as_json:
        click.echo(json.dumps(_pool_dict(pool), indent=2))
        return
    click.echo(f"worker pool {pool.id}: {pool.state}, {pool.nodes} node(s) x {pool.slots} slot(s); {pool.reason}",
               err=True)
    click.echo(pool.id)


def _print_dry_run(ctx: Ctx, spec, request) -> None:  # noqa: ANN001 - a JobSpec and an AllocationRequest
    from rankctl.coordinator.model.allocation import Allocation, Ask
    from rankctl.coordinator.batch.slurm import batch_script, sbatch_options

    job_id = f"{spec.name}-XXXXXX"
    allocation = Allocation(request=request, pool=f"{job_id}-a1")
    ask = Ask(job_id, spec.name, allocation, spec.resources.nodes + request.spares, spec.resources.slots_per_node,
              ctx.coordinator, tls=ctx.tls_dir is not None)
    output = "<coordinator state dir>/slurm/" + allocation.pool + ".out"
    click.echo(f"# the coordinator at {ctx.coordinator} would store the job (its id: {job_id}, XXXXXX chosen then)"
               " and run:")
    click.echo("sbatch --parsable <<'EOF'")
    click.echo(batch_script(ask, output).rstrip("\n"))
    click.echo("EOF")
    click.echo(f"# the same options on sbatch's command line: sbatch {' '.join(shlex.quote(o) for o in sbatch_options(ask, output))}")
