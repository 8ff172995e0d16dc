"""Unit tests of cli.view.logview: ``ctl logs`` lines and rankctl's records, as JSON documents and for people."""

from __future__ import annotations

import json

from rankctl.cli.view.logview import CONTEXT_KEYS, line_doc, line_text, record_text
from rankctl.contract.files.logrecords import RECORD_MARK


def _record(**fields: object) -> str:
    return RECORD_MARK + json.dumps(fields)


def test_line_doc_of_a_printed_line_holds_it_as_it_is() -> None:
    assert line_doc(3, 2, "loss 1.0") == {"rank": 3, "attempt": 2, "line": "loss 1.0"}


def test_line_doc_of_a_record_holds_its_object_and_no_line() -> None:
    doc = line_doc(0, 1, _record(event="ckpt.saved", step=40))
    assert doc == {"rank": 0, "attempt": 1, "record": {"event": "ckpt.saved", "step": 40}}


def test_line_doc_of_a_record_cut_too_short_to_parse_keeps_its_text_without_the_mark() -> None:
    cut = RECORD_MARK + '{"event": "ckpt.sav'
    assert line_doc(1, 1, cut) == {"rank": 1, "attempt": 1, "record": None, "line": '{"event": "ckpt.sav'}


def test_line_doc_of_a_record_that_is_no_object_keeps_its_text() -> None:
    assert line_doc(1, 1, RECORD_MARK + "[1, 2]") == {"rank": 1, "attempt": 1, "record": None, "line": "[1, 2]"}


def test_record_text_shows_time_level_and_event_then_its_own_fields_only() -> None:
    record = {"timestamp": "12:00:01", "level": "warning", "event": "ckpt.slow", "job": "j", "rank": 3,
              "attempt": 1, "node": "n0", "logger": "rankctl", "step": 40, "seconds": 12.5}
    assert record_text(record) == "12:00:01 [rankctl warning] ckpt.slow step=40 seconds=12.5"


def test_record_text_quotes_values_with_spaces_quotes_or_equals_and_empty_ones() -> None:
    record = {"event": "e", "a": "two words", "b": 'say "hi"', "c": "k=v", "d": "", "e": "plain", "f": "tab\there"}
    assert record_text(record) == (
        '[rankctl info] e a="two words" b="say \\"hi\\"" c="k=v" d="" e=plain f="tab\\there"')


def test_record_text_writes_other_values_as_compact_json_quoted_when_it_holds_quotes() -> None:
    record = {"event": "e", "list": [1, 2], "map": {"x": 1}, "none": None, "flag": True}
    assert record_text(record) == '[rankctl info] e list=[1,2] map="{\\"x\\":1}" none=null flag=true'


def test_record_text_of_a_record_with_no_head_fields_has_no_leading_space() -> None:
    assert record_text({}) == "[rankctl info]"
    assert record_text({"x": 1}) == "[rankctl info] x=1"


def test_record_text_leaves_out_every_context_key() -> None:
    record = {k: "v" for k in CONTEXT_KEYS}
    assert record_text(record) == "v [rankctl v] v"


def test_line_text_prefixes_the_rank_only_when_asked() -> None:
    assert line_text(4, "hello", prefixed=True) == "[rank 4] hello"
    assert line_text(4, "hello", prefixed=False) == "hello"


def test_line_text_of_a_record_reads_as_a_record_for_people() -> None:
    line = _record(event="rank.started", level="info", rank=2, pid=77)
    assert line_text(2, line, prefixed=True) == "[rank 2] [rankctl info] rank.started pid=77"


def test_line_text_of_a_cut_record_marks_it_as_rankctls_raw_text() -> None:
    assert line_text(0, RECORD_MARK + '{"ev', prefixed=False) == '[rankctl] {"ev'
