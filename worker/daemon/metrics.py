"""Prometheus metrics of one worker daemon (``ctl worker --metrics-listen HOST:PORT``; off by default).

``WorkerMetrics`` is a registry of its own per daemon (tests run several daemons in one process) whose
collector asks the daemon for its ``DaemonFigures`` when scraped, on the daemon's event loop (aiohttp,
``serve_metrics``; HTTPS with a client certificate of the cluster's CA given the node's identity). Every
series carries ``node``. Series: docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rankctl.contract.files.rankstatus import PHASES

if TYPE_CHECKING:
    from aiohttp import web

    from rankctl.security.tls import IdentityDir

STARTING = "starting"   # a launched rank that has not written a phase yet
OTHER = "other"         # a phase outside the contract's (a rank writes its own): one label value for all
RANK_PHASES = (STARTING, *PHASES, OTHER)


@dataclass
class DaemonStats:
    """What the daemon counts for its metrics (since the process started)."""

    registrations: int = 0       # sessions the coordinator acknowledged
    connect_failures: int = 0    # sessions that could not start or broke
    reports_sent: int = 0        # rank reports written to the stream (replays count again)
    log_lines_shipped: int = 0   # rank log lines sent to the coordinator (FetchLogs answers)
    launcher_restarts: int = 0   # replacement launchers started


@dataclass(frozen=True, kw_only=True)
class DaemonFigures:
    """One daemon's state at a scrape."""

    node: str
    slots: int
    stats: DaemonStats
    online: bool                 # a session with the coordinator is registered
    launcher_alive: bool
    refused: int                 # Assign messages refused
    buffered: int                # reports kept until the coordinator has stored them
    dropped: int                 # reports dropped because the buffer was full
    live_phases: Counter[str | None]  # live ranks by the phase of their last report (None: none yet)


class Observed(Protocol):
    """What the metrics read of a daemon (``worker.daemon.daemon.WorkerDaemon``)."""

    def figures(self) -> DaemonFigures: ...


class _Collector:
    def __init__(self, daemon: Observed) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        f = self.daemon.figures()
        stats = f.stats
        _counter, _gauge = _series(CounterMetricFamily, f.node), _series(GaugeMetricFamily, f.node)
        yield _gauge("rankctl_worker_connected", "1 while a session with the coordinator is registered.",
                     int(f.online))
        yield _counter("rankctl_worker_registrations", "Sessions the coordinator acknowledged.", stats.registrations)
        yield _counter("rankctl_worker_reconnects", "Registrations after the first one.",
                       max(0, stats.registrations - 1))
        yield _counter("rankctl_worker_connect_failures", "Sessions that could not start or broke.",
                       stats.connect_failures)
        yield _counter("rankctl_worker_reports_sent", "Rank reports sent to the coordinator (replays included).",
                       stats.reports_sent)
        yield _gauge("rankctl_worker_reports_buffered", "Reports kept until the coordinator has stored them.",
                     f.buffered)
        yield _counter("rankctl_worker_reports_dropped", "Reports dropped because the buffer was full.",
                       f.dropped)
        yield _counter("rankctl_worker_log_lines_shipped", "Rank log lines sent to the coordinator.",
                       stats.log_lines_shipped)
        yield _gauge("rankctl_worker_slots", "Rank slots this node offers.", f.slots)
        yield _gauge("rankctl_worker_launcher_alive", "1 while the warm launcher runs.", int(f.launcher_alive))
        yield _counter("rankctl_worker_launcher_restarts", "Replacement launchers started.", stats.launcher_restarts)
        yield _counter("rankctl_worker_assignments_refused", "Assignments refused (bad ids, paths outside the roots).",
                       f.refused)
        yield _ranks(f)


def _series(family_type: type, node: str) -> Callable[[str, str, float], Metric]:
    """A maker of one-sample families of ``family_type`` labelled with ``node``."""
    def make(name: str, doc: str, value: float) -> Metric:
        family = family_type(name, doc, labels=["node"])
        family.add_metric([node], value)
        return family
    return make


def _ranks(f: DaemonFigures) -> GaugeMetricFamily:
    ranks = GaugeMetricFamily("rankctl_worker_ranks", "Live ranks on this node, by phase.", labels=["node", "phase"])
    counts: Counter[str] = Counter()
    for phase, n in f.live_phases.items():
        phase = STARTING if phase is None else phase
        counts[phase if phase in RANK_PHASES else OTHER] += n
    for phase in RANK_PHASES:
        ranks.add_metric([f.node, phase], counts.get(phase, 0))
    return ranks


class WorkerMetrics:
    """One daemon's /metrics: a registry of its own with one collector bound to ``daemon``."""

    def __init__(self, daemon: Observed) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(daemon))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of a scrape; call on the daemon's event loop thread."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


async def serve_metrics(listen: str, metrics: WorkerMetrics, identity: IdentityDir | None = None,
                        ) -> tuple["web.AppRunner", int]:
    """Serve ``GET /metrics`` on ``listen`` (port 0: any), HTTPS with ``identity``; (runner, bound port).
    ``runner.cleanup()`` stops it."""
    from aiohttp import web

    from rankctl.security.tls import https_server_context, split_listen

    host, port = split_listen(listen)

    async def scrape(_: web.Request) -> web.Response:
        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=https_server_context(identity) if identity else None)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])
