"""What the daemon sees of its live ranks' processes: one that is stopped (SIGSTOP, a debugger), and one
whose collective counters stopped moving (``worker.runs.hangwatch``), reported with its counters, whether it
computes (its CPU time advances outside collectives) and its stack, so that the coordinator's hang detector
can name the laggard and spare a slow rank. Per live rank and look: one read of ``/proc/PID/task/PID/stat``
and one of its counter file."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Mapping

from rankctl.contract.files.collfiles import in_collective, read_counters
from rankctl.contract.files.rankfiles import log_path
from rankctl.proto import rankctl_pb2 as pb
from rankctl.worker.runs import hangwatch, tcpstat
from rankctl.worker.uplink.outbox import Outbox
from rankctl.worker.runs.procstat import GONE, held, process_state, sample
from rankctl.worker.runs.runstate import RunState
from rankctl.worker.daemon.tasks import Background

STACKS_AT_ONCE = 4  # stack dumps of stalled ranks at once


class ProcessWatch:
    def __init__(self, *, node: str, outbox: Outbox, background: Background, py_spy: str | None, log: Any) -> None:
        self._node = node
        self._outbox = outbox
        self._background = background
        self._py_spy = py_spy
        self._log = log
        self._stacks = asyncio.Semaphore(STACKS_AT_ONCE)

    def look(self, runs: Mapping[tuple[str, int], RunState]) -> None:
        """Report process state changes of every live rank, and the evidence of a running rank that stalled
        (``runs``: the daemon's runs by (job, attempt); evidence for a run replaced meanwhile is dropped)."""
        for run in runs.values():
            if run.superseded:  # stopping for a newer attempt: the coordinator hears no more of it
                continue
            for rank in run.alive:
                pid = run.pids.get(rank)
                watched = run.hangs is not None and run.phase.get(rank) == "running" and bool(pid)
                sig = hangwatch.signature(run.run_dir, rank) if watched else None
                state, changed = self._process(run, rank, pid, sig)
                if watched and run.hangs and in_collective(sig) and run.hangs.loss_due(rank):
                    run.hangs.losing(rank, tcpstat.unacked(pid))   # a cut link: its data to a peer goes unheard
                seen = run.hangs.observe(rank, sig, stopped=held(state)) if watched and run.hangs else ""
                # a stop goes out with its evidence, in one report (the coordinator names it with the operation)
                if seen == hangwatch.STALLED:
                    self._stalled(runs, run, rank, pid, state)
                elif seen == hangwatch.CHANGED:  # it began or stopped computing: its evidence says so
                    self._changed(run, rank, state)
                elif seen == hangwatch.MOVED:  # withdraw the evidence: the rank went on
                    self._report(run, pb.RankStatus(rank=rank, node=self._node, process=state,
                                                    collectives=hangwatch.MOVED_JSON))
                elif changed:
                    self._report(run, pb.RankStatus(rank=rank, node=self._node, process=state))

    def _process(self, run: RunState, rank: int, pid: int | None, sig: bytes | None) -> tuple[str, bool]:
        """(the rank's process state, whether it changed: the caller reports it), its CPU time sampled
        (``HangWatch.sample``)."""
        seen = sample(pid) if pid else GONE
        state = seen.word
        if run.hangs is not None and pid:
            run.hangs.sample(rank, seen.cpu_ns, in_collective(sig), seen.runnable)
            state = run.hangs.process(rank, state)
        if state == run.process.get(rank, ""):
            return state, False
        run.process[rank] = state
        self._log.warning("rank process state", job=run.job_id, rank=rank, pid=pid, state=state or "running")
        return state, True

    def _report(self, run: RunState, status: pb.RankStatus) -> None:
        self._outbox.report(run.job_id, run.attempt, status)

    def _stalled(self, runs: Mapping[tuple[str, int], RunState], run: RunState, rank: int, pid: int,
                 state: str) -> None:
        """A rank's counters stopped moving: its counters now (read here) go out at once, in one report; its stack
        follows in a second (taken off the loop), so that a slow dump on a loaded node never delays the naming."""
        evidence = self._evidence(run, rank)
        self._log.info("rank stalled", job=run.job_id, rank=rank, pid=pid, state=state or "running",
                          still_s=round(run.hangs.still_for(rank), 1), computing=run.hangs.computing(rank))
        self._report(run, pb.RankStatus(rank=rank, node=self._node, process=state, collectives=evidence))
        current = lambda: runs.get((run.job_id, run.attempt)) is run  # noqa: E731
        self._background.spawn(self._send_stack(run, rank, pid, current))

    def _evidence(self, run: RunState, rank: int) -> str:
        """The rank's evidence now (its counters, read here), kept for its stall."""
        hangs = run.hangs
        evidence = hangwatch.evidence_json(read_counters(run.run_dir, rank), hangs.still_for(rank),
                                           computing=hangs.computing(rank), spinning=hangs.spinning(rank),
                                           lost=hangs.lost(rank))
        return hangs.keep(rank, evidence)[0]

    def _changed(self, run: RunState, rank: int, state: str) -> None:
        """A stalled rank began or stopped computing: its evidence again, with the stack sent for the stall."""
        evidence = self._evidence(run, rank)
        self._log.info("stalled rank changed", job=run.job_id, rank=rank, computing=run.hangs.computing(rank),
                       lost=run.hangs.lost(rank))
        self._report(run, pb.RankStatus(rank=rank, node=self._node, process=state, collectives=evidence,
                                        stack=run.hangs.keep(rank)[1]))

    async def _spins(self, pid: int, stack: str) -> bool:
        """Whether two consecutive of up to ``SPIN_LOOKS`` dumps, ``SPIN_GAP_S`` apart, show a spin
        (``hangwatch.spins``). One look can miss it on a loaded node: the spinning thread may have lent the GIL for
        that moment (CI saw an endless loop named only as computing)."""
        for _ in range(hangwatch.SPIN_LOOKS - 1):
            await asyncio.sleep(hangwatch.SPIN_GAP_S)
            if held(process_state(pid)):
                return False
            again = await hangwatch.py_spy_dump(self._py_spy, pid) if self._py_spy else ""
            if hangwatch.spins(stack, again):
                return True
            stack = again
        return False

    async def _send_stack(self, run: RunState, rank: int, pid: int, current: Callable[[], bool]) -> None:
        """The stalled rank's stack (a stopped process's too: not by SIGUSR1), sent with its newest evidence. A
        rank that computes by its CPU time is looked at again (``_spins``), ``SPIN_GAP_S`` apart: the same Python
        stack twice in a row, holding the GIL, is a spin (``hangwatch.spins``), and its evidence says so."""
        token = run.hangs.stalled(rank) if run.hangs is not None else None
        spinning = False
        try:
            async with self._stacks:
                stopped = held(process_state(pid))
                stack = await hangwatch.stack_of(pid, stopped, log_path(run.run_dir, rank), self._py_spy)
                if self._py_spy and not stopped and run.hangs is not None and run.hangs.computing(rank):
                    spinning = await self._spins(pid, stack)
        except OSError as exc:
            stack = f"no stack: {exc}"
        if rank not in run.alive or run.hangs is None or run.hangs.stalled(rank) != token or token is None \
                or not current():
            return  # it exited, or moved again meanwhile: this evidence no longer holds
        state = run.hangs.process(rank, process_state(pid))
        run.process[rank] = state  # the report carries the process state the coordinator keeps
        if spinning:
            run.hangs.spin(rank)
            self._log.warning("stalled rank spins", job=run.job_id, rank=rank, pid=pid)
            self._evidence(run, rank)
        evidence, _ = run.hangs.keep(rank, stack=stack)   # the newest evidence of this stall (a CHANGED's)
        self._report(run, pb.RankStatus(rank=rank, node=self._node, process=state, collectives=evidence,
                                        stack=stack))
