"""Long-running services: ``ctl coordinator`` and ``ctl worker``."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import click

from rankctl.cli.context import Ctx, pass_ctx
from rankctl.cli.errors import EXIT_JOB_FAILED, EXIT_USAGE, CtlError
from rankctl.cli.options import example, log_format

log_level = click.option("--log-level", default="info", show_default=True,
                         type=click.Choice(["debug", "info", "warning", "error"]))
tls_options = [
    click.option("--tls-dir", default=None, metavar="DIR",
                 help="This service's identity directory (ctl certs init / issue): serve and connect with mutual TLS."),
    click.option("--insecure", is_flag=True,
                 help="Allow plain text on a non-loopback address (only on a trusted private network)."),
]


def with_tls(f):  # noqa: ANN001, ANN201 - a click decorator
    for option in reversed(tls_options):
        f = option(f)
    return f


def require_torch(command: str) -> None:
    """A node that runs ranks needs torch; the client and the coordinator do not (``pip install rankctl``).
    Looked up, not imported: ``ctl worker`` imports it only in its launcher."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise CtlError(f"{command} runs ranks and needs torch, which is not installed here: "
                       "pip install 'rankctl[worker]' on worker nodes (the client and the coordinator need no torch)")


def is_loopback_address(address: str) -> bool:
    from rankctl.security.tls import is_loopback

    return is_loopback(address.strip())


def plain_text_problem(addresses: dict[str, str], tls_dir: str | None, insecure: bool) -> str | None:
    """Why this service may not run without TLS: one of its ``addresses`` (option -> HOST:PORT) is not
    loopback and neither --tls-dir nor --insecure was given."""
    from rankctl.security.tls import is_loopback

    if tls_dir or insecure:
        return None
    for option, address in addresses.items():
        if not is_loopback(address):
            return (f"{option} {address} is not a loopback address: without TLS anyone who reaches it could act as "
                    f"any party. Pass --tls-dir DIR (ctl certs init / ctl certs issue), or --insecure on a trusted "
                    f"private network")
    return None


def node_name(name: str | None) -> str:
    """``--name``, or the lower-cased hostname; either must follow the node-name rule."""
    from rankctl.contract.names import node_name_problem

    if name is not None:
        problem = node_name_problem(name, "--name")
    else:
        name = socket.gethostname().lower()
        problem = node_name_problem(name, "the hostname")
        problem = problem and f"{problem}; pass --name"
    if problem:
        raise CtlError(problem)
    return name


def _check_node_identity(tls_dir: str, node: str) -> None:
    """``--tls-dir`` must hold this node's own node certificate."""
    from rankctl.security.certs import CertError
    from rankctl.security.tls import load_identity_dir

    try:
        identity = load_identity_dir(tls_dir).identity
    except CertError as exc:
        raise CtlError(f"--tls-dir {tls_dir}: {exc}") from None
    if identity.kind != "node" or identity.name != node:
        raise CtlError(f"--tls-dir {tls_dir} holds the certificate of {identity}; node {node} needs a node "
                       f"certificate for {node!r} (ctl certs issue CA_DIR --node {node} --out DIR)")


@click.command("worker", epilog=example(
    "ctl worker --coordinator head:7420 --state-dir /var/lib/rankctl-worker --advertise-address 10.0.0.5 \\",
    "    --tls-dir /etc/rankctl/node --metrics-listen 10.0.0.5:9421"))
@click.option("--coordinator", "coordinator_address", default=None, metavar="HOST:PORT[,HOST:PORT...]",
              help="Coordinator address, or the addresses of a replicated store's coordinators (the daemon follows "
                   "the leader) (default: ctl --coordinator / RANKCTL_COORDINATOR).")
@click.option("--slots", type=int, default=None, help="Rank slots (default: GPUs on this node, or 1).")
@click.option("--name", default=None, help="Node name (default: the lower-cased hostname).")
@click.option("--advertise-address", default=None, help="Address other nodes reach this node on.")
@click.option("--state-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for rank logs and status files.")
@click.option("--health-listen", default="127.0.0.1:0", show_default=True, help="gRPC health service address.")
@click.option("--metrics-listen", default=None, metavar="HOST:PORT",
              help="Serve this node's Prometheus /metrics over HTTP here (default: off).")
@click.option("--workdir-cache-mb", default=20480, show_default=True, type=click.IntRange(min=1),
              help="MiB of extracted workdirs this node keeps (least recently used removed; a running job's never).")
@click.option("--snapshot-memory-mb", default=None, type=click.IntRange(min=0),
              help="MiB of the node's memory that rankctl's in-memory snapshots may take, the ranks' own and copies "
                   "kept for peers (a tmpfs of that size where the daemon may mount; else peers' copies are "
                   "refused past it). Default: a quarter of the node's memory; 0: no bound of rankctl's own.")
@click.option("--data-root", "data_roots", multiple=True, metavar="DIR",
              help="A directory under which jobs may name data and other paths on this node (repeatable; "
                   "default: only builtin data and the state dir).")
@click.option("--no-idle-warm", "no_idle_warm", is_flag=True,
              help="Do not warm every job kind in the launcher's first idle second (the warm-up makes a spare's "
                   "first ranks start ~2 s sooner and costs ~2.5 s of CPU once).")
@click.option("--pool", default="", metavar="NAME",
              help="Serve only the job of this allocation, and exit when it ends (ctl slurm's batch script sets "
                   "it; default: the general pool).")
@with_tls
@log_level
@log_format
@pass_ctx
def worker(ctx: Ctx, coordinator_address: str | None, slots: int | None, name: str | None,
           advertise_address: str | None, state_dir: Path, health_listen: str, metrics_listen: str | None,
           workdir_cache_mb: int, snapshot_memory_mb: int | None, data_roots: tuple[str, ...], no_idle_warm: bool,
           pool: str, tls_dir: str | None, insecure: bool, log_level: str, log_format: str) -> None:
    """Run the worker daemon for this node until SIGTERM/SIGINT."""
    from rankctl.worker.launcher.procutil import configure_logging
    from rankctl.worker.daemon.daemon import DaemonConfig, LauncherLost, NodeNameTaken
    from rankctl.worker.daemon.serve import run_worker

    configure_logging(level=log_level, fmt=log_format)
    require_torch("ctl worker")
    if slots is not None and slots < 1:
        raise CtlError(f"--slots={slots} must be at least 1")
    node = node_name(name)
    if pool:
        from rankctl.contract.names import node_name_problem

        if (problem := node_name_problem(pool, "--pool")) is not None:
            raise CtlError(problem)
    from rankctl.worker.files.sandbox import allowed_roots

    try:
        allowed_roots(data_roots, str(state_dir))
    except ValueError as exc:
        raise CtlError(f"--data-root: {exc}") from None
    tls_dir = tls_dir or ctx.given_tls_dir  # never a config context's user certificate
    address = coordinator_address or ctx.coordinator
    addresses = {**{"--coordinator": a for a in address.split(",") if a.strip() and not is_loopback_address(a)},
                 "--advertise-address": f"{advertise_address or '127.0.0.1'}:0",
                 "--health-listen": health_listen, **({"--metrics-listen": metrics_listen} if metrics_listen else {})}
    problem = plain_text_problem(addresses, tls_dir, insecure)
    if problem:
        raise CtlError(problem)
    if tls_dir:
        _check_node_identity(tls_dir, node)
    if metrics_listen:
        from rankctl.security.tls import split_listen

        try:
            split_listen(metrics_listen)
        except ValueError as exc:
            raise CtlError(f"--metrics-listen: {exc}") from None
    state_dir.mkdir(parents=True, exist_ok=True)
    cfg = DaemonConfig(
        coordinator=address,
        name=node,
        slots=slots or 0,
        state_dir=state_dir.resolve(),
        advertise_address=advertise_address or "127.0.0.1",
        health_listen=health_listen,
        tls_dir=str(tls_dir) if tls_dir else None,
        data_roots=tuple(data_roots),
        metrics_listen=metrics_listen or "",
        workdir_cache_mb=workdir_cache_mb,
        snapshot_memory_mb=snapshot_memory_mb,
        pool=pool,
        idle_warm=not no_idle_warm,
    )
    try:
        asyncio.run(run_worker(cfg))
    except LauncherLost as exc:  # exit non-zero so that a supervisor restarts the daemon
        raise CtlError(str(exc), code=EXIT_JOB_FAILED) from None
    except NodeNameTaken as exc:  # a usage error: another daemon holds this name
        raise CtlError(str(exc), code=EXIT_USAGE) from None
    except OSError as exc:
        raise CtlError(f"worker cannot serve: {exc}") from None
