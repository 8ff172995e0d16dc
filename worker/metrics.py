"""Prometheus metrics of one worker daemon (``ctl worker --metrics-listen HOST:PORT``; off by default).

``DaemonStats`` holds the counters the daemon keeps for them; ``WorkerMetrics`` is a registry of
its own per daemon (tests run several daemons in one process) whose collector reads the daemon
when scraped. ``serve_metrics`` answers ``GET /metrics`` with aiohttp on the daemon's event
loop, so that a scrape reads the daemon's state on the thread that changes it; with the node's TLS
identity it serves HTTPS and requires a client certificate of the cluster's CA (as the coordinator's
/metrics does). Every series carries ``node`` (the daemon's name), so that the series of several
daemons stay apart whatever target labels a scraper adds. Per scrape the work is O(ranks on this
node). Series: docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rankctl.contract.rankstatus import PHASES

if TYPE_CHECKING:
    from aiohttp import web

    from rankctl.security.tls import IdentityDir
    from rankctl.worker.daemon import WorkerDaemon

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


class _Collector:
    def __init__(self, daemon: WorkerDaemon) -> None:
        self.daemon = daemon

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["node"])
        family.add_metric([self.daemon.cfg.name], value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["node"])
        family.add_metric([self.daemon.cfg.name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        d, stats = self.daemon, self.daemon.stats
        _counter, _gauge = self._counter, self._gauge
        yield _gauge("rankctl_worker_connected", "1 while a session with the coordinator is registered.",
                     int(d.online))
        yield _counter("rankctl_worker_registrations", "Sessions the coordinator acknowledged.", stats.registrations)
        yield _counter("rankctl_worker_reconnects", "Registrations after the first one.",
                       max(0, stats.registrations - 1))
        yield _counter("rankctl_worker_connect_failures", "Sessions that could not start or broke.",
                       stats.connect_failures)
        yield _counter("rankctl_worker_reports_sent", "Rank reports sent to the coordinator (replays included).",
                       stats.reports_sent)
        yield _gauge("rankctl_worker_reports_buffered", "Reports kept until the coordinator has stored them.",
                     len(d.reports))
        yield _counter("rankctl_worker_reports_dropped", "Reports dropped because the buffer was full.",
                       d.reports.dropped)
        yield _counter("rankctl_worker_log_lines_shipped", "Rank log lines sent to the coordinator.",
                       stats.log_lines_shipped)
        yield _gauge("rankctl_worker_slots", "Rank slots this node offers.", d.cfg.slots)
        yield _gauge("rankctl_worker_launcher_alive", "1 while the warm launcher runs.", int(d.launcher_alive))
        yield _counter("rankctl_worker_launcher_restarts", "Replacement launchers started.", stats.launcher_restarts)
        yield _counter("rankctl_worker_assignments_refused", "Assignments refused (bad ids, paths outside the roots).",
                       d.refused)
        yield self._ranks()

    def _ranks(self) -> GaugeMetricFamily:
        ranks = GaugeMetricFamily("rankctl_worker_ranks", "Live ranks on this node, by phase.",
                                  labels=["node", "phase"])
        counts: Counter[str] = Counter()
        for run in self.daemon.runs.values():
            for rank in run.alive:
                phase = run.phase.get(rank, STARTING)
                counts[phase if phase in RANK_PHASES else OTHER] += 1
        for phase in RANK_PHASES:
            ranks.add_metric([self.daemon.cfg.name, phase], counts.get(phase, 0))
        return ranks


class WorkerMetrics:
    """One daemon's /metrics: a registry of its own with one collector bound to ``daemon``."""

    def __init__(self, daemon: WorkerDaemon) -> None:
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
