"""Prometheus metrics of the coordinator, collected from the core's state at scrape time.

``CoordinatorMetrics`` is a registry of its own (never the process-global one) whose collector
reads the core when scraped, through the narrow ``Observed`` (the counters the core keeps for it
are ``coordinator.model.stats``). The scrape runs on the event loop thread, so it reads the core
without locks; it costs O(jobs + nodes), plus O(ranks of the active jobs) only with
``per_rank`` (opt-in). Per-job series are labelled ``job_id`` (and ``job_name``), never ``job``: a
scraper owns that label (Prometheus sets it to the scrape job's name and renames ours). A job that
ends keeps its last series, its final state included, for FINISHED_KEPT_S (the last FINISHED_KEPT
such jobs), so that a scrape after its end still reads its last step. Series, labels and
cardinality: docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterator, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from rankctl.coordinator.scheduling.fanout import Fanouts
from rankctl.coordinator.jobs.book import JobBook
from rankctl.coordinator.fleet.nodes import NodeStatus, NodeTable
from rankctl.coordinator.jobs.shown import JobGauges, Shown as ReadModel, job_gauges
from rankctl.coordinator.diagnosis.progress import JobProgress
from rankctl.coordinator.model.records import PHASES, JobRecord
from rankctl.coordinator.model.states import JobState, is_terminal
from rankctl.coordinator.model.stats import RESTART_CAUSES, CoordinatorStats
from rankctl.kinds import registry
from rankctl.kinds.figures import described
OTHER = "other"   # a phase outside PHASES (ranks write their own): one label value for all of them
JOB = ("job_id",)     # the per-job label; "job" belongs to the scraper
FINISHED_KEPT = 16        # ended jobs whose last series stay, the most recently ended ...
FINISHED_KEPT_S = 600.0   # ... for this long after they ended
Scraped = tuple[JobRecord, JobProgress]   # a job whose series a scrape shows, with its counters


class Observed(Protocol):
    """What a scrape reads of the coordinator (``core.Coordinator`` is one); the counters are ``coordinator.model.stats``."""

    book: JobBook
    nodes: NodeTable
    stats: CoordinatorStats
    fanouts: Fanouts

    def clock(self) -> float: ...

    @property
    def shown(self) -> ReadModel: ...

    @property
    def rejected_reports(self) -> Counter[str]: ...

    @property
    def held_reports(self) -> int: ...


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _phase(phase: str) -> str:
    return phase if phase in PHASES else OTHER


class _Collector:
    """Reads the core when the registry is scraped (event loop thread)."""

    def __init__(self, core: Observed, per_rank: bool) -> None:
        self.core, self.per_rank = core, per_rank
        self._seen: dict[str, Scraped] = {}              # the jobs active at the last scrape
        self._ended: OrderedDict[str, Scraped] = OrderedDict()   # ended since, the last one last

    def collect(self) -> Iterator[Metric]:
        yield from self._jobs()
        yield from self._queue()
        yield from self._nodes()
        yield from self._counters()
        active = self.core.book.active()
        yield from self._job_series(active)
        if self.per_rank:
            yield from self._rank_series(active)

    def _shown(self, active: list[JobRecord]) -> list[Scraped]:
        """The active jobs with their counters, then the recently ended ones (their counters as they were
        when they ended: the attempt's own object, held from the scrape that last saw the job active)."""
        book, now = self.core.book, self.core.clock()
        current = {job.id: (job, book.progress(job)) for job in active}
        for job_id, shown in self._seen.items():
            if job_id not in current:
                self._ended[job_id] = shown
                self._ended.move_to_end(job_id)
        self._seen = current
        while len(self._ended) > FINISHED_KEPT:
            self._ended.popitem(last=False)
        for job_id in [i for i, (job, _) in self._ended.items()
                       if not is_terminal(job.state) or now - job.finished_at > FINISHED_KEPT_S]:
            del self._ended[job_id]
        return [*current.values(), *self._ended.values()]

    def _jobs(self) -> Iterator[Metric]:
        jobs = _gauge("rankctl_jobs", "Jobs known to the coordinator, by state.", ("state",))
        counts = Counter(j.state for j in self.core.book.jobs.values())
        for state in JobState:
            jobs.add_metric([state.value], counts.get(state, 0))
        yield jobs

    def _queue(self) -> Iterator[Metric]:
        book = self.core.book
        yield GaugeMetricFamily("rankctl_job_queue_length", "PENDING jobs.", value=len(book.queued_at))
        oldest = max(0.0, self.core.clock() - min(book.queued_at.values())) if book.queued_at else 0.0
        yield GaugeMetricFamily("rankctl_job_queue_oldest_wait_seconds",
                                "How long the longest-waiting PENDING job has waited (0: none).", value=oldest)
        wait = self.core.stats.queue_wait
        yield HistogramMetricFamily("rankctl_job_queue_wait_seconds",
                                    "Queue wait of each started attempt: queued (submitted or requeued) to placed.",
                                    buckets=wait.buckets(), sum_value=wait.total)

    def _nodes(self) -> Iterator[Metric]:
        core, now = self.core, self.core.clock()
        nodes = _gauge("rankctl_nodes", "Known nodes, by state.", ("state",))
        counts = Counter(s.status for s in core.nodes)
        for status in NodeStatus:
            nodes.add_metric([status.value], counts.get(status, 0))
        yield nodes
        yield GaugeMetricFamily("rankctl_nodes_draining", "Nodes being drained (ctl drain).",
                                value=len(core.nodes.draining))
        age = _gauge("rankctl_node_heartbeat_age_seconds", "Seconds since a READY node was last heard from.",
                     ("node",))
        for s in core.nodes.ready():
            age.add_metric([s.name], max(0.0, now - s.last_heartbeat))
        yield age
        slots = _gauge("rankctl_slots", "Rank slots of the READY nodes: all of them, and those not taken.",
                       ("state",))
        total, free = core.shown.slots()
        slots.add_metric(["total"], total)
        slots.add_metric(["free"], free)
        yield slots

    def _counters(self) -> Iterator[Metric]:
        core, stats = self.core, self.core.stats
        yield CounterMetricFamily("rankctl_rank_reports", "Rank reports applied and stored.",
                                  value=stats.rank_reports)
        rejected = CounterMetricFamily("rankctl_rank_reports_rejected",
                                       "Reports for a rank the sending node does not run in this attempt.",
                                       labels=["node"])
        for node, n in sorted(core.rejected_reports.items()):
            rejected.add_metric([node], n)
        yield rejected
        yield GaugeMetricFamily("rankctl_rank_reports_held", "Reports received but not stored: the store refuses.",
                                value=core.held_reports)
        took = _gauge("rankctl_coordinator_fanout_seconds", "The last fan-out of a message kind to a job's nodes (a "
                      "restart's cancel, a placement's assign): seconds from the decision to the last one handed to "
                      "gRPC.", ("message",))
        ended = _gauge("rankctl_coordinator_fanout_end_time_seconds", "When that fan-out's last message was handed to "
                       "gRPC (unix time).", ("message",))
        for kind, done in sorted(core.fanouts.last.items()):
            took.add_metric([kind], done.seconds)
            ended.add_metric([kind], done.ended_at)
        yield took
        yield ended
        relayed = CounterMetricFamily("rankctl_coordinator_relayed_messages", "Messages through relay heads "
                                      "(coordinator.relay): Assigns a head delivered, Assigns sent direct after the "
                                      "relay failed, report batches heads carried up.", labels=["outcome"])
        relayed.add_metric(["delivered"], core.relays.relayed)
        relayed.add_metric(["direct"], core.relays.direct)
        relayed.add_metric(["carried"], core.relays.carried)
        yield relayed
        restarts = CounterMetricFamily("rankctl_job_restarts", "Job attempts restarted, by cause.", labels=["cause"])
        for cause in sorted({*RESTART_CAUSES, *stats.restarts}):
            restarts.add_metric([cause], stats.restarts.get(cause, 0))
        yield restarts

    def _job_series(self, active: list[JobRecord]) -> Iterator[Metric]:
        """One series per active job (PLACED, STARTING, RUNNING, RESTARTING) or recently ended one, and
        figure: O(active jobs + FINISHED_KEPT)."""
        fam = JobFamilies()
        for job, progress in self._shown(active):
            fam.add(job_gauges(job, progress))
        yield from fam.all()

    def _rank_series(self, active: list[JobRecord]) -> Iterator[Metric]:
        """Opt-in (``per_rank``): one series per rank of every active job, O(ranks)."""
        flag = _gauge("rankctl_rank_straggler", "1: the rank is flagged a straggler by its compute time.",
                      (*JOB, "rank"))
        step = _gauge("rankctl_rank_step", "The latest step a rank reported.", (*JOB, "rank"))
        for job in active:
            progress = self.core.book.progress(job)
            slow = progress.skew.slow if progress.skew is not None else {}
            for r in range(job.world_size):
                flag.add_metric([job.id, str(r)], 1 if r in slow else 0)
            for r, rec in self.core.book.ranks(job.id).items():
                step.add_metric([job.id, str(r)], rec.step)
        yield flag
        yield step


class JobFamilies:
    """The per-job families, filled one job at a time."""

    def __init__(self) -> None:
        j = JOB
        self.info = _gauge("rankctl_job_info", "1 per job shown (active, or ended lately): its name, kind and "
                           "state.", (*JOB, "job_name", "kind", "state"))
        self.attempt = _gauge("rankctl_job_attempt", "The job's current attempt (1 + restarts).", j)
        self.ranks = _gauge("rankctl_job_ranks", "The job's ranks by phase (this attempt).", (*JOB, "phase"))
        self.step = _gauge("rankctl_job_step", "The slowest rank's step: every rank has finished it.", j)
        self.step_max = _gauge("rankctl_job_step_max", "The fastest rank's step.", j)
        self.figures: dict[str, GaugeMetricFamily] = {}   # each gauge a kind describes (``kinds.figures``)
        for kind in registry.kinds().values():
            for f in described(kind.figures).values():
                if f.metric and f.metric not in self.figures:
                    self.figures[f.metric] = _gauge(f.metric, f.help or f.label, j)
        self.step_time = _gauge("rankctl_job_step_time_seconds",
                                "Step time of the last completed step across the ranks that reported it.",
                                (*JOB, "stat"))
        self.step_duration = HistogramMetricFamily(
            "rankctl_job_step_duration_seconds",
            "Duration of each completed step of this attempt, observed once (the slowest reporting rank's step "
            "time); histogram_quantile() gives its quantiles.", labels=j)
        self.stragglers = _gauge("rankctl_job_stragglers", "Ranks flagged as stragglers by their compute time.", j)
        self.lagging = _gauge("rankctl_job_lagging_ranks", "Ranks still at the slowest step while others are ahead.",
                              j)

    def add(self, g: JobGauges) -> None:
        job = g.job
        self.info.add_metric([job.id, job.name, job.kind, job.state.value], 1)
        self.attempt.add_metric([job.id], job.attempt)
        phases = Counter()
        for phase, n in g.phases.items():
            phases[_phase(phase)] += n
        for phase, n in sorted(phases.items()):
            self.ranks.add_metric([job.id, phase], n)
        self.step.add_metric([job.id], g.min_step)
        self.step_max.add_metric([job.id], g.max_step)
        self.stragglers.add_metric([job.id], g.stragglers)
        self.lagging.add_metric([job.id], g.lagging)
        if g.step_buckets:
            self.step_duration.add_metric([job.id], g.step_buckets, g.step_total)
        for metric, value in g.figures.items():
            self.figures[metric].add_metric([job.id], value)
        for stat, value in g.step_time.items():
            self.step_time.add_metric([job.id, stat], value)

    def all(self) -> list[Metric]:
        return [self.info, self.attempt, self.ranks, self.step, self.step_max, *self.figures.values(),
                self.step_time, self.step_duration, self.stragglers, self.lagging]


class CoordinatorMetrics:
    """The coordinator's /metrics: a registry of its own with one collector bound to ``core``."""

    def __init__(self, core: Observed, *, per_rank: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(core, per_rank))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of a scrape, in the Prometheus text format; call on the event loop thread."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

