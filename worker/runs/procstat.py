"""A rank's process as the kernel shows it: its state and its main thread's CPU time, from ``/proc``.

``sample`` reads ``/proc/PID/task/PID/stat`` (the state letter) and ``/proc/PID/task/PID/schedstat`` (the
nanoseconds the main thread ran: precise where ``stat``'s clock ticks are 10 ms, so a throttled rank that runs a
millisecond in a hundred is seen to run); the main thread's own, since a torch process's helper threads (gloo,
NCCL's proxy) spin while it waits. The state the daemon reports (``Sample.word``):

* ``"stopped"``: job-control stop (``T``: SIGSTOP, SIGTSTP, a suspend);
* ``"traced"``: stopped by a tracer (``t``: gdb, a checkpoint/restore tool): a person or a tool holds it;
* ``""``: anything else (running, runnable, asleep, in uninterruptible sleep), or gone.

``runnable`` (``R``): it wants the CPU; a starved rank on a loaded node is not a blocked one.
"""

from __future__ import annotations

from dataclasses import dataclass

STOPPED, TRACED = "stopped", "traced"


@dataclass(frozen=True)
class Sample:
    word: str              # STOPPED, TRACED or ""
    runnable: bool         # state R
    cpu_ns: int | None     # the main thread's CPU time so far (None: gone, or unreadable)


GONE = Sample("", False, None)


def sample(pid: int) -> Sample:
    """One look at ``pid``'s main thread: two small reads, never blocking."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as f:
            data = f.read(1024)
    except OSError:
        return GONE
    letter = data[data.rfind(b")") + 2:][:1]   # after "(comm)", which may itself hold ")"
    word = STOPPED if letter == b"T" else TRACED if letter == b"t" else ""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat", "rb") as f:
            cpu: int | None = int(f.read(128).split()[0])
    except (OSError, ValueError, IndexError):
        cpu = None
    return Sample(word, letter == b"R", cpu)


def process_state(pid: int) -> str:
    """The word the daemon reports for ``pid`` (``Sample.word``)."""
    return sample(pid).word


def held(word: str) -> bool:
    """Stopped or traced: the process runs no code of its own."""
    return word in (STOPPED, TRACED)
