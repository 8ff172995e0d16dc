"""The Slurm adapter of ``coordinator.model.allocation.Allocator``: one batch job per allocation.

The batch script (``batch_script``, printed by ``ctl slurm submit --dry-run``) starts one ``ctl worker`` per node
with ``srun --ntasks-per-node=1``, each named by its Slurm node name and registered with the allocation's pool,
so that it serves that rankctl job only. ``--no-kill`` keeps the allocation when a node is lost (the job restarts
on a spare of the same allocation). When the rankctl job ends the coordinator tells the workers to exit, the
step ends and the Slurm job completes; ``release`` (``scancel``) is the fallback.

Every call runs ``sbatch``, ``squeue``, ``scontrol`` or ``scancel`` as a subprocess with a timeout: the server
calls them on a worker thread, never on the event loop. They read the environment the coordinator runs in
(``SLURM_CONF`` and the like), as any Slurm client on a login node does.
"""

from __future__ import annotations

import functools
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from rankctl.coordinator.model.allocation import Allocation, AllocationRefused, Ask, Seen
from rankctl.security.tls import is_loopback

CALL_TIMEOUT_S = 30.0
DEFAULT_STATE_DIR = "${TMPDIR:-/tmp}/rankctl-worker-{jobid}-{node}"


def ctl_command(request_ctl: str) -> list[str]:
    """The ``ctl`` the workers run: the request's, else the executable beside this interpreter, else
    ``python -m rankctl.cli.main`` of this interpreter (nodes share the login node's software, as Slurm
    clusters do)."""
    if request_ctl:
        return [request_ctl]
    beside = Path(sys.executable).with_name("ctl")
    if beside.exists():
        return [str(beside)]
    return [sys.executable, "-m", "rankctl.cli.main"]


def _expand(template: str) -> str:
    """A state-dir template for the task's shell, double-quoted: ``{node}`` and ``{jobid}`` become Slurm's
    variables, and the node's own environment expands (``$TMPDIR``, ``$HOME``), as in any batch script."""
    escaped = template.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
    return '"' + escaped.replace("{node}", "${SLURMD_NODENAME}").replace("{jobid}", "${SLURM_JOB_ID}") + '"'


def worker_command(ask: Ask) -> str:
    """The shell command each task runs (expanded on its node: its name and state dir are its own)."""
    req = ask.allocation.request
    ctl = " ".join(shlex.quote(c) for c in ctl_command(req.ctl))
    state = _expand(req.worker_state_dir or DEFAULT_STATE_DIR)
    extra = " ".join(shlex.quote(a) for a in req.worker_args)
    if ask.tls:
        security = f" --tls-dir {_expand(req.worker_tls_dir)}"
    else:   # a coordinator that serves plain text off loopback was started --insecure: its workers follow it
        security = "" if is_loopback(ask.coordinator) else " --insecure"
    return (f'mkdir -p {state} && exec {ctl} worker --coordinator {shlex.quote(ask.coordinator)} '
            f'--name "$SLURMD_NODENAME" --slots {ask.slots} --pool {shlex.quote(ask.allocation.pool)} '
            f'--state-dir {state}{security}' + (f" {extra}" if extra else ""))


def sbatch_options(ask: Ask, output: str) -> list[str]:
    """The ``#SBATCH`` options: the rankctl job id as the Slurm job's name, nodes, one task each, whole nodes
    (``--exclusive``: one worker serves all of a node's slots, and two allocations on one node would give two
    workers one node name), no kill."""
    req = ask.allocation.request
    opts = [f"--job-name={ask.job_id}", f"--nodes={ask.nodes}", "--ntasks-per-node=1", "--exclusive", "--no-kill",
            f"--output={output}", "--open-mode=append"]
    for name in ("partition", "time", "account", "qos"):
        if getattr(req, name):
            opts.append(f"--{name}={getattr(req, name)}")
    if req.gpus_per_node:
        opts.append(f"--gres=gpu:{req.gpus_per_node}")
    return opts + list(req.extra_args)


def batch_script(ask: Ask, output: str) -> str:
    """The batch script, for people as much as for sbatch."""
    if ask.general:
        about = [f"# rankctl worker pool {ask.job_id}: one `ctl worker` per node, {ask.nodes} nodes, joining the",
                 "# coordinator's general queue (any `ctl submit` job may run there). `ctl slurm release` drains them",
                 "# and tells them to exit, which ends this Slurm job; so does its time limit. --no-kill: a lost",
                 "# node does not end the others."]
    else:
        about = [f"# rankctl job {ask.job_id} ({ask.job_name}), allocation {ask.allocation.pool}: one `ctl worker` "
                 f"per node,", f"# {ask.nodes} nodes ({ask.allocation.request.spares} of them spares). The workers "
                 "serve this job only and exit",
                 "# when it ends (the coordinator tells them), which ends this Slurm job. --no-kill: a lost node does",
                 "# not end the allocation; the job restarts on a spare."]
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in sbatch_options(ask, output)), "", *about,
             "set -u",
             "exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 --no-kill bash -c "
             + shlex.quote(worker_command(ask)), ""]
    return "\n".join(lines)


def default_output(state_dir: Path, pool: str) -> str:
    return str(state_dir / "slurm" / f"{pool}.out")


def _run(args: list[str], script: str | None = None) -> subprocess.CompletedProcess:
    """A Slurm client command (``script`` on its stdin, else none), in the coordinator's environment."""
    return subprocess.run(args, input=script, capture_output=True, text=True, timeout=CALL_TIMEOUT_S,
                          **({} if script is not None else {"stdin": subprocess.DEVNULL}))


class SlurmAllocator:
    """``Allocator`` over the Slurm client commands on this host (the login node)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)

    @staticmethod
    def available() -> bool:
        return shutil.which("sbatch") is not None

    def request(self, ask: Ask) -> tuple[str, str]:
        output = ask.allocation.output or default_output(self.state_dir, ask.allocation.pool)
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        script = batch_script(ask, output)
        try:
            done = _run(["sbatch", "--parsable"], script)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AllocationRefused(f"sbatch could not run: {exc}") from None
        if done.returncode != 0:
            words = done.stderr.strip()[-500:]
            if unreachable(words):   # a controller restarting or busy: asked again, not a refusal (OSError)
                raise OSError(f"sbatch could not reach the Slurm controller: {words}")
            raise AllocationRefused(f"sbatch exited {done.returncode}: {words}")
        return done.stdout.strip().split(";")[0], output

    def state(self, allocation: Allocation) -> Seen:
        """``scontrol show job`` (it knows ended jobs for ``MinJobAge``); a job it no longer knows is GONE."""
        done = _run(["scontrol", "show", "job", "-o", allocation.id])
        if done.returncode != 0:
            text = (done.stderr or done.stdout).strip()
            if "Invalid job id" in text:
                return Seen("GONE", detail="Slurm no longer knows the job")
            raise OSError(f"scontrol show job {allocation.id}: {text[-300:]}")
        fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)
        nodes = fields.get("NodeList", "")
        names = _hostnames(nodes) if nodes and nodes != "(null)" else ()
        return Seen(fields.get("JobState", "UNKNOWN"), names, fields.get("Reason", ""))

    def release(self, allocation: Allocation) -> None:
        if allocation.id:
            _run(["scancel", allocation.id])


# sbatch's words when the controller could not be reached or could not take a job now (slurmctld restarting, failing
# over, overloaded): the request is made again; a job failed on them for good (an outside probe stopped slurmctld)
UNREACHABLE = ("unable to contact slurm controller", "socket timed out", "temporarily unable to accept job",
               "connection refused", "transport endpoint is not connected", "zero bytes were transmitted")


def unreachable(words: str) -> bool:
    """Whether sbatch's error says the controller was not reached (or was busy), not that it refused the job."""
    low = words.lower()
    return any(w in low for w in UNREACHABLE)


@functools.lru_cache(maxsize=256)   # a watch asks every 5 s; an allocation's node list does not change
def _hostnames(nodelist: str) -> tuple[str, ...]:
    done = _run(["scontrol", "show", "hostnames", nodelist])
    if done.returncode != 0:   # not cached: the watch fails and is tried again
        raise OSError(f"scontrol show hostnames {nodelist}: {(done.stderr or done.stdout).strip()[-300:]}")
    return tuple(done.stdout.split())
