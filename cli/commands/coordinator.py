"""``ctl coordinator``: run the coordinator service; ``ctl coordinator migrate``: move a state dir onto etcd."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import click

from rankctl.cli.commands.daemons import log_level, plain_text_problem, with_tls
from rankctl.cli.errors import CtlError
from rankctl.cli.options import SuggestingGroup, example, log_format

store_options = [
    click.option("--store", "store_url", default=None, metavar="etcd://HOST:PORT[,HOST:PORT...][/prefix]",
                 help="Keep the state on etcd, not in --state-dir: several coordinators on one store elect a "
                      "leader; the others stand by (docs/operations.md)."),
    click.option("--etcd-ca", default=None, type=click.Path(dir_okay=False, exists=True, path_type=Path),
                 help="CA of the etcd members' certificates: TLS to etcd."),
    click.option("--etcd-cert", default=None, type=click.Path(dir_okay=False, exists=True, path_type=Path),
                 help="This coordinator's client certificate for etcd (with --etcd-key)."),
    click.option("--etcd-key", default=None, type=click.Path(dir_okay=False, exists=True, path_type=Path),
                 help="The key of --etcd-cert."),
]


def with_store(f):  # noqa: ANN001, ANN201 - a click decorator
    for option in reversed(store_options):
        f = option(f)
    return f


def etcd_target(store_url: str | None, ca: Path | None, cert: Path | None, key: Path | None):  # noqa: ANN201
    """The parsed --store and the TLS to reach it; CtlError naming the option otherwise."""
    from rankctl.coordinator.ha.etcd import EtcdTLS, StoreURL, StoreURLError

    if store_url is None:
        if ca or cert or key:
            raise CtlError("--etcd-ca/--etcd-cert/--etcd-key need --store etcd://...")
        return None, None
    try:
        url = StoreURL.parse(store_url)
    except StoreURLError as exc:
        raise CtlError(str(exc)) from None
    if bool(cert) != bool(key):
        raise CtlError("--etcd-cert and --etcd-key go together")
    if (cert or key) and not ca:
        raise CtlError("--etcd-cert needs --etcd-ca (the CA of the etcd members)")
    return url, (EtcdTLS(ca, cert, key) if ca else None)


async def _serve(listen: str, state_dir: Path, tls_dir: str | None, **options: object) -> None:
    """Serve until SIGTERM/SIGINT; ``options``: start_coordinator's keyword arguments."""
    import structlog

    from rankctl.coordinator.app.server import start_coordinator

    server = await start_coordinator(listen, state_dir, tls_dir=tls_dir, **options)
    (state_dir / "address").write_text(server.address + "\n")  # the bound address, for scripts and tests
    structlog.get_logger("rankctl.coordinator").info(
        "coordinator listening", address=server.address, state_dir=str(state_dir),
        role="leader" if server.leading else "standby")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


@click.group("coordinator", cls=SuggestingGroup, invoke_without_command=True, epilog=example(
    "ctl coordinator --listen 0.0.0.0:7420 --state-dir /var/lib/rankctl --tls-dir /etc/rankctl/coordinator \\",
    "    --http-listen 0.0.0.0:9420 --log-format json",
    "ctl coordinator --listen 0.0.0.0:7420 --state-dir /var/lib/rankctl \\",
    "    --store etcd://etcd1:2379,etcd2:2379,etcd3:2379/rankctl --tls-dir /etc/rankctl/coordinator"))
@click.option("--listen", default="127.0.0.1:7420", show_default=True, metavar="HOST:PORT",
              help="Address to serve on (port 0 picks a free port and logs it).")
@click.option("--state-dir", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the durable store (SQLite, WAL); with --store, this coordinator's local files "
                   "(blob copies, Slurm scripts). Required.")
@click.option("--advertise-address", default=None, metavar="HOST",
              help="The host workers the coordinator starts (ctl slurm) dial it on (default: the --listen host, or "
                   "this host's name when that is 0.0.0.0 or [::]).")
@click.option("--heartbeat-timeout", default=10.0, show_default=True, type=float,
              help="Seconds without a heartbeat before a node is lost.")
@click.option("--max-heartbeat-rate", default=1000.0, show_default=True, type=click.FloatRange(min=1),
              help="Heartbeats a second from all nodes together at most: a bigger fleet is asked to beat less often "
                   "(a stopped or cut-off node is still lost within --heartbeat-timeout: HTTP/2 keepalive).")
@click.option("--head-wait", default=60.0, show_default=True, type=float,
              help="Seconds the first job that cannot start holds back later jobs that could (then they backfill).")
@click.option("--http-listen", default=None, metavar="HOST:PORT",
              help="Serve the dashboard and Prometheus /metrics over HTTP here (default or \"\": off).")
@click.option("--metrics-per-rank", is_flag=True,
              help="Add per-rank series to /metrics (one per rank of every active job: large clusters beware).")
@click.option("--blob-quota-mb", default=10240, show_default=True, type=click.IntRange(min=1),
              help="MiB of uploaded workdirs each submitter may store (an upload past it is refused, naming the use).")
@click.option("--blob-retention-hours", default=168.0, show_default=True, type=click.FloatRange(min=0),
              help="Keep a workdir blob this long after the last job using it finished or it was last uploaded.")
@click.option("--relay-width", default=64, show_default=True, type=click.IntRange(min=0, max=1024),
              help="An Assign fan-out to more nodes than this goes through relay heads, each forwarding to this "
                   "many nodes (0: always direct).")
@click.option("--event-retention-days", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Keep the events of a finished job this long (then only its last one; the job itself stays).")
@with_store
@click.option("--lease-ttl", default=3, show_default=True, type=click.IntRange(min=2, max=5),
              help="Seconds of the leader's lease on --store: a leader that stops is replaced within them.")
@with_tls
@log_level
@log_format
@click.pass_context
def coordinator(ctx: click.Context, listen: str, state_dir: Path | None, advertise_address: str | None,
                heartbeat_timeout: float, max_heartbeat_rate: float, head_wait: float, http_listen: str | None,
                metrics_per_rank: bool,
                blob_quota_mb: int, blob_retention_hours: float, event_retention_days: float, relay_width: int,
                store_url: str | None, etcd_ca: Path | None,
                etcd_cert: Path | None, etcd_key: Path | None, lease_ttl: int, tls_dir: str | None, insecure: bool,
                log_level: str, log_format: str) -> None:
    """Run the coordinator service (gRPC) until SIGTERM/SIGINT."""
    if ctx.invoked_subcommand is not None:
        return
    from rankctl.coordinator.store.schema import StoreUnusable
    from rankctl.coordinator.store.database import StateDirInUse
    from rankctl.security.certs import CertError
    from rankctl.worker.launcher.procutil import configure_logging

    if state_dir is None:
        raise CtlError("Missing option '--state-dir'.")
    configure_logging(level=log_level, fmt=log_format)
    http_listen = http_listen or None  # "" is off, as for ctl worker --metrics-listen (a systemd unit's empty default)
    problem = plain_text_problem({"--listen": listen, **({"--http-listen": http_listen} if http_listen else {})},
                                 tls_dir, insecure)
    if problem:
        raise CtlError(problem)
    if heartbeat_timeout <= 0:
        raise CtlError(f"--heartbeat-timeout={heartbeat_timeout} must be positive")
    if not 0 <= head_wait < float("inf"):
        raise CtlError(f"--head-wait={head_wait} must be a finite number of seconds, 0 or more")
    url, etcd_tls = etcd_target(store_url, etcd_ca, etcd_cert, etcd_key)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CtlError(f"--state-dir {state_dir}: {exc.strerror}") from None
    from rankctl.coordinator.app.server import tune_gc

    tune_gc()
    try:
        asyncio.run(_serve(listen, state_dir, tls_dir, advertise=advertise_address,
                           heartbeat_timeout=heartbeat_timeout, max_heartbeat_rate=max_heartbeat_rate,
                           head_wait=head_wait, http_listen=http_listen,
                           metrics_per_rank=metrics_per_rank, blob_quota_bytes=blob_quota_mb << 20,
                           blob_retention_s=blob_retention_hours * 3600, store_url=str(url) if url else None,
                           etcd_tls=etcd_tls, lease_ttl=lease_ttl, event_retention_s=event_retention_days * 86400,
                           relay_width=relay_width))
    except (StateDirInUse, StoreUnusable, CertError) as exc:
        raise CtlError(str(exc)) from None
    except OSError as exc:
        raise CtlError(f"coordinator: {exc}") from None  # names the address: "cannot listen on X: ..." (gRPC or dashboard)


@coordinator.command("migrate", epilog=example(
    "ctl coordinator migrate --from /var/lib/rankctl --store etcd://etcd1:2379,etcd2:2379,etcd3:2379/rankctl"))
@click.option("--from", "from_dir", required=True, type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="The state dir of a stopped coordinator (its SQLite database and blobs).")
@with_store
def migrate(from_dir: Path, store_url: str | None, etcd_ca: Path | None, etcd_cert: Path | None,
            etcd_key: Path | None) -> None:
    """Copy a SQLite state dir (jobs, events, nodes, drains, pools, blobs) onto an empty etcd prefix."""
    from rankctl.coordinator.store.migrate import MigrationError, migrate_state_dir
    from rankctl.coordinator.store.schema import StoreUnusable
    from rankctl.coordinator.store.database import StateDirInUse

    from rankctl.worker.launcher.procutil import configure_logging

    configure_logging(level="warning", fmt="console")  # the figures line is the output
    if store_url is None:
        raise CtlError("Missing option '--store' (etcd://HOST:PORT[,HOST:PORT...][/prefix]).")
    url, etcd_tls = etcd_target(store_url, etcd_ca, etcd_cert, etcd_key)
    try:
        figures = migrate_state_dir(from_dir, url, etcd_tls)
    except (MigrationError, StateDirInUse, StoreUnusable) as exc:
        raise CtlError(str(exc)) from None
    click.echo(f"migrated {from_dir} to {url}: " + ", ".join(f"{v} {k}" for k, v in figures.items()))
