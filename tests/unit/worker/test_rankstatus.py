"""A rank's status record: its line is the file format, read back whole, converted once to the wire."""

from __future__ import annotations

import json

from rankctl.contract.files.rankstatus import RankStatusRecord
from rankctl.runtime.status import StatusWriter
from rankctl.worker.uplink.reporting import to_wire
from rankctl.worker.runs.status import read_status


class Counters:
    wait_total = 0.0


def test_the_writer_writes_the_lines_the_file_format_says(tmp_path) -> None:
    counters, now = Counters(), iter([1.0, 2.0, 3.5, 4.0])
    writer = StatusWriter(str(tmp_path), 3, clock=lambda: next(now), counters=counters)
    writer.write("running")
    counters.wait_total = 0.25
    writer.write("running", step=1, metrics={"loss": 2.5})
    writer.write("done", result={"rounds": 2})
    writer.write("failed", error="ValueError: x", traceback=["Traceback (most recent call last):", "ValueError: x"])
    writer.close()
    assert (tmp_path / "rank-3.status.jsonl").read_text().splitlines() == [
        '{"ts":1.0,"rank":3,"phase":"running","step":null,"metrics":{},"error":null,"result":null}',
        '{"ts":2.0,"rank":3,"phase":"running","step":1,"metrics":{"loss":2.5},"error":null,"result":null,'
        '"wait_s":0.25,"compute_s":0.75}',
        '{"ts":3.5,"rank":3,"phase":"done","step":null,"metrics":{},"error":null,"result":{"rounds":2}}',
        '{"ts":4.0,"rank":3,"phase":"failed","step":null,"metrics":{},"error":"ValueError: x","result":null,'
        '"traceback":["Traceback (most recent call last):","ValueError: x"]}',
    ]


def test_a_record_survives_its_line(tmp_path) -> None:
    writer = StatusWriter(str(tmp_path), 0, clock=lambda: 7.0)
    written = [writer.write("groups"), writer.write("running", step=4, metrics={"loss": 1.5, "tokens_per_s": 9}),
               writer.write("failed", error="E", traceback=["a", "b"])]
    writer.close()
    assert read_status(str(tmp_path), 0) == written
    assert all(RankStatusRecord.from_line(r.to_line(), 0) == r for r in written)


def test_a_line_of_another_shape_is_a_record_that_says_so() -> None:
    junk = RankStatusRecord.from_line("x" * 500, 2)
    assert junk.rank == 2 and junk.phase is None and junk.error == "unparseable status line: " + "x" * 200
    assert RankStatusRecord.from_line("[1, 2]", 2).phase is None
    odd = RankStatusRecord.from_line(json.dumps({"rank": 9, "phase": 5, "step": "12", "ts": True, "metrics": [1],
                                                 "error": 3, "wait_s": 1e400, "traceback": "one"}), 2)
    assert (odd.rank, odd.phase, odd.step, odd.ts, odd.metrics, odd.error, odd.traceback) == (
        2, "5", None, None, {}, "3", ("one",))   # the file, not the line, says whose record it is
    assert RankStatusRecord.from_line('{"phase": "running", "step": 1e300}', 0).step is None


def test_the_one_conversion_to_the_wire() -> None:
    rec = RankStatusRecord(rank=1, phase="running", ts=1712.5, step=3, wait_s=0.5, compute_s=1.5,
                           metrics={"loss": 2.0, "step_time": 0.25, "lr": 0.1, "tokens_per_s": True})
    status, result = to_wire(rec, "n0")
    assert (status.rank, status.node, status.phase, status.step, result) == (1, "n0", "running", 3, "")
    assert json.loads(status.metrics_json) == rec.metrics and status.update_time.ToNanoseconds() == 1712500000000
    assert (status.step_time_s, status.wait_s, status.compute_s) == (0.25, 0.5, 1.5)
    assert dict(status.figures) == {"loss": 2.0, "lr": 0.1}        # numbers only; the step time is typed
    failed, _ = to_wire(RankStatusRecord(rank=1, phase="failed", error="E: x", traceback=("tb 1", "E: x")), "n0")
    assert failed.error == "E: x\ntb 1\nE: x" and not failed.HasField("update_time")
    done, result = to_wire(RankStatusRecord(rank=1, phase="done", result={"ok": 1}), "n0")
    assert json.loads(result) == {"ok": 1} and not done.HasField("compute_s")
    assert to_wire(RankStatusRecord.from_line("junk", 4), "n0")[0].phase == "unknown"
    huge = RankStatusRecord.from_line('{"phase": "running", "step": 2, "metrics": {"loss": 1.5, "big": 1%s, '
                                      '"step_time": 1%s}}' % ("0" * 400, "0" * 400), 3)
    status, _ = to_wire(huge, "n0")     # an integer past float's range is no figure (it raised OverflowError)
    assert dict(status.figures) == {"loss": 1.5} and not status.HasField("step_time_s")
