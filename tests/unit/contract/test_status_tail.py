"""A failed rank's reason quotes what its program printed last, never rankctl's own records (issue 23)."""

from pathlib import Path

from rankctl.contract.files.logrecords import RECORD_MARK
from rankctl.worker.runs.status import tail_lines


def test_the_tail_of_a_rank_log_leaves_out_rankctl_records(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text("epoch 1\n" + RECORD_MARK + '{"event": "step", "step": 3}\n'
                   + "Traceback (most recent call last):\r\n" + "ValueError: bad batch\n"
                   + RECORD_MARK + '{"event": "rank failed"}\n')
    assert tail_lines(str(log), 2) == ["Traceback (most recent call last):", "ValueError: bad batch"]
    assert tail_lines(str(log), 10) == ["epoch 1", "Traceback (most recent call last):", "ValueError: bad batch"]


def test_a_missing_log_has_no_tail(tmp_path: Path) -> None:
    assert tail_lines(str(tmp_path / "none.log")) == []
