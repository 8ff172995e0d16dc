"""The daemon's numbered rank reports, from the moment they are made until the coordinator has stored them.

Every report gets the next sequence number of this daemon. ``take`` hands the unsent ones to
the writer (one ReportBatch per tick); ``acked`` forgets those the coordinator says it stored
(``Ack``, or ``Registered.last_seq`` after a reconnect); ``rewind`` makes everything not yet
stored unsent again for a new session (the replay).

A *step* report (a running rank's next step: no phase change, exit, error or result) replaces
the same rank's previous step report if that one is not yet stored, so that a backlog (a slow
link, a coordinator away) holds the newest step per rank and never a queue of old ones. Phase
changes, exits and errors are never dropped while the buffer is within ``maxlen``; beyond
it, the oldest reports go (and a coordinator away that long will find the ranks' final state
in the newest ones).

``urgent`` says that an unsent report is more than a step (a phase change, an exit, an error): the
daemon's writer sends those at once and lets only step reports wait for the next tick.
"""

from __future__ import annotations

from collections import OrderedDict

from rankctl.proto import rankctl_pb2 as pb

Key = tuple[str, int, int]  # job, attempt, rank


class ReportBuffer:
    def __init__(self, maxlen: int = 200_000) -> None:
        self.maxlen = maxlen
        self.seq = 0
        self._sent: OrderedDict[int, pb.RankReport] = OrderedDict()    # on the wire, not yet acknowledged
        self._unsent: OrderedDict[int, pb.RankReport] = OrderedDict()
        self._step: dict[Key, int] = {}                                 # rank -> seq of its pending step report
        self.coalesced = 0                                              # step reports replaced by newer ones
        self.dropped = 0                                                # reports dropped over maxlen
        self.urgent = False                                             # an unsent report is not a step

    def __len__(self) -> int:
        return len(self._sent) + len(self._unsent)

    @property
    def unsent(self) -> int:
        return len(self._unsent)

    def add(self, job_id: str, attempt: int, status: pb.RankStatus, result_json: str = "", *,
            step_only: bool = False) -> pb.RankReport:
        """Number and keep one report; ``step_only`` lets it replace the rank's previous step report."""
        self.seq += 1
        key = (job_id, attempt, status.rank)
        old = self._step.pop(key, None)
        if old is not None and step_only:
            if self._unsent.pop(old, None) is not None or self._sent.pop(old, None) is not None:
                self.coalesced += 1
        if step_only:
            self._step[key] = self.seq
        else:
            self.urgent = True
        rep = pb.RankReport(job_id=job_id, attempt=attempt, status=status, result_json=result_json, seq=self.seq)
        self._unsent[self.seq] = rep
        while len(self) > self.maxlen:
            self.dropped += 1
            (self._sent or self._unsent).popitem(last=False)
        return rep

    def take(self, limit: int) -> list[pb.RankReport]:
        """Up to ``limit`` unsent reports, oldest first, now counted as sent."""
        out = []
        while self._unsent and len(out) < limit:
            seq, rep = self._unsent.popitem(last=False)
            self._sent[seq] = rep
            out.append(rep)
        self.urgent = self.urgent and bool(self._unsent)  # what is left may hold one; at worst a batch early
        return out

    def acked(self, last_seq: int) -> None:
        """Forget every report numbered up to ``last_seq`` (the coordinator stored them)."""
        for queue in (self._sent, self._unsent):
            while queue and next(iter(queue)) <= last_seq:
                queue.popitem(last=False)

    def rewind(self, last_seq: int) -> int:
        """A new session: forget what is stored, make the rest unsent again; how many will be replayed."""
        self.acked(last_seq)
        if self._sent:
            merged = self._sent
            merged.update(self._unsent)
            self._sent, self._unsent = OrderedDict(), merged
        self.urgent = bool(self._unsent)  # a replay goes out at once
        return len(self._unsent)
