"""Hang evidence on the node: which live rank's collective counters stopped moving, and its stack.

The daemon looks at each running rank's counter file (``contract.files.collfiles``, written by
``runtime.collectives``) and its process (``worker.runs.procstat``) every 0.1 s (``HangWatch.observe``: one
read of a 1.2 KB file, compared byte for byte, and two small reads under ``/proc``). A rank whose counters, step
and phase have not moved for its stall time is *stalled*: the daemon sends ONE report for it with
``RankStatus.collectives`` (``evidence_json``: its groups, counts, the operation it waits in, what it is busy
with, whether it computes) and ``RankStatus.stack`` (``stack_of``: ``py-spy dump --nonblocking``, which also
reads a stopped process, or the rank's faulthandler answer to SIGUSR1). When the rank moves again, one report
with ``MOVED_JSON`` withdraws the evidence; a new stall sends a new one. The coordinator judges a job hung from
that evidence (``coordinator.diagnosis.pace``, ``coordinator.diagnosis.hangs``).

The stall time adapts to the rank (``HangWatch.stall_after``): ``STALL_FACTOR`` times the median of its
recent still stretches that ended (between two movements, once it reported a step), at least
``STALL_FLOOR_S``; at most ``stall_cap(restart.hang_timeout)``
(``min(hang_timeout / 2, 30 s)``). A plain script reports no step: its counters moving ``MOVES_KNOWN`` times start
its pace instead; before a rank knows its pace, it is stalled once still for ``FIRST_STALL_S`` (a deadlock or a
laggard at the first steps is named in a second; a long first step costs one report and one stack). A rank whose
collectives come every few milliseconds sends its evidence after ~0.5 s; one whose steps are minutes of computation
between collectives, on that scale. While a stalled rank is
inside a collective its TCP sockets are looked at (``worker.runs.tcpstat``): data to a peer unheard is a cut link.

CPU time is evidence too (``sample``: the main thread's nanoseconds, with its process state): a rank whose CPU
time advanced within ``COMPUTE_S`` while it was in no collective, or that was runnable there (a starved rank
on a loaded node), *computes* (``"computing":true`` in its evidence, re-sent when that changes during a stall:
``CHANGED``): a slow or throttled rank, not a hung one. Its process is reported stopped only once it is stopped
and its CPU time has been still for ``CPU_STILL_S`` (a rank SIGSTOPped and SIGCONTed in turn, throttled as
``cpulimit`` does, keeps running); a traced one (a debugger) at once; a stopped or traced rank is stalled at
once: its evidence (its groups, the operation it is in) goes out with its stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from rankctl.contract.files import collfiles
from rankctl.contract.spec import DEFAULT_HANG_TIMEOUT_S

STALL_MAX_S = 30.0          # a rank still for this long is stalled, whatever the hang timeout
STALL_FLOOR_S = 0.5         # ... and one still for less never is
STALL_FACTOR = 3.0          # times the median of its recent still stretches
STILL_WINDOW = 32           # still stretches remembered per rank
EVIDENCE_CHARS = 4096       # RankStatus.collectives at most
STACK_CHARS = 4096          # RankStatus.stack at most
MEMBERS_SHOWN = 64          # members of the group a rank waits in (its other groups: MEMBERS_OTHER)
MEMBERS_OTHER = 8
KIND_CHARS = 64
STACK_TIMEOUT_S = 5.0       # py-spy, or the faulthandler answer, within this
SPIN_GAP_S = 0.3            # between the two stacks that tell a spin in Python from computing
SPIN_LOOKS = 3              # stacks taken at most: a spin is two consecutive ones that show it
CPU_STILL_S = 0.3           # a stopped process whose CPU time was still for this long is stopped for good
COMPUTE_S = 1.0             # CPU time advanced (or runnable) outside collectives within this: computing
MOVES_KNOWN = 4             # counter movements after which a rank that reports no step knows its own pace
FIRST_STALL_S = 1.0         # before then, a rank still this long is stalled (a deadlock or a laggard, named soon)
LOSS_LOOK_S = 0.25          # how often a rank stalled inside a collective has its TCP sockets looked at
MOVED_JSON = '{"moved":true}'  # the rank moved again: the evidence sent for its stall no longer holds
STALLED, MOVED, CHANGED = "stalled", "moved", "changed"


def stall_cap(hang_timeout: float | None) -> float:
    """The longest a rank is still before its evidence is sent (and the stall time before its first step):
    min(restart.hang_timeout / 2, 30) (its default when the job has no spec here)."""
    timeout = DEFAULT_HANG_TIMEOUT_S if hang_timeout is None else hang_timeout
    return max(0.5, min(timeout / 2, STALL_MAX_S))


def signature(run_dir: str, rank: int) -> bytes | None:
    """The raw counter file: any entered, completed or blocked change alters it (None: no file yet)."""
    try:
        with open(collfiles.counters_path(run_dir, rank), "rb") as f:
            return f.read(collfiles.FILE_BYTES)
    except OSError:
        return None


@dataclass
class _Rank:
    signature: bytes | None
    moved_at: float
    reported_at: float | None = None  # when its stall was reported (None: not stalled, or moved since)
    stepped: bool = False             # it reported a step: its still stretches count from then
    moves: int = 0                    # its counters moved this often (a plain script reports no step)
    lost: int = 0                     # its sockets losing data to a peer, at the last look (``tcpstat``)
    lost_sent: int = 0                # ... as its evidence says
    loss_looked: float = float("-inf")
    stills: deque = field(default_factory=lambda: deque(maxlen=STILL_WINDOW))
    cpu_ns: int | None = None         # its main thread's CPU time at the last look
    ran_at: float = float("-inf")     # when that last advanced
    computed_at: float = float("-inf")  # ... while it was in no collective
    computing: bool = False           # what the evidence of its current stall says
    spinning: bool = False            # its current stall: the same Python stack twice, holding the GIL
    evidence: str = ""                # the evidence of its current stall, and its stack (re-sent with a CHANGED)
    stack: str = ""


class HangWatch:
    """Per attempt on this node: when each rank last moved, how long it is usually still, and whether its
    stall was reported. ``cap``: ``stall_cap(restart.hang_timeout)``."""

    def __init__(self, cap: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self._clock = clock
        self._ranks: dict[int, _Rank] = {}

    def stall_after(self, rank: int) -> float:
        """Seconds without movement after which ``rank`` is stalled (the module docstring)."""
        r = self._ranks.get(rank)
        if r is None or not self._paced(r):
            return min(self.cap, FIRST_STALL_S)
        usual = statistics.median(r.stills) if r.stills else 0.0
        return min(self.cap, max(STALL_FLOOR_S, STALL_FACTOR * usual))

    @staticmethod
    def _paced(r: _Rank) -> bool:
        """Its still stretches count: it reported a step, or its counters moved ``MOVES_KNOWN`` times (a plain
        script's collectives are its pace)."""
        return r.stepped or r.moves >= MOVES_KNOWN

    def _moved(self, r: _Rank, now: float) -> None:
        if self._paced(r) and r.reported_at is None:   # a stall that was reported is no usual stretch
            r.stills.append(now - r.moved_at)
        r.moved_at = now
        r.moves += 1

    def touch(self, rank: int, stepped: bool = False) -> None:
        """The rank wrote a status record (a step, ``stepped``, or a phase): it moved. A rank not looked at yet
        is known from here on: a fast job's ranks may report every step they make before the stall within one
        look (0.5 s), and those steps must count (CI saw a python job whose ranks stalled at step 8 after
        0.4 s of steps judged on the 30 s cap, its evidence never sent)."""
        r = self._ranks.get(rank)
        if r is None:
            self._ranks[rank] = _Rank(None, self._clock(), stepped=stepped)
            return
        self._moved(r, self._clock())
        r.stepped = r.stepped or stepped

    def observe(self, rank: int, sig: bytes | None, stopped: bool = False) -> str:
        """One look at ``rank``'s counters: STALLED once per stall (at once when its process is ``stopped``),
        MOVED once after a reported stall, CHANGED when whether it computes changed during a reported stall,
        else ""."""
        now = self._clock()
        r = self._ranks.get(rank)
        if r is None:
            self._ranks[rank] = _Rank(sig, now)
            return ""
        if sig != r.signature:
            r.signature = sig
            self._moved(r, now)
        if r.reported_at is not None:
            if r.moved_at > r.reported_at:
                r.reported_at, r.evidence, r.stack, r.spinning = None, "", "", False
                r.lost = r.lost_sent = 0
                return MOVED
            if self.computing(rank) != r.computing:
                r.computing = not r.computing
                return CHANGED
            if bool(r.lost) != bool(r.lost_sent):
                r.lost_sent = r.lost
                return CHANGED
            return ""
        if stopped or now - r.moved_at >= self.stall_after(rank):
            r.reported_at, r.computing = now, self.computing(rank)
            return STALLED
        return ""

    # -- CPU time ---------------------------------------------------------------------------
    def sample(self, rank: int, cpu_ns: int | None, in_collective: bool, runnable: bool = False) -> None:
        """One look at the rank's main thread: its CPU time (``cpu_ns``; None: unknown), whether it is
        ``runnable`` (it wants the CPU), ``in_collective`` now."""
        now = self._clock()
        r = self._ranks.get(rank)
        if r is None:
            r = self._ranks[rank] = _Rank(None, now)
        if cpu_ns is not None and r.cpu_ns is None:
            r.ran_at = now   # the first look: stopped for good only after CPU_STILL_S more
        elif cpu_ns is not None and cpu_ns > r.cpu_ns:
            r.ran_at = now
            if not in_collective:
                r.computed_at = now
        if runnable and not in_collective:
            r.computed_at = now
        r.cpu_ns = cpu_ns if cpu_ns is not None else r.cpu_ns

    def computing(self, rank: int) -> bool:
        """Its CPU time advanced (or it was runnable) within ``COMPUTE_S`` while it was in no collective, and
        its current stall is not a spin (``spin``)."""
        r = self._ranks.get(rank)
        return r is not None and not r.spinning and self._clock() - r.computed_at < COMPUTE_S

    def spin(self, rank: int) -> None:
        """Its current stall is a spin in Python (``spins``): it computes nothing, whatever its CPU time says."""
        r = self._ranks.get(rank)
        if r is not None and r.reported_at is not None:
            r.spinning, r.computing = True, False

    def loss_due(self, rank: int) -> bool:
        """Its stall was reported and its sockets were not looked at for ``LOSS_LOOK_S`` (then they are now)."""
        r = self._ranks.get(rank)
        now = self._clock()
        if r is None or r.reported_at is None or now - r.loss_looked < LOSS_LOOK_S:
            return False
        r.loss_looked = now
        return True

    def losing(self, rank: int, sockets: int) -> None:
        """How many of its sockets lose data to a peer now (``tcpstat.unacked``): a change goes out as CHANGED."""
        r = self._ranks.get(rank)
        if r is not None:
            r.lost = sockets

    def lost(self, rank: int) -> int:
        r = self._ranks.get(rank)
        return r.lost if r is not None else 0

    def spinning(self, rank: int) -> bool:
        r = self._ranks.get(rank)
        return r is not None and r.spinning

    def process(self, rank: int, state: str) -> str:
        """The process state to report: "stopped" once stopped with its CPU time still for ``CPU_STILL_S``;
        "traced" at once."""
        r = self._ranks.get(rank)
        still = r is None or self._clock() - r.ran_at >= CPU_STILL_S
        return state if state != "stopped" or still else ""

    def keep(self, rank: int, evidence: str | None = None, stack: str | None = None) -> tuple[str, str]:
        """Keep (and answer) the evidence and stack sent for the rank's current stall."""
        r = self._ranks.get(rank)
        if r is None:
            return evidence or "", stack or ""
        r.evidence = r.evidence if evidence is None else evidence
        r.stack = r.stack if stack is None else stack
        return r.evidence, r.stack

    def still_for(self, rank: int) -> float:
        r = self._ranks.get(rank)
        return max(0.0, self._clock() - r.moved_at) if r is not None else 0.0

    def stalled(self, rank: int) -> float | None:
        """When the rank's current stall was reported (a token: evidence made for it is still good)."""
        r = self._ranks.get(rank)
        return r.reported_at if r is not None else None

    def forget(self, rank: int) -> None:
        self._ranks.pop(rank, None)


# -- the evidence ----------------------------------------------------------------------------
def evidence_json(counters: dict[str, Any] | None, still_s: float, limit: int = EVIDENCE_CHARS,
                  computing: bool = False, spinning: bool = False, lost: int = 0) -> str:
    """A rank's counters as compact JSON, at most ``limit`` characters: ``{"still_s", "computing"?, "wait_s",
    "activity"?, "groups": [{kind, members, size, entered, completed, op, since, in}]}``; the group it waits in
    comes first. ``computing``: its CPU time advances outside any collective (``HangWatch.computing``);
    ``spinning``: it spins in Python there (``HangWatch.spin``); ``lost``: its sockets losing data to a peer
    (``worker.runs.tcpstat``: a cut link)."""
    doc: dict[str, Any] = {"still_s": round(still_s, 1), **({"computing": True} if computing else {}),
                           **({"spinning": True} if spinning else {}), **({"lost": lost} if lost else {}),
                           "groups": []}
    if counters is None:
        doc["counters"] = False  # no counter file: not a torch rank, or not yet started
        return json.dumps(doc, separators=(",", ":"))
    doc["wait_s"] = round(float(counters.get("wait_s") or 0.0), 3)
    if counters.get("activity"):
        doc["activity"] = str(counters["activity"])[:KIND_CHARS]   # busy (a checkpoint ...): no hang yet
    current = counters.get("in", -1)
    groups = []
    for i, g in enumerate(counters.get("groups") or []):
        blocked = i == current
        members = list(g.get("members") or [])[: MEMBERS_SHOWN if blocked else MEMBERS_OTHER]
        groups.append({"kind": str(g.get("kind", "group"))[:KIND_CHARS], "members": members,
                       "size": int(g.get("size") or len(members)), "entered": int(g.get("entered", 0)),
                       "completed": int(g.get("completed", 0)), "op": str(g.get("op", "?")),
                       "since": round(float(g.get("since") or 0.0), 3), "in": blocked})
    # the group it waits in, then those with an operation under way, then the rest (what a cut drops)
    groups.sort(key=lambda g: (not g["in"], g["entered"] == g["completed"]))
    size = len(json.dumps(doc, separators=(",", ":"))) + 16
    kept = []
    for g in groups:
        text = json.dumps(g, separators=(",", ":"))
        if size + len(text) + 1 > limit:
            doc["more"] = len(groups) - len(kept)
            break
        kept.append(g)
        size += len(text) + 1
    doc["groups"] = kept
    return json.dumps(doc, separators=(",", ":"))


def find_py_spy() -> str | None:
    """``py-spy`` on PATH, or next to this interpreter (a virtual environment's bin)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else None


def _cut(text: str, limit: int = STACK_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def py_spy_dump(py_spy: str, pid: int, timeout: float = STACK_TIMEOUT_S) -> str:
    """``py-spy dump --nonblocking`` (reads a stopped process too; never pauses it), header dropped."""
    proc = await asyncio.create_subprocess_exec(py_spy, "dump", "--nonblocking", "--pid", str(pid),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return f"no stack: py-spy gave none within {timeout:g} s"
    if proc.returncode != 0:
        lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
        return f"no stack: py-spy failed: {lines[0][:200] if lines else f'exit {proc.returncode}'}"
    lines = out.decode(errors="replace").splitlines()
    body = [ln for ln in lines if not ln.startswith(("Process ", "Python v"))]
    return _cut("\n".join(body).strip())


def handles_sigusr1(pid: int) -> bool:
    """The process catches SIGUSR1 (the rank runtime's faulthandler): sending it cannot kill it."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)))
    except (OSError, ValueError, IndexError):
        pass
    return False


_FAULT_START = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):", re.M)


def _read_from(path: str, offset: int, limit: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


async def faulthandler_dump(pid: int, log: str, timeout: float = STACK_TIMEOUT_S) -> str:
    """SIGUSR1 to a rank whose runtime registered faulthandler on it; its answer from the rank's log."""
    if not handles_sigusr1(pid):
        return "no stack: py-spy is not installed and the process does not answer SIGUSR1"
    try:
        offset = os.path.getsize(log)
    except OSError:
        offset = 0
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError as exc:
        return f"no stack: {exc}"
    deadline, seen = time.monotonic() + timeout, -1
    text = ""
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        text = await asyncio.to_thread(_read_from, log, offset)
        if _FAULT_START.search(text) and len(text) == seen:
            break  # its answer is there and no longer growing
        seen = len(text)
    m = _FAULT_START.search(text)
    if m is None:
        return f"no stack: no faulthandler answer within {timeout:g} s"
    return _cut(text[m.start():].strip())


def _main_thread(dump: str) -> tuple[str, str] | None:
    """(its state: "active+gil" ..., its frames) of the main thread in a ``py-spy dump`` answer."""
    lines = dump.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^Thread \S+ \(([a-z+]+)\): \"MainThread\"", line)
        if m:
            frames = []
            for frame in lines[i + 1:]:
                if frame.startswith("Thread "):
                    break
                frames.append(frame)
            return m.group(1), "\n".join(frames)
    return None


def spins(first: str, second: str) -> bool:
    """Two ``py-spy dump`` answers of one rank, ``SPIN_GAP_S`` apart, say it spins in Python: its main thread
    held the GIL in both (torch's kernels release it: a rank computing in torch shows ``(active)``, one
    spinning in bytecode ``(active+gil)``) at the very same frames and lines."""
    a, b = _main_thread(first), _main_thread(second)
    return a is not None and b is not None and "gil" in a[0] and "gil" in b[0] and a[1] == b[1]


async def stack_of(pid: int, stopped: bool, log: str, py_spy: str | None) -> str:
    """The rank's Python stack now, bounded: py-spy if there is one, else faulthandler (not if stopped)."""
    if py_spy:
        return await py_spy_dump(py_spy, pid)
    if stopped:
        return "stopped, no stack (py-spy is not installed)"
    return await faulthandler_dump(pid, log)
