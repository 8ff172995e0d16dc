"""Following a job to its end: a live view on stderr (``ctl watch``, ``submit --watch``, ``up``) or a quiet
wait (``--wait``), surviving coordinator restarts; ``exit_for`` turns the final state into ctl's exit code."""

from __future__ import annotations

import sys
import time

import click

from rankctl.cli.context import Ctx
from rankctl.cli.errors import EXIT_JOB_FAILED, EXIT_UNREACHABLE, CtlError


LIVE_INTERVAL = 0.2   # seconds between event batches while a live view is shown (steps coalesced between)
WAIT_INTERVAL = 1.0   # ... while only the end matters (--wait)
SHOWN_RANKS = 64      # ranks in a status or live view's table
NOTED_EVENTS = ("straggler", "notice", "preflight", "node")  # event kinds a live view prints as lines (the rest
                                                            # only update the view)


def follow_job(ctx: Ctx, job_id: str, live: bool, reconnect_timeout: float = 120.0, *, transient: bool = False):
    """Follow a job until it is terminal; survive coordinator restarts. Returns the job (one final GetJob).
    ``transient``: the live view leaves nothing behind (the caller prints the final status itself).

    One GetJob at the start and after each reconnect; then the displayed job is kept current from
    WatchJobBatches (state, reason, attempt, summary, rank and step events).
    """
    from rankctl.cli.console import stderr_console
    from rankctl.cli.render import TERMINAL, job_view, state_name

    follower = _Follower(_LiveView(stderr_console(), job_view, transient) if live else None)
    down_since = None
    try:
        while True:
            try:
                with ctx.client() as client:
                    job = follower.start(client.get(job_id, rank_limit=SHOWN_RANKS))
                    down_since, job_id = None, job.id
                    if state_name(job.state) not in TERMINAL:
                        follower.batches(client, LIVE_INTERVAL if live else WAIT_INTERVAL)
                    if state_name(follower.job.state) in TERMINAL:
                        return follower.finish(client.get(job_id))
            except CtlError as exc:
                if exc.exit_code != EXIT_UNREACHABLE:
                    raise
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > reconnect_timeout:
                    raise
                click.echo(f"coordinator unreachable, retrying: {exc.message}", err=True)
                time.sleep(1.0)
    finally:
        follower.stop()


class _Follower:
    """The job being followed (one page of ranks), kept current from events; ``after`` survives reconnects."""

    def __init__(self, display: "_LiveView | None") -> None:
        self.display, self.after, self.job = display, 0, None

    def start(self, job):
        self.job = job
        self._show()
        return job

    def batches(self, client, interval: float) -> None:
        """Until the stream ends (the job is terminal); a new attempt re-reads the job (its ranks start over)."""
        from rankctl.cli.render import apply_batch

        for batch in client.watch_batches(self.job.id, self.after, interval):
            if batch.attempt != self.job.attempt:
                self.job = client.get(self.job.id, rank_limit=SHOWN_RANKS)
            apply_batch(self.job, batch)
            self.after = max([self.after, *(ev.seq for ev in batch.events)])
            self._notes(batch.events)
            self._show(LIVE_INTERVAL / 2)  # the coordinator spaces batches already; this only spares a backlog

    def finish(self, job):
        self.job = job
        self._show()
        return job

    def _show(self, throttle: float = 0.0) -> None:
        if self.display:
            self.display.update(self.job, throttle)

    def _notes(self, events) -> None:
        """Events worth a line of their own above the live view (a straggler flagged or unflagged, a rank's
        notice, the pre-flight's figures, a node excluded or kept apart)."""
        if self.display:
            for event in events:
                if event.kind in NOTED_EVENTS:
                    self.display.note(f"step {event.step}: {event.message}" if event.step else event.message)

    def stop(self) -> None:
        if self.display:
            self.display.stop()


class _LiveView:
    """A rich Live display on stderr, refreshed at most every ``throttle`` seconds; ``transient``: erased at
    the end on a terminal, never written on a file or pipe (only a live view's last frame goes there)."""

    def __init__(self, console, render, transient: bool = False) -> None:
        from rich.live import Live

        self._render, self._last = render, 0.0
        self._live = Live(console=console, auto_refresh=False, transient=transient,
                          redirect_stdout=False)  # stdout is for results: nothing of a live view goes there
        self._live.start()

    def update(self, job, throttle: float = 0.0) -> None:
        now = time.monotonic()
        if now - self._last >= throttle:
            self._last = now
            self._live.update(self._render(job), refresh=True)

    def note(self, line: str) -> None:
        self._live.console.print(line, style="yellow", highlight=False, markup=False)

    def stop(self) -> None:
        self._live.stop()


def exit_for(job) -> None:
    from rankctl.cli.render import state_name

    state = state_name(job.state)
    if state != "SUCCEEDED":
        click.echo(f"job {job.id} {state}: {job.reason}", err=True)
        sys.exit(EXIT_JOB_FAILED)
