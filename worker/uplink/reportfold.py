"""One batch of a daemon's rank reports folded before it goes on the wire: a node's start-up and stop cost
the coordinator one report each, not one per rank.

Two folds, both keeping every report's meaning and the batch's sequence order:

1. A rank's *plain* reports (a phase or step of a live rank: no exit, error, result, notice, pre-flight,
   hang evidence or first step of the attempt) that a newer plain report of the same rank supersedes within
   the batch are dropped: the coordinator learns the newest phase and step at once (``starting`` ->
   ``running`` at step 1 in one report). A report that is not plain is never dropped, and nothing crosses it: a rank's order is kept.
2. Neighbouring reports (in sequence order) of consecutive ranks that say the same thing, every field but
   ``rank`` and ``update_time``, become one report with ``RankStatus.ranks`` set to how many ranks it stands
   for (``update_time``: the newest). Exits of a stop, a start-up phase, the equal steps of a node's ranks.

A folded report carries the sequence number of the newest report it replaces, so the coordinator's replay
check (``seq``) and the daemon's ``Ack`` keep working on the originals, which stay in ``ReportBuffer``.
"""

from __future__ import annotations

from rankctl.proto import rankctl_pb2 as pb

_NOT_PLAIN_FIELDS = ("notice", "preflight", "collectives", "stack", "first_step")


def _plain(rep: pb.RankReport) -> bool:
    st = rep.status
    return not (st.exited or st.error or rep.result_json or st.phase in ("failed", "done", "exited")
                or any(getattr(st, f) for f in _NOT_PLAIN_FIELDS))


def _shape(rep: pb.RankReport) -> bytes:
    """The report with its rank, time and number cleared: equal shapes say the same thing of their ranks."""
    st = pb.RankStatus()
    st.CopyFrom(rep.status)
    st.rank = 0
    st.ClearField("update_time")
    return rep.job_id.encode() + b"\0" + str(rep.attempt).encode() + b"\0" + rep.result_json.encode() + b"\0" \
        + st.SerializeToString(deterministic=True)


def fold(reports: list[pb.RankReport]) -> list[pb.RankReport]:
    """The batch folded (a new list; the reports themselves are not changed). Reports already standing for
    several ranks are passed as they are."""
    if len(reports) < 2:
        return reports
    kept: list[pb.RankReport | None] = []
    newest_plain: dict[tuple[str, int, int], int] = {}   # rank -> index in ``kept`` of its newest plain report
    for rep in reports:
        key = (rep.job_id, rep.attempt, rep.status.rank)
        if rep.status.ranks <= 1 and _plain(rep):
            i = newest_plain.get(key)
            if i is not None:
                kept[i] = None            # superseded by this one
            newest_plain[key] = len(kept)
        else:
            newest_plain.pop(key, None)   # nothing merges across a report that is not plain
        kept.append(rep)
    out: list[pb.RankReport] = []
    run: list[pb.RankReport] = []
    run_shape = b""
    for rep in kept:
        if rep is None:
            continue
        if rep.status.ranks > 1:
            _close(run, out)
            run, run_shape = [], b""
            out.append(rep)
            continue
        shape = _shape(rep)
        if run and shape == run_shape and rep.status.rank == run[-1].status.rank + 1:
            run.append(rep)
            continue
        _close(run, out)
        run, run_shape = [rep], shape
    _close(run, out)
    return out


def _close(run: list[pb.RankReport], out: list[pb.RankReport]) -> None:
    """Emit a run of same-shaped reports of consecutive ranks: as it is (one), or as one report for all."""
    if not run:
        return
    if len(run) == 1:
        out.append(run[0])
        return
    last = run[-1]
    status = pb.RankStatus()
    status.CopyFrom(last.status)
    status.rank, status.ranks = run[0].status.rank, len(run)
    newest = max(run, key=lambda r: (r.status.update_time.seconds, r.status.update_time.nanos)).status
    if newest.HasField("update_time"):
        status.update_time.CopyFrom(newest.update_time)
    out.append(pb.RankReport(job_id=last.job_id, attempt=last.attempt, status=status, result_json=last.result_json,
                             seq=max(r.seq for r in run)))
