"""``ctl run``: torchrun's command line, run as a rankctl job (``cli/runjob.py`` writes the job file).

Submits to the configured coordinator (``--coordinator``, ``RANKCTL_COORDINATOR`` or a context), else starts the
embedded one here as ``ctl up`` does (``--standalone`` always does). What every rank prints comes on stdout as
torchrun's ``--tee`` shows it (``[rank3]: ...``); rankctl's own lines go to stderr. The exit code is the job's:
0, the failing rank's own code (128+N for signal N), 1 for a failure without one (a hang, a lost node); Ctrl-C
(or SIGTERM) cancels the job and exits 130 (143).
"""

from __future__ import annotations

import shlex
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import click

from rankctl.cli.context import Ctx, pass_ctx
from rankctl.cli.main import quiet_stdout
from rankctl.cli.errors import CtlError
from rankctl.cli.options import example
from rankctl.cli.runjob import IGNORED, IGNORED_FLAGS, SHORT, RunArgs, job_document, job_yaml, layout_line, \
    local_ranks, node_range, procs_per_node

OUTPUT_GRACE_S = 10.0   # how long the end waits for the ranks' last lines


def _both(name: str) -> tuple[str, ...]:
    """torchrun takes each flag with dashes and with underscores."""
    names = [name, "--" + name[2:].replace("-", "_")]
    return tuple(dict.fromkeys(([SHORT[name]] if name in SHORT else []) + names))


def _torchrun_options(command):  # noqa: ANN001, ANN202 - a click decorator
    for name in reversed(IGNORED):
        command = click.option(*_both(name), name.lstrip("-").replace("-", "_"), default=None, hidden=True,
                               expose_value=False, callback=_noted)(command)
    for name in IGNORED_FLAGS:
        command = click.option(*_both(name), name.lstrip("-").replace("-", "_"), is_flag=True, hidden=True,
                               expose_value=False, callback=_noted)(command)
    return command


def _noted(ctx: click.Context, param: click.Parameter, value: object) -> None:
    if value not in (None, False):
        ctx.meta.setdefault("rankctl.ignored", []).append(max(param.opts, key=len))


@click.command("run", epilog=example("ctl run --nnodes 2 --nproc-per-node 4 train.py --lr 3e-4"),
               context_settings={"allow_interspersed_args": False})
@click.option(*_both("--nnodes"), "nnodes", default="1", show_default=True, metavar="N|MIN:MAX",
              help="Nodes (MIN:MAX: elastic, resources.min_nodes).")
@click.option(*_both("--nproc-per-node"), "nproc", default="1", show_default=True, metavar="N|auto|gpu|cpu",
              help="Ranks per node (auto/gpu/cpu: counted on this machine).")
@click.option(*_both("--max-restarts"), "max_restarts", type=click.IntRange(0, None), default=0, show_default=True,
              help="Restarts after a failure (restart.max_restarts).")
@click.option(*_both("--rdzv-id"), "rdzv_id", default="", help="The job's name (default: the script's).")
@click.option(*_both("--rdzv-backend"), "rdzv_backend", default="",
              help="'rankctl' with --rdzv-endpoint: that coordinator; others are accepted and left to rankctl.")
@click.option(*_both("--rdzv-endpoint"), "rdzv_endpoint", default="", metavar="HOST:PORT",
              help="With --rdzv-backend rankctl: the coordinator to submit to.")
@click.option("--standalone", is_flag=True, help="Run on this machine: an embedded coordinator and daemons.")
@click.option("-m", "--module", is_flag=True, help="Run the target as a module (python -m).")
@click.option(*_both("--no-python"), "no_python", is_flag=True, help="Refused: every rank runs Python.")
@click.option(*_both("--run-path"), "run_path", is_flag=True, help="Accepted: scripts run as runpy.run_path.")
@click.option(*_both("--local-ranks-filter"), "ranks_filter", default="", metavar="0,1,..",
              help="Show the output of these local ranks only.")
@_torchrun_options
@click.option("--workdir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=".",
              show_default=True, help="Shipped to every node (python.workdir); the script must lie inside it.")
@click.option("-e", "--env", "env", multiple=True, metavar="NAME[=VALUE]",
              help="Set this in every rank's environment (python.env); NAME alone: its value here.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a job-file field.")
@click.option("--dry-run", is_flag=True, help="Print the job file it would submit, and stop.")
@click.option("--tp", type=click.IntRange(1, None), default=None, help="Tensor parallel size (parallel.tp).")
@click.option("--pp", type=click.IntRange(1, None), default=None, help="Pipeline parallel size (parallel.pp).")
@click.option("--cp", type=click.IntRange(1, None), default=None, help="Context parallel size (parallel.cp).")
@click.option("--ep", type=click.IntRange(1, None), default=None, help="Expert parallel size (parallel.ep).")
@click.option("--etp", type=click.IntRange(1, None), default=None,
              help="Expert tensor parallel size (parallel.etp; default: tp).")
@click.option("--queue-anyway", is_flag=True,
              help="Queue the job even if the coordinator's nodes cannot hold it now (it waits for more).")
@click.option("--verbose", is_flag=True, help="An embedded cluster's log records on stderr (default: a log file, "
              "named when the run fails).")
@click.argument("target", metavar="SCRIPT|MODULE")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@pass_ctx
@click.pass_context
def run(click_ctx: click.Context, ctx: Ctx, nnodes: str, nproc: str, max_restarts: int, rdzv_id: str,
        rdzv_backend: str, rdzv_endpoint: str, standalone: bool, module: bool, no_python: bool, run_path: bool,
        ranks_filter: str, workdir: Path, env: tuple[str, ...], overrides: tuple[str, ...], dry_run: bool,
        tp: int | None, pp: int | None, cp: int | None, ep: int | None, etp: int | None, queue_anyway: bool,
        verbose: bool, target: str, script_args: tuple[str, ...]) -> None:
    """Run SCRIPT (or -m MODULE) with its arguments in every rank, as torchrun would: torchrun's flags, every
    rank's output on stdout after [rankN]:, the job's exit code. Without a configured coordinator, one starts
    here with --nnodes worker daemons (as ctl up does)."""
    args = RunArgs(nnodes=nnodes, nproc_per_node=nproc, max_restarts=max_restarts, rdzv_id=rdzv_id, module=module,
                   no_python=no_python, target=target, args=script_args, workdir=workdir.resolve(),
                   local_ranks_filter=ranks_filter, env=env,
                   parallel=tuple((k, v) for k, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp))
                                  if v is not None))
    slots, how = procs_per_node(nproc)
    layout = [f"--{k}={v}" for k, v in args.parallel]
    line = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", *layout] + (["-m"] if module else []) + \
        [target, *script_args]
    text = job_yaml(job_document(args, slots), shlex.join(line))
    if dry_run:
        click.echo(text, nl=False)
        return
    shown_ranks = local_ranks(ranks_filter)
    job = _Job(text, overrides, queue_anyway)   # refused here, before a cluster starts or anything is sent
    ignored = list(click_ctx.meta.get("rankctl.ignored", []))
    if rdzv_backend and rdzv_backend != "rankctl":
        ignored += [f"--rdzv-backend {rdzv_backend}"] + (["--rdzv-endpoint"] if rdzv_endpoint else [])
    layout_note = f"layout {layout_line(job.read.spec)} (set with --tp/--pp/--cp/--ep/--etp)"
    for note in [how, layout_note] + [f"{opt}: rankctl's coordinator does this; ignored" for opt in ignored]:
        if note:
            click.echo(f"ctl run: {note}", err=True)
    if rdzv_backend == "rankctl":
        if not rdzv_endpoint:
            raise CtlError("--rdzv-backend rankctl needs --rdzv-endpoint HOST:PORT (the coordinator)")
        ctx = Ctx(coordinator=rdzv_endpoint, tls_dir=ctx.given_tls_dir)
    if standalone or not ctx.configured:
        code = _run_here(job, node_range(nnodes)[1], slots, shown_ranks, verbose)
    else:
        code = _run_on(ctx, job, slots, shown_ranks)
    sys.exit(code)


def _run_here(job: "_Job", nodes: int, slots: int, shown: frozenset[int] | None, verbose: bool) -> int:
    from rankctl.cli.local import LocalCluster, component_logs, kept_log

    root = Path(tempfile.mkdtemp(prefix="rankctl-run-"))
    click.echo(f"ctl run: starting a coordinator and {nodes} worker daemon(s) x {slots} slot(s) here", err=True)
    log = component_logs(root, verbose)
    code = 1
    try:
        with LocalCluster(nodes, slots, root, log=log) as cluster:
            code = _run_on(Ctx(coordinator=cluster.address), job, slots, shown)
            return code
    finally:
        if log is not None:
            log.close()
            kept = kept_log(root, "rankctl-run-", temporary=True) if code != 0 else None
            if kept is not None:   # the components' log of a failed run is kept and named
                click.echo(f"ctl run: the coordinator's and daemons' log: {kept}", err=True)
        shutil.rmtree(root, ignore_errors=True)


class _Job:
    """The job file, checked and its workdir packed before anything starts (a refusal creates nothing)."""

    def __init__(self, text: str, overrides: tuple[str, ...], queue_anyway: bool = False) -> None:
        from rankctl.cli.jobread import read_job_doc
        from rankctl.cli.workdir import pack_workdir

        self.queue_anyway = queue_anyway
        self.read = read_job_doc(text, "ctl run", Path.cwd(), overrides)
        self.packed = pack_workdir(self.read.spec)


def _run_on(ctx: Ctx, prepared: _Job, slots: int, shown: frozenset[int] | None) -> int:
    """Submit, show every rank's output, wait for the end; the exit code."""
    from rankctl.cli.view.follow import follow_job
    from rankctl.cli.workdir import ship

    read = prepared.read
    with ctx.client() as client:
        job = client.submit(read.text, read.sets + ship(client, prepared.packed), "ctl run",
                            queue_anyway=prepared.queue_anyway)
    click.echo(f"ctl run: job {job.id} ({job.world_size} ranks) on {ctx.coordinator}", err=True)
    output = _Output(ctx, job.id, slots, shown)
    try:
        with _interruptible():
            output.start()
            final = follow_job(ctx, job.id, live=False)
    except _Interrupted as stop:
        output.ended = True   # what it says as the cluster goes is no news
        with ctx.client() as client:
            client.cancel(job.id, f"interrupted: {stop.name} to ctl run")
        click.echo(f"ctl run: job {job.id} cancelled ({stop.name})", err=True)
        return 128 + stop.signum
    output.join(OUTPUT_GRACE_S)
    output.ended = True
    return job_exit_code(final)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


@contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C (SIGINT) and SIGTERM end the wait: the job is cancelled, as torchrun stops its workers on them. Set
    explicitly: a shell starts a background job with SIGINT ignored, and a batch system stops with SIGTERM."""
    def stop(signum: int, frame: object) -> None:
        raise _Interrupted(signum)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def job_exit_code(job) -> int:  # noqa: ANN001 - pb.Job
    """0 for a job that succeeded; else its last attempt's failing rank's code (128+N for signal N), or 1."""
    from rankctl.cli.view.render import state_name

    state = state_name(job.state)
    if state == "SUCCEEDED":
        return 0
    click.echo(f"ctl run: job {job.id} {state}: {job.reason}", err=True)
    failure = job.attempts[-1].failure if job.attempts and job.attempts[-1].HasField("failure") else None
    code = failure.exit_code if failure is not None and failure.HasField("exit_code") else 0
    if 0 < code < 256:
        return code
    if code < 0:   # killed by signal -code: as a shell reports it
        return 128 + (-code) % 128
    return 1


class _Output:
    """Every rank's lines (``ctl logs -f``) on stdout as torchrun's --tee shows them; a new attempt is noted on
    stderr."""

    def __init__(self, ctx: Ctx, job_id: str, slots: int, shown: frozenset[int] | None) -> None:
        self._ctx, self._job_id, self._slots, self._shown = ctx, job_id, slots, shown
        self._thread = threading.Thread(target=self._follow, name="rank-output", daemon=True)
        self.ended = False   # the run is over: a broken stream is not reported

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _follow(self) -> None:
        attempt = 0
        try:
            with self._ctx.client() as client:
                for line in client.logs(self._job_id, None, True, 0, from_attempt=1):
                    if line.attempt != attempt:
                        if attempt:
                            click.echo(f"ctl run: attempt {line.attempt} started (a restart)", err=True)
                        attempt = line.attempt
                    if self._shown is None or line.rank % self._slots in self._shown:
                        click.echo(f"[rank{line.rank}]: {line.line}")
        except CtlError as exc:   # the job goes on; its end and exit code come from its status
            if not self.ended:
                click.echo(f"ctl run: the ranks' output is not shown: {exc.message}", err=True)
        except BrokenPipeError:   # stdout's reader left (`| head`): the job goes on, and so does the wait for it
            quiet_stdout()
