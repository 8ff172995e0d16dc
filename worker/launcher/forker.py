"""The launcher's loop: read commands, fork rank processes, reap them, report events.

Single-threaded on purpose: forking happens in the main thread (``PR_SET_PDEATHSIG``
follows the thread that forked), and with no other threads no lock can be held at
fork time. SIGCHLD wakes the loop through ``signal.set_wakeup_fd``. The same loop copies each
rank's output pipe into its log (``rankio``), and a rank's exit is reported only once every
process of it is gone (``contain``) and its pipe is drained.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import json
import os
import selectors
import signal
import sys
import time
import traceback
from typing import Any, Callable, NoReturn

import structlog

from rankctl.contract.files import checkpoints
from rankctl.contract.assignment import RankAssignment
from rankctl.kinds.spec import parse_spec
from rankctl.worker.launcher import contain
from rankctl.worker.files import shm
from rankctl.worker.daemon.config import cpu_share
from rankctl.worker.launcher.limits import RankLimits, Unenforceable, find_controllers
from rankctl.worker.files.shmtrack import SCAN_S, ShmTracker
from rankctl.worker.launcher.procutil import configure_logging, parse_signal, set_parent_death_signal, signal_name
from rankctl.contract.files.rankfiles import log_path
from rankctl.worker.runs.rankio import RankLog, generation_bytes, output_pipe
from rankctl.worker.runs.status import tail_lines
from rankctl.worker.launcher.warming import Warmth

log = structlog.get_logger("rankctl.launcher")
LOG_TAIL_LINES = 20
DEFAULT_GRACE_S = 10.0
LEFTOVER_GRACE_S = 3.0   # SIGTERM to a rank's leftovers, then SIGKILL after this
DRAIN_S = 5.0            # the log pipe of a rank whose processes are all gone, at most this long


@dataclasses.dataclass
class RankProc:
    assignment: RankAssignment
    pid: int
    log: str
    key: str = ""
    out: RankLog | None = None
    status: int | None = None                # the wait status, once the rank's own process exited
    leftovers: set[int] = dataclasses.field(default_factory=set)
    kill_at: float = 0.0                     # when the leftovers get SIGKILL
    drain_until: float = 0.0


class Forker:
    """Serves the launcher protocol (see ``rankctl.worker.launcher.main``) on stdin / ``event_fd``."""

    def __init__(self, event_fd: int, stdin_fd: int = 0, containment: str = "auto", shm_mode: str = "auto",
                 idle_warm: bool = True) -> None:
        self.event_fd = event_fd
        self.stdin_fd = stdin_fd
        self.procs: dict[int, RankProc] = {}
        self._deadlines: list[tuple[float, int]] = []  # (when, pid): SIGKILL if still running
        self._buf = b""
        self._stopping = False
        self.ending: dict[int, RankProc] = {}    # ranks that exited, until every process of theirs is gone
        self.contain, self.containment = contain.choose(os.getpid(), containment)
        self.limits = find_controllers(os.getpid(), getattr(self.contain, "base", None))
        self.containment += "; " + self.limits.describe()
        self.private_shm, self.shm_track, how = _shm_mode(shm_mode)
        self.containment += "; /dev/shm: " + how
        self._next_scan = 0.0
        self._sel: selectors.BaseSelector | None = None
        self.warmth = Warmth()          # kinds whose warm hook ran (JobKind.warm)
        self._idle_warm = idle_warm     # the first idle second with no rank alive warms every kind

    # -- events ---------------------------------------------------------------
    def emit(self, event: dict[str, Any]) -> None:
        data = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()
        while data:
            data = data[os.write(self.event_fd, data):]

    # -- loop -----------------------------------------------------------------
    def serve(self) -> int:
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        sel = self._sel = selectors.DefaultSelector()
        sel.register(self.stdin_fd, selectors.EVENT_READ, "stdin")
        sel.register(wake_r, selectors.EVENT_READ, "wake")
        while not self._stopping:
            ready = sel.select(self._timeout())
            if not ready and self._idle_warm and not self.procs:
                self._idle_warm = False
                self.warmth.all()
            for key, _ in ready:
                if key.data == "wake":
                    _drain(wake_r)
                elif key.data == "stdin":
                    self._read_commands()
                else:
                    self._pump(key.data)
            self._reap()
            self._expire()
            self._finish()
            self._scan_shm()
        sel.close()
        self.limits.close()
        self.contain.close()
        self.emit({"event": "shutdown"})
        return 0

    def _timeout(self) -> float:
        if self.ending:
            return 0.05
        if not self._deadlines:
            return 1.0
        return max(0.0, min(1.0, self._deadlines[0][0] - time.monotonic()))

    def _read_commands(self) -> None:
        chunk = os.read(self.stdin_fd, 1 << 16)
        if not chunk:  # the daemon closed our stdin: it is gone or done with us
            self.shutdown(grace_s=5.0)
            return
        lines = (self._buf + chunk).split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if line.strip():
                self._handle(line)

    def _handle(self, line: bytes) -> None:
        try:
            cmd = json.loads(line)
            name = cmd.get("cmd")
            if name == "launch":
                self.launch([a for doc in cmd["assignments"] if (a := read_assignment(doc, self.emit)) is not None],
                            timeout_s=cmd.get("timeout_s"), threads=cmd.get("threads"),
                            log_bytes=cmd.get("log_bytes"))
            elif name == "kill":
                self.kill(cmd["job_id"], attempt=cmd.get("attempt"), sig=parse_signal(cmd.get("signal")),
                          grace_s=float(cmd.get("grace_s", DEFAULT_GRACE_S)))
            elif name == "shutdown":
                self.shutdown(grace_s=float(cmd.get("grace_s", 5.0)))
            else:
                raise ValueError(f"unknown command {name!r}; commands are launch, kill, shutdown")
        except Exception as exc:  # noqa: BLE001 - a bad command must not stop the launcher
            self.emit({"event": "error", "message": f"{type(exc).__name__}: {exc}",
                       "command": line[:500].decode("utf-8", "replace")})

    # -- commands -------------------------------------------------------------
    def launch(self, assignments: list[RankAssignment], *, timeout_s: float | None = None,
               threads: int | None = None, log_bytes: int | None = None) -> None:
        """Fork one rank process per assignment and report ``started`` for each."""
        self.warmth.kinds(a.kind for a in assignments)
        threads = threads or cpu_share(len(assignments))   # the daemon says its node's share per slot
        generation = generation_bytes(len(assignments), **({"cap": log_bytes} if log_bytes else {}))
        running = {(p.assignment.job_id, p.assignment.attempt, p.assignment.rank) for p in self.procs.values()}
        for a in assignments:
            if (a.job_id, a.attempt, a.rank) in running:
                msg = f"rank {a.rank} of {a.job_id} attempt {a.attempt} is already running"
                self.emit({"event": "error", "message": msg})
                continue
            try:
                proc = self._fork(a, threads, timeout_s, generation)
            except Unenforceable as exc:  # the job file asks for a limit this node cannot set
                self.emit(_exited(a, None, None, None, [], str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - report it as this rank's end
                self.emit(_exited(a, None, None, None, [], f"launch failed: {type(exc).__name__}: {exc}"))
                continue
            self.procs[proc.pid] = proc
            self.emit({"event": "started", "job_id": a.job_id, "attempt": a.attempt, "rank": a.rank, "pid": proc.pid})

    def _fork(self, a: RankAssignment, threads: int, timeout_s: float | None, generation: int) -> RankProc:
        run_dir = a.run_dir or os.path.join("/tmp", "rankctl", a.job_id, str(a.attempt))
        if not a.run_dir:
            a = dataclasses.replace(a, run_dir=run_dir)
        os.makedirs(run_dir, exist_ok=True)
        log = log_path(run_dir, a.rank)
        key = f"{a.job_id}.{a.attempt}.{a.rank}"
        self.contain.prepare(key)
        try:
            limit_dirs = self.limits.prepare(key, RankLimits.of(a.spec.resources))
        except OSError:
            self.limits.release(key)
            self.contain.release(key)
            raise
        private = self.private_shm and bool(shm.mount_job_shm(run_dir, a.spec.resources.shm_mb))
        if self.shm_track is not None:
            self.shm_track.started((a.job_id, a.attempt))
        read_fd, write_fd = output_pipe(f"{log}.out")
        try:
            out = RankLog(log, read_fd, generation)
        except OSError:
            os.close(read_fd)
            os.close(write_fd)
            raise
        parent = os.getpid()
        try:
            pid = os.fork()
            if pid == 0:
                _child(a, write_fd, parent, threads, timeout_s, lambda: self._enter(key, run_dir, private, limit_dirs))
        except BaseException:
            out.close()
            raise
        finally:
            os.close(write_fd)
        proc = RankProc(assignment=a, pid=pid, log=log, key=key, out=out)
        if self._sel is not None:
            self._sel.register(read_fd, selectors.EVENT_READ, proc)
        return proc

    def _enter(self, key: str, run_dir: str, private_shm: bool, limit_dirs: list[str]) -> None:
        """In the forked rank: into its containment and limits, and onto its job's own /dev/shm."""
        self.contain.enter(key)
        self.limits.enter(limit_dirs)
        if private_shm:
            shm.enter_private_shm(run_dir)

    def _pump(self, proc: RankProc) -> None:
        """Copy a rank's output into its log; at EOF stop watching the pipe."""
        if proc.out is not None and not proc.out.pump():
            self._close_output(proc)

    def _close_output(self, proc: RankProc) -> None:
        if proc.out is None:
            return
        if self._sel is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(proc.out.fd)
        proc.out.close()
        proc.out = None

    def kill(self, job_id: str, *, attempt: int | None = None, sig: int = signal.SIGTERM,
             grace_s: float = DEFAULT_GRACE_S) -> list[int]:
        """Signal every rank of a job (its whole process group); SIGKILL after ``grace_s``."""
        pids = [pid for pid, p in self.procs.items()
                if p.assignment.job_id == job_id and attempt in (None, p.assignment.attempt)]
        for pid in pids:
            _killpg(pid, sig)
            if sig != signal.SIGKILL:
                heapq.heappush(self._deadlines, (time.monotonic() + grace_s, pid))
        return pids

    def shutdown(self, *, grace_s: float) -> None:
        """Stop every rank (SIGTERM, then SIGKILL after ``grace_s``), reap them all, then stop."""
        for pid in list(self.procs):
            _killpg(pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while self.procs and time.monotonic() < end:
            self._reap()
            time.sleep(0.02)
        for pid in list(self.procs):
            _killpg(pid, signal.SIGKILL)
        while self.procs:
            self._reap(block=True)
        while self.ending:
            self._finish(now=time.monotonic() + LEFTOVER_GRACE_S)  # no more grace: SIGKILL at once
            self._reap()
            time.sleep(0.02)
        self._stopping = True

    # -- children -------------------------------------------------------------
    def _reap(self, block: bool = False) -> None:
        """Reap every child that exited: ranks, and the leftovers the launcher adopted (subreaper)."""
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            proc = self.procs.pop(pid, None)
            if proc is None:
                continue  # a leftover the launcher adopted, or a rank's helper
            proc.status = status
            self.contain.adopt(proc.key, set(self.procs))
            self.ending[pid] = proc
            block = False

    def _finish(self, now: float | None = None) -> None:
        """Ranks that exited: end their leftovers (SIGTERM, SIGKILL after a grace), drain their log,
        then report the exit, with how many leftovers had to be killed."""
        now = time.monotonic() if now is None else now
        for pid, proc in list(self.ending.items()):
            members = [p for p in self.contain.members(proc.key) if p != pid]
            if members:
                if not proc.leftovers:
                    proc.kill_at = now + LEFTOVER_GRACE_S
                    contain.signal_all(members, signal.SIGTERM)
                elif now >= proc.kill_at:
                    self.contain.kill(proc.key, members)
                proc.leftovers.update(members)
                self.contain.adopt(proc.key, set(self.procs))
                continue
            if proc.out is not None:
                proc.drain_until = proc.drain_until or now + DRAIN_S
                if proc.out.pump() and now < proc.drain_until:
                    continue  # a writer we cannot see still holds the pipe: wait a little
                self._close_output(proc)
            self._report_exit(self.ending.pop(pid))

    def _report_exit(self, proc: RankProc) -> None:
        notes = self._oom_notes(proc)
        self.limits.release(proc.key)
        self.contain.release(proc.key)
        a = proc.assignment
        if not any((p.assignment.job_id, p.assignment.attempt) == (a.job_id, a.attempt)
                   for p in (*self.procs.values(), *self.ending.values())):  # the attempt's last process here
            if self.private_shm:
                shm.unmount_job_shm(a.run_dir)
            elif self.shm_track is not None:
                removed = self.shm_track.ended((a.job_id, a.attempt))
                if removed:
                    log.info("removed what the job left in /dev/shm", job=a.job_id, attempt=a.attempt, paths=removed)
        code = os.waitstatus_to_exitcode(proc.status or 0)
        sig = signal_name(-code) if code < 0 else None
        event = _exited(proc.assignment, proc.pid, code if code >= 0 else None, sig,
                        tail_lines(proc.log, LOG_TAIL_LINES))
        event["leftovers_killed"] = len(proc.leftovers)
        event["notes"] = notes
        self.emit(event)

    def _oom_notes(self, proc: RankProc) -> list[str]:
        kills = self.limits.oom_kills(proc.key)
        if not kills:
            return []
        limit = RankLimits.of(proc.assignment.spec.resources)
        return [f"the kernel's OOM killer ended {kills} process(es) of rank {proc.assignment.rank} "
                f"at its memory limit ({limit.describe('memory')})"]

    def _scan_shm(self) -> None:
        """Tracked /dev/shm: what each running rank's processes hold now is its attempt's."""
        now = time.monotonic()
        if self.shm_track is None or now < self._next_scan:
            return
        self._next_scan = now + SCAN_S
        for pid, proc in self.procs.items():
            a = proc.assignment
            self.shm_track.scan((a.job_id, a.attempt), self.contain.processes(proc.key, pid))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, pid = heapq.heappop(self._deadlines)
            if pid in self.procs:
                _killpg(pid, signal.SIGKILL)


def read_assignment(doc: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> RankAssignment | None:
    """The launcher's one validation of an assignment's spec; one it cannot read is that rank's end (``emit``)."""
    try:
        return RankAssignment.from_doc(doc, parse_spec)
    except Exception as exc:  # noqa: BLE001 - reported against the rank, the others still start
        emit({"event": "exited", "job_id": doc.get("job_id"), "attempt": doc.get("attempt"), "rank": doc.get("rank"),
              "pid": None, "exit_code": None, "signal": None, "log_tail": [],
              "error": f"launch failed: the assignment does not parse here: {str(exc)[:500]}"})
        return None


def _shm_mode(mode: str) -> tuple[bool, ShmTracker | None, str]:
    """(private tmpfs per attempt?, the tracker otherwise, how, for the start-up line)."""
    if mode not in shm.SHM_MODES:
        raise ValueError(f"shm {mode!r} is not one of {', '.join(shm.SHM_MODES)}")
    can = mode != "tracked" and shm.can_mount(f"/tmp/rankctl-shm-probe-{os.getpid()}")
    if mode == "private" and not can:
        raise OSError("shm private: this launcher may not mount a tmpfs")
    if can:
        return True, None, "a tmpfs per job attempt"
    why = "asked for" if mode == "tracked" else "mounts refused"
    return False, ShmTracker(checkpoints.SHM), f"the host's, what each job creates tracked and removed ({why})"


def _exited(a: RankAssignment, pid: int | None, code: int | None, sig: str | None,
            tail: list[str], error: str | None = None) -> dict[str, Any]:
    return {"event": "exited", "job_id": a.job_id, "attempt": a.attempt, "rank": a.rank, "pid": pid,
            "exit_code": code, "signal": sig, "log_tail": tail, "error": error}


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _isolate(log_fd: int, parent: int, enter: Callable[[], None]) -> None:
    """In the child: contained, own session, die with the launcher, fds 0/1/2 = /dev/null, log, log."""
    enter()
    os.setsid()
    set_parent_death_signal(signal.SIGKILL, expected_parent=parent)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for name in os.listdir("/proc/self/fd"):  # the event pipe, stdin pipe, wake pipe, ...
        if int(name) > 2:
            try:
                os.close(int(name))
            except OSError:
                pass
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _child(a: RankAssignment, log_fd: int, parent: int, threads: int, timeout_s: float | None,
           enter: Callable[[], None]) -> NoReturn:
    """Body of a forked rank process; never returns."""
    code = 1
    try:
        gc.freeze()  # objects inherited from the launcher are never collected (no stray fd closes)
        _isolate(log_fd, parent, enter)
        configure_logging(sys.stderr, stdlib=False)  # the user's own logging.basicConfig() must work in a rank
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)
        from rankctl.runtime.rank import run_rank

        code = run_rank(a, timeout_s=timeout_s)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
