"""``ctl slurm submit``: a job on its own Slurm allocation, asked for by the coordinator (``coordinator.slurm``).

The coordinator (on or reachable from the login node, with Slurm's client commands) stores the job, asks Slurm
for ``resources.nodes + --spares`` nodes with one ``ctl worker`` each, places the job on them only, and ends
the allocation when the job ends. ``--dry-run`` prints the batch script and the sbatch command and submits nothing.
"""

from __future__ import annotations

import shlex
import sys

import click

from rankctl.cli.context import Ctx, pass_ctx
from rankctl.cli.follow import exit_for, follow_job
from rankctl.cli.options import example


@click.group("slurm", epilog=example("ctl slurm submit examples/gpt-tp-dp.yaml --spares 1 --wait"))
def slurm() -> None:
    """Run jobs on Slurm allocations (docs/slurm.md)."""


@slurm.command("submit", epilog=example("ctl slurm submit examples/gpt-tp-dp.yaml --spares 1 --partition gpu "
                                        "--time 2:00:00 --wait"))
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a job-file field.")
@click.option("--spares", type=click.IntRange(min=0), default=0, show_default=True,
              help="Nodes beyond resources.nodes, READY for this job only (a lost node is replaced by one).")
@click.option("--partition", default="", help="sbatch --partition.")
@click.option("--time", "time_", default="", help="sbatch --time (the allocation's time limit).")
@click.option("--account", default="", help="sbatch --account.")
@click.option("--qos", default="", help="sbatch --qos.")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=0, show_default=True,
              help="sbatch --gres=gpu:N (0: none).")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="ARG",
              help="Passed to sbatch as it is, e.g. --sbatch-arg=--exclusive (repeatable).")
@click.option("--worker-arg", "worker_args", multiple=True, metavar="ARG",
              help="Added to each `ctl worker`, e.g. --worker-arg=--data-root=/data (repeatable).")
@click.option("--worker-state-dir", default="", metavar="TEMPLATE",
              help="Each worker's state dir; {node} and {jobid} expand (default: under the node's $TMPDIR).")
@click.option("--ctl", "ctl_path", default="", metavar="PATH",
              help="The ctl the workers run (default: the coordinator's own).")
@click.option("--wait", is_flag=True, help="Block until the job ends; exit 0 only on SUCCEEDED.")
@click.option("--dry-run", is_flag=True, help="Print the batch script and the sbatch command; submit nothing.")
@pass_ctx
def submit(ctx: Ctx, job_file: str, overrides: tuple[str, ...], spares: int, partition: str, time_: str,
           account: str, qos: str, gpus_per_node: int, sbatch_args: tuple[str, ...], worker_args: tuple[str, ...],
           worker_state_dir: str, ctl_path: str, wait: bool, dry_run: bool) -> None:
    """Submit JOB_FILE on a new Slurm allocation of resources.nodes + --spares nodes; print the job id last."""
    from rankctl.cli.errors import CtlError
    from rankctl.cli.jobread import read_job_file
    from rankctl.cli.workdir import pack_workdir, ship
    from rankctl.coordinator.allocation import AllocationRequest
    from rankctl.coordinator.convert import allocation_request_to_pb

    read = read_job_file(job_file, overrides)
    request = AllocationRequest(spares=spares, partition=partition, time=time_, account=account, qos=qos,
                                extra_args=tuple(sbatch_args), worker_state_dir=worker_state_dir, ctl=ctl_path,
                                gpus_per_node=gpus_per_node, worker_args=tuple(worker_args))
    problems = request.problems()
    if problems:
        raise CtlError("; ".join(problems))
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


def _print_dry_run(ctx: Ctx, spec, request) -> None:  # noqa: ANN001 - a JobSpec and an AllocationRequest
    from rankctl.coordinator.allocation import Allocation, Ask
    from rankctl.coordinator.slurm import batch_script, sbatch_options

    job_id = f"{spec.name}-XXXXXX"
    allocation = Allocation(request=request, pool=f"{job_id}-a1")
    ask = Ask(job_id, spec.name, allocation, spec.resources.nodes + request.spares, spec.resources.slots_per_node,
              ctx.coordinator)
    output = "<coordinator state dir>/slurm/" + allocation.pool + ".out"
    click.echo(f"# the coordinator at {ctx.coordinator} would store the job (its id: {job_id}, XXXXXX chosen then)"
               " and run:")
    click.echo("sbatch --parsable <<'EOF'")
    click.echo(batch_script(ask, output).rstrip("\n"))
    click.echo("EOF")
    click.echo(f"# the same options on sbatch's command line: sbatch {' '.join(shlex.quote(o) for o in sbatch_options(ask, output))}")
