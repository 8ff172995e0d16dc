"""What failed an attempt, as typed data: its cause, the rank and node it came from, its exit code and step.

A rank's English error is read once (``rank_fault``, with ``coordinator.model.errortext``, the one reader of a
rank's words) into a ``Fault``; the rules that decide whom an
attempt's failure is blamed on and what follows are read from its cause, never from its words again:

- a node's loss outranks the errors of its victims (the other ranks' broken collectives): ``outranks``;
- only a node's own fault (its rank's own error or signal, its loss, its full disk) is blamed on it, so only that
  can exclude it for the job (``blames_node``); a victim's error never does;
- a full disk is the node's fault at once: the next attempt runs off that node (``moves_off_node``) and it is no
  failure that repeats the same way wherever the job runs (``repeatable``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from rankctl.coordinator.model.errortext import ErrorText, last_error_line, read_error
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
    detail: str = ""     # a rank's last error line: what "the same way" compares (wherever the rank ran)

    def to_json(self) -> str:
        """The fault as stored with its attempt (``attempts.fault_json``): it survives a restart and a failover."""
        return json.dumps({"cause": self.cause.value, "reason": self.reason, "node": self.node, "rank": self.rank,
                           "code": self.code, "step": self.step, "detail": self.detail}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Fault | None":
        """A stored fault; None for none, or one this code cannot read (an older or newer coordinator's)."""
        try:
            d = json.loads(text) if text else None
            return None if not isinstance(d, dict) else cls(
                cause=Cause(d["cause"]), reason=str(d["reason"]), node=str(d.get("node") or ""), rank=d.get("rank"),
                code=d.get("code"), step=d.get("step"), detail=str(d.get("detail") or ""))
        except (ValueError, KeyError, TypeError):
            return None

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


def same_way(a: Fault, b: Fault) -> bool:
    """Two attempts failed the same way: both repeatable failures of one cause at the same known step, and either
    both hangs judged the same way (``detail``: the verdict's kind) or the same rank's exit with the same code and last error line (wherever it ran)."""
    if not (a.repeatable and b.repeatable) or a.cause is not b.cause or a.step is None or a.step != b.step:
        return False
    return (a.cause is Cause.HANG and a.detail == b.detail) or (a.rank == b.rank and a.code == b.code and a.detail == b.detail)


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


def rank_fault(r: RankRecord) -> Fault:
    """The fault a failed rank's record says: killed by a signal or its own error (``RANK_EXIT``), a full disk
    (``DISK_FULL``), or a peer's failure it saw (``PEER_ERROR``)."""
    line = last_error_line(r.error)
    reason = f"rank {r.rank} on node {r.node} exited with code {r.exit_code}: {line}"
    if r.exit_code < 0:
        cause = Cause.RANK_EXIT
    else:
        cause = {ErrorText.DISK_FULL: Cause.DISK_FULL, ErrorText.PEER: Cause.PEER_ERROR}.get(read_error(line),
                                                                                            Cause.RANK_EXIT)
    return Fault(cause=cause, reason=reason, node=r.node, rank=r.rank, code=r.exit_code, step=r.step, detail=line)
