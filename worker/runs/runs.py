"""The job attempts with ranks on this node, from their launch to their last exit: their status lines and
the launcher's events become rank reports (the record converted once, ``worker.uplink.reporting.to_wire``); every
few turns the live ranks' processes are looked at (``worker.runs.watch``) and new checkpoint steps pushed
(``worker.replication.replication``). The launcher rotates the ranks' logs as bytes arrive (``worker.runs.rankio``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import Counter
from typing import Any, Callable

from rankctl.contract.files.rankfiles import write_control
from rankctl.contract.files.rankstatus import STOPPED, RankStatusRecord
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.files import shm
from rankctl.worker.uplink.outbox import Outbox
from rankctl.worker.replication.replication import Replication
from rankctl.worker.runs.procstat import held, process_state
from rankctl.worker.uplink.reporting import exit_code, exit_status, how_ended, to_wire
from rankctl.worker.runs.runstate import RunState
from rankctl.worker.replication.savewake import SaveWake
from rankctl.worker.daemon.tasks import Background
from rankctl.worker.runs.watch import ProcessWatch

WATCH_EVERY = 1               # poll turns between two looks at the ranks' process states (0.1 s)
REPLICATE_EVERY = 1           # poll turns between two looks for new steps to push (every 0.1 s: a step written just
                              # before a fault is on the peer; bench/recovery.py lost 3 steps in 6 of 9 runs at 2)
CONTINUE_AFTER_S = 0.5        # a cancelled job's stopped ranks are continued this long after the kill


class Runs:
    """``release_workdir(digest)`` unpins a run's workdir in the node's cache once its last rank ended."""

    def __init__(self, *, node: str, outbox: Outbox, watch: ProcessWatch, replication: Replication,
                 background: Background, release_workdir: Callable[[str], None], poll_interval: float,
                 start_poll_interval: float, log: Any) -> None:
        self._node = node
        self._outbox = outbox
        self._watch = watch
        self._replication = replication
        self._background = background
        self._release_workdir = release_workdir
        self._poll_interval = poll_interval
        self._start_poll_interval = start_poll_interval
        self._log = log
        self._runs: dict[tuple[str, int], RunState] = {}
        self._wake = SaveWake(lambda run: replication.push([run]), log)

    def add(self, run: RunState) -> None:
        self._runs[(run.job_id, run.attempt)] = run
        self._wake.open(run)   # its ranks' completed saves are pushed to its replica peer at once

    def running_jobs(self) -> list[pb.RunningJob]:
        """The attempts with live ranks here, as a registration names them."""
        return [pb.RunningJob(job_id=r.job_id, attempt=r.attempt, ranks=sorted(r.alive))
                for r in self._runs.values() if r.alive]

    def live_attempts(self, job_id: str) -> list[int]:
        """The job's attempts with live ranks here."""
        return sorted(r.attempt for r in self._runs.values() if r.job_id == job_id and r.alive)

    def stopping(self, job_id: str, attempts: list[int] | None, reason: str) -> None:
        """The coordinator asked to stop the job's ranks (of ``attempts``; None: every attempt here): their exits
        say ``stopped: REASON`` instead of a signal and a log tail that explain nothing."""
        for run in self._runs.values():
            if run.job_id == job_id and (attempts is None or run.attempt in attempts):
                run.stop_reason = reason or "cancelled"

    def supersede(self, job_id: str, before: int) -> list[RunState]:
        """A newer attempt ``before`` of the job is assigned here (a restart in place): its older runs with live
        ranks say nothing more to the coordinator, which has moved on; those runs (to stop and wait for)."""
        runs = [r for r in self._runs.values() if r.job_id == job_id and r.attempt < before and r.alive]
        for run in runs:
            run.superseded = True
        return runs

    def live_phases(self) -> Counter[str | None]:
        """Live ranks by the phase of their last report (None: none yet)."""
        return Counter(run.phase.get(rank) for run in self._runs.values() for rank in run.alive)

    # -- status files ------------------------------------------------------------------------
    async def poll_loop(self) -> None:
        """Forever: new status lines of every run (fast while one starts), and every few turns the rest."""
        loop = asyncio.get_running_loop()
        turns, next_turn = 0, 0.0  # turns of poll_interval (a fast poll at start-up adds none)
        while True:
            for key, run in list(self._runs.items()):
                self._read_status_lines(run)
                if not run.alive:
                    self._runs.pop(key, None)  # every exit reported (the outbox keeps them until stored)
                    self._wake.close(run)
                    if run.workdir_blob:
                        self._release_workdir(run.workdir_blob)  # its tree may now be evicted
            starting = any(run.starting() for run in self._runs.values())
            interval = self._start_poll_interval if starting else self._poll_interval
            if loop.time() >= next_turn:
                next_turn = loop.time() + self._poll_interval - interval / 2
                turns += 1
                self._every_turn(turns)
            await asyncio.sleep(interval)

    def _every_turn(self, turns: int) -> None:
        if turns % WATCH_EVERY == 0:
            self._watch.look(self._runs)
        if turns % REPLICATE_EVERY == 0:
            self._replication.push(self._runs.values())

    def _read_status_lines(self, run: RunState) -> None:
        """Report every status record the run's ranks wrote since the last read."""
        if run.tailer is not None:
            for rec in run.tailer.poll():
                self._report_record(run, rec)

    def _report_record(self, run: RunState, rec: RankStatusRecord) -> None:
        if run.superseded:
            return
        status, result_json = to_wire(rec, self._node)
        previous = run.phase.get(status.rank)
        run.phase[status.rank] = status.phase
        if run.hangs is not None:
            run.hangs.touch(status.rank, stepped=status.step > 0)
        # a rank's first step is where the coordinator learns the attempt's first step (after a resume, too):
        # it is never replaced by the next one
        first_step = status.step > 0 and status.rank not in run.stepped
        if status.step > 0:
            run.stepped.add(status.rank)
        status.first_step = first_step   # never folded away either (``worker.uplink.reportfold``)
        step_only = (status.phase == previous == "running" and not status.error and not result_json
                     and not status.notice and not first_step)
        self._outbox.report(run.job_id, run.attempt, status, result_json, step_only=step_only)

    # -- the launcher's events ---------------------------------------------------------------
    async def on_event(self, ev: dict[str, Any]) -> None:
        """One launcher event: a rank started or exited."""
        run = self._runs.get((ev.get("job_id", ""), int(ev.get("attempt", 0))))
        if run is None:
            return
        rank = int(ev["rank"])
        if ev.get("event") == "started":
            run.alive.add(rank)
            if isinstance(ev.get("pid"), int):
                run.pids[rank] = ev["pid"]
        elif ev.get("event") == "exited":
            self._exited(run, rank, ev)

    def _exited(self, run: RunState, rank: int, ev: dict[str, Any]) -> None:
        run.alive.discard(rank)
        self._read_status_lines(run)  # status lines written before the exit go first
        code = exit_code(ev)
        leftovers = int(ev.get("leftovers_killed") or 0)
        if code != 0 and run.stop_reason:   # stopped on the coordinator's request (a Cancel): no failure of its own
            notes = [f"{STOPPED}{run.stop_reason}"]
        else:
            notes = ["\n".join(last_traceback(ev.get("log_tail") or []))] if code != 0 else []
            if code < -1:  # the log's last line is whatever the rank printed before the signal: say what ended it
                notes.append(f"rankctl: rank {rank} ended: {how_ended(code)} (its log's last lines above)")
        if leftovers:
            notes.append(f"rankctl: {leftovers} leftover process(es) of rank {rank} still ran after it ended; "
                         "they were killed")
        notes.extend(f"rankctl: {note}" for note in ev.get("notes") or [])  # e.g. the OOM killer at a limit
        if not run.superseded:
            self._outbox.report(run.job_id, run.attempt, exit_status(rank, self._node, code, "\n".join(notes)))
        self._log.info("rank exited", job=run.job_id, rank=rank, code=code, leftovers_killed=leftovers)
        if code == 0:
            run.succeeded.add(rank)
            if run.succeeded == run.ranks:
                self._replication.finished(run)

    async def launcher_died(self, why: str) -> None:
        """Every rank the dead launcher had forked died with it: report each killed, for ``why``."""
        self._log.error("launcher died; restarting it", why=why,
                        jobs=sorted({r.job_id for r in self._runs.values() if r.alive}))
        await asyncio.to_thread(_unmount_shm, [r.run_dir for r in self._runs.values() if r.alive])
        for run in list(self._runs.values()):
            self._read_status_lines(run)
            for rank in sorted(run.alive):
                self._outbox.report(run.job_id, run.attempt, exit_status(rank, self._node, -signal.SIGKILL, why))
            run.alive.clear()

    # -- the coordinator's requests ----------------------------------------------------------
    def request_checkpoint(self, msg: pb.CheckpointNow) -> None:
        """Ask the live ranks of the attempt to save a checkpoint at the end of ``msg.step``."""
        run = self._runs.get((msg.job_id, msg.attempt))
        if run is None:
            return
        for rank in sorted(run.alive):
            try:
                write_control(run.run_dir, rank, {"checkpoint_at": int(msg.step)})
            except OSError as exc:
                self._log.warning("checkpoint request not written", job=msg.job_id, rank=rank, error=str(exc))
        self._log.info("checkpoint requested", job=msg.job_id, attempt=msg.attempt, step=msg.step)

    def continue_stopped(self, job_id: str, delay: float = CONTINUE_AFTER_S) -> None:
        """A stopped rank keeps a SIGTERM pending until it goes on: once the launcher had time to signal a
        cancelled job's ranks, continue those stopped, so that they end now rather than at the SIGKILL."""
        self._background.spawn(self._continue_stopped(job_id, delay))

    async def _continue_stopped(self, job_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        for run in list(self._runs.values()):
            if run.job_id != job_id:
                continue
            for rank in sorted(run.alive):
                pid = run.pids.get(rank)
                if pid and held(process_state(pid)):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGCONT)
                        self._log.info("stopped rank continued to end it", job=job_id, rank=rank, pid=pid)


def _unmount_shm(run_dirs: list[str]) -> None:
    """The private /dev/shm of each run whose launcher died (it unmounts them itself otherwise)."""
    for run_dir in run_dirs:
        shm.unmount_job_shm(run_dir)


TRACEBACK_HEAD = "Traceback (most recent call last):"


def last_traceback(tail: list[str]) -> list[str]:
    """A failed rank's log tail from its last traceback on (the rank prints its whole traceback, then the one from the
    user's first frame: ``runtime.rank.user_traceback``); the whole tail when it holds none."""
    starts = [i for i, line in enumerate(tail) if line.startswith(TRACEBACK_HEAD)]
    return tail[starts[-1]:] if starts else tail
