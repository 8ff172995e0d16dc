"""What failed an attempt, as typed data: its cause, the rank and node it came from, its exit code and step.

A rank's English error is read once, here (``rank_fault``), into a ``Fault``; the rules that decide whom an
attempt's failure is blamed on and what follows are read from its cause, never from its words again:

- a node's loss outranks the errors of its victims (the other ranks' broken collectives): ``outranks``;
- only a node's own fault (its rank's own error or signal, its loss, its full disk) is blamed on it, so only that
  can exclude it for the job (``blames_node``); a victim's error never does;
- a full disk is the node's fault at once: the next attempt runs off that node (``moves_off_node``) and it is no
  failure that repeats the same way wherever the job runs (``repeatable``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from rankctl.contract.files.diskspace import DISK_FULL
from rankctl.coordinator.model.records import RankRecord


class Cause(str, Enum):
    NODE_LOST = "node-lost"          # the node's stream closed or its heartbeats stopped
    NODE_BACK = "node-back-without"  # the node reconnected without the attempt's ranks
    RANK_EXIT = "rank-exit"          # a rank failed with its own error, or was killed by a signal
    PEER_ERROR = "peer-error"        # a rank's error says a peer failed (a broken collective): a victim
    DISK_FULL = "disk-full"          # a rank's write found its node's file system full (ENOSPC, EDQUOT)
    HANG = "hang"                    # no rank advanced for long enough
    OTHER = "other"                  # a pre-flight, an allocation's end: named by its reason


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One attempt's failure: ``reason`` is what users read; the rest is what rules decide on."""

    cause: Cause
    reason: str
    node: str = ""
    rank: int | None = None
    code: int | None = None
    step: int | None = None

    @property
    def blames_node(self) -> bool:
        """The node it came from is at fault (stored as the attempt's ``blamed``; twice in a row excludes it)."""
        return bool(self.node) and self.cause in (Cause.NODE_LOST, Cause.NODE_BACK, Cause.RANK_EXIT, Cause.DISK_FULL)

    @property
    def moves_off_node(self) -> bool:
        """The next attempt must not run on its node (excluded for the job at once)."""
        return bool(self.node) and self.cause is Cause.DISK_FULL

    @property
    def repeatable(self) -> bool:
        """A failure that may repeat the same way at the same step wherever the job runs (``same_way``)."""
        return self.cause in (Cause.RANK_EXIT, Cause.PEER_ERROR, Cause.HANG)


def outranks(a: Fault, b: Fault) -> bool:
    """``a`` is the likelier cause of an attempt's failure than ``b``: a node's loss over anything a rank said, a
    rank's own fault over a victim's error."""
    order = {Cause.NODE_LOST: 0, Cause.NODE_BACK: 0, Cause.DISK_FULL: 1, Cause.RANK_EXIT: 1, Cause.HANG: 2,
             Cause.OTHER: 2, Cause.PEER_ERROR: 3}
    return order[a.cause] < order[b.cause]


@dataclass(frozen=True)
class Failed:
    """A job's last failed attempt: its number, fault, the step ``same_way`` compares (None: not repeatable), when
    it failed and the nodes it ran on."""

    attempt: int
    fault: Fault
    step: int | None
    at: float
    nodes: tuple[str, ...]


def reattributed(last: Failed | None, node: str, detail: str, last_heard: float) -> Fault | None:
    """Node ``node`` was lost (``detail``), last heard from at ``last_heard``: the loss that ``last`` (a victim's
    error, a hang) followed from, when ``node`` ran in that attempt and fell silent before it failed; else None."""
    if last is None or last.fault.cause not in (Cause.PEER_ERROR, Cause.HANG) or node not in last.nodes:
        return None
    if last.fault.node == node or last_heard > last.at:
        return None
    return Fault(cause=Cause.NODE_LOST, node=node,
                 reason=f"node {node} lost ({detail}); before it: {last.fault.reason}")


def last_error_line(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return lines[-1] if lines else "no error reported"


# what a rank prints when a peer's failure broke its collective (gloo, NCCL, torch.distributed): a consequence
_PEER_FAILURE = re.compile(r"closed by peer|reset by peer|broken pipe|remote process exited|communicator was aborted|"
                           r"ncclRemoteError|DistNetworkError|DistBackendError|timed out", re.IGNORECASE)
_DISK_FULL = re.compile(rf"\[Errno ({'|'.join(map(str, DISK_FULL))})\]|No space left on device|Disk quota exceeded")


def rank_fault(r: RankRecord) -> Fault:
    """The fault a failed rank's record says: killed by a signal or its own error (``RANK_EXIT``), a full disk
    (``DISK_FULL``), or a peer's failure it saw (``PEER_ERROR``)."""
    line = last_error_line(r.error)
    reason = f"rank {r.rank} on node {r.node} exited with code {r.exit_code}: {line}"
    if r.exit_code < 0:
        cause = Cause.RANK_EXIT
    elif _DISK_FULL.search(line):
        cause = Cause.DISK_FULL
    else:
        cause = Cause.PEER_ERROR if _PEER_FAILURE.search(line) else Cause.RANK_EXIT
    return Fault(cause=cause, reason=reason, node=r.node, rank=r.rank, code=r.exit_code, step=r.step)
