"""Following a job to its end: a live view on stderr (``ctl watch``, ``submit --watch``, ``up``) or a quiet
wait (``--wait``), surviving coordinator restarts; ``exit_for`` turns the final state into ctl's exit code."""

from __future__ import annotations

import sys
import threading
import time

import click

from rankctl.cli.context import Ctx
from rankctl.cli.errors import EXIT_JOB_FAILED, EXIT_UNREACHABLE, CtlError


LIVE_INTERVAL = 0.2   # seconds between event batches while a live view is shown (steps coalesced between)
WAIT_INTERVAL = 1.0   # ... while only the end matters (--wait)
SHOWN_RANKS = 64      # ranks in a status or live view's table
NOTED_EVENTS = ("straggler", "notice", "node", "stopped", "stall")  # event kinds a live view prints as lines (the rest only update it)
PAGE_REFRESH_S = 1.0  # the page of ranks is read again at most this often when the summary's phases change
PRINTED_GRACE_S = 10.0  # how long the end of a job waits for the ranks' last printed lines


def follow_job(ctx: Ctx, job_id: str, live: bool, reconnect_timeout: float = 120.0, *, transient: bool = False,
               printed: bool = False):
    """Follow a job until it is terminal; survive coordinator restarts. Returns the job (one final GetJob).
    ``transient``: the live view leaves nothing behind (the caller prints the final status itself).
    ``printed``: what the ranks print is shown above the live view as it comes, each line after ``[rank R]``.

    One GetJob at the start and after each reconnect; then the displayed job is kept current from
    WatchJobBatches (state, reason, attempt, summary, rank and step events).
    """
    from rankctl.cli.view.console import stderr_console
    from rankctl.cli.view.render import TERMINAL, state_name

    display = _LiveView(stderr_console(), transient) if live else None
    follower = _Follower(display)
    printer = _Printer(ctx, job_id, display) if printed and display else None
    down_since = None
    try:
        while True:
            try:
                with ctx.client() as client:
                    job = follower.start(client.get(job_id, rank_limit=SHOWN_RANKS))
                    down_since, job_id = None, job.id
                    if printer:
                        printer.start(job.id)
                    if state_name(job.state) not in TERMINAL:
                        follower.batches(client, LIVE_INTERVAL if live else WAIT_INTERVAL)
                    if state_name(follower.job.state) in TERMINAL:
                        job = client.get(job_id)
                        if printer:
                            printer.join()
                        return follower.finish(job)
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
    """The job being followed (one page of ranks), kept current from events; ``after`` survives reconnects.

    Rank events are not the whole story: above a size the coordinator writes none for routine phase changes, so
    the page is read again when the summary's phases change (at most every ``PAGE_REFRESH_S``)."""

    def __init__(self, display: "_LiveView | None") -> None:
        self.display, self.after, self.job = display, 0, None
        self._page_phases: dict[str, int] = {}
        self._page_read = 0.0

    def start(self, job):
        self._page(job)
        self._show()
        return job

    def batches(self, client, interval: float) -> None:
        """Until the stream ends (the job is terminal); a new attempt re-reads the job (its ranks start over)."""
        from rankctl.cli.view.render import apply_batch

        for batch in client.watch_batches(self.job.id, self.after, interval):
            if batch.attempt != self.job.attempt:
                self._page(client.get(self.job.id, rank_limit=SHOWN_RANKS))
            apply_batch(self.job, batch)
            self.after = max([self.after, *(ev.seq for ev in batch.events)])
            self._notes(batch.events)
            if self.display and dict(self.job.summary.phases) != self._page_phases \
                    and time.monotonic() - self._page_read >= PAGE_REFRESH_S:
                self._page(client.get(self.job.id, rank_limit=SHOWN_RANKS))
            self._show(LIVE_INTERVAL / 2)  # the coordinator spaces batches already; this only spares a backlog

    def _page(self, job) -> None:
        self.job, self._page_read = job, time.monotonic()
        self._page_phases = dict(job.summary.phases)

    def finish(self, job):
        self.job = job
        if self.display:
            self.display.finish(job)
        return job

    def _show(self, throttle: float = 0.0) -> None:
        if self.display:
            self.display.update(self.job, throttle)

    def _notes(self, events) -> None:
        """Events worth a line of their own above the live view (a straggler flagged or unflagged, a rank's
        notice, a node excluded or kept apart); the pre-flight's figures are in the view itself."""
        if self.display:
            for event in events:
                if event.kind in NOTED_EVENTS:
                    self.display.note(f"step {event.step}: {event.message}" if event.step else event.message)

    def stop(self) -> None:
        if self.display:
            self.display.stop()


class _LiveView:
    """A rich Live display on stderr, refreshed at most every ``throttle`` seconds, never taller than the
    terminal (a taller one leaves copies of its head in the scrollback when redrawn or erased). At the end it
    shows the whole status (result tables, up to ``SHOWN_RANKS`` ranks), unless ``transient``: then it is
    erased on a terminal and never written on a file or pipe (the caller prints the final status)."""

    def __init__(self, console, transient: bool = False) -> None:
        from rich.live import Live

        self._last, self._transient, self._lock = 0.0, transient, threading.Lock()
        self._live = Live(console=console, auto_refresh=False, transient=transient,
                          redirect_stdout=False)  # stdout is for results: nothing of a live view goes there
        self._live.start()

    def update(self, job, throttle: float = 0.0) -> None:
        from rankctl.cli.view.render import live_view

        now = time.monotonic()
        if now - self._last >= throttle:
            self._last = now
            console = self._live.console
            height = console.size.height if console.is_terminal else None
            with self._lock:
                self._live.update(live_view(job, console, height), refresh=True)

    def finish(self, job) -> None:
        """The last frame: the whole status (rich prints it whole when the view stops), or (transient) the view."""
        from rankctl.cli.view.render import job_view

        if self._transient:
            self.update(job)
        else:
            with self._lock:
                self._live.update(job_view(job, max_ranks=SHOWN_RANKS), refresh=False)

    def note(self, line: str, style: str = "yellow") -> None:
        with self._lock:
            self._live.console.print(line, style=style or None, highlight=False, markup=False)

    def stop(self) -> None:
        with self._lock:
            self._live.stop()


class _Printer:
    """What the ranks print, followed (``ctl logs -f``) on a thread of its own and shown as notes above the
    live view, ``[rank R] line``; ``join`` waits for the rest once the job ended (the follow ends then)."""

    def __init__(self, ctx: Ctx, job_id: str, display: _LiveView) -> None:
        self._ctx, self._display, self._thread = ctx, display, None

    def start(self, job_id: str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(job_id,), name="rank-output", daemon=True)
            self._thread.start()

    def _run(self, job_id: str) -> None:
        from rankctl.cli.view.logview import line_text

        try:
            with self._ctx.client() as client:
                for line in client.logs(job_id, None, True, 0):
                    self._display.note(line_text(line.rank, line.line, prefixed=True), style="")
        except CtlError as exc:   # the view goes on without them; the job's own status says how it ended
            self._display.note(f"the ranks' output is not shown: {exc.message}")

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(PRINTED_GRACE_S)


def exit_for(job) -> None:
    from rankctl.cli.view.render import state_name

    state = state_name(job.state)
    if state != "SUCCEEDED":
        click.echo(f"job {job.id} {state}: {job.reason}", err=True)
        sys.exit(EXIT_JOB_FAILED)
