"""Unit tests of kinds.train.render: expert-load rows, result tables, the progress bar and the printed step lines."""

from __future__ import annotations

import io
import json
from typing import Any

from google.protobuf.struct_pb2 import Struct
from rich.console import Console

from rankctl.kinds.train.render import PRINTED_STEPS, expert_rows, printed_step, progress, step_line, tables
from rankctl.proto import rankctl_pb2 as pb


def _rows_table(title: str, rows: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    return title, rows


def _job(steps: int | None = 100, summary: dict[str, float] | None = None, min_step: int = 0,
         ranks: list[tuple[int, int, dict]] = ()) -> pb.Job:
    spec = Struct()
    spec.update({"train": {"steps": steps}} if steps is not None else {"name": "x"})
    job = pb.Job(id="t-000001", kind="train", spec=spec)
    if summary is not None:
        job.summary.min_step = min_step
        job.summary.metrics.update(summary)
    for rank, step, metrics in ranks:
        job.ranks.add(rank=rank, step=step, metrics_json=json.dumps(metrics))
    return job


def _text(renderable: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def test_expert_rows_give_tokens_per_expert_and_max_over_mean_per_layer() -> None:
    rows = expert_rows({"layer 1": [3, 1], "layer 3": [2, 2, 2]})
    assert rows == [{"layer": "layer 1", "tokens per expert": "3 1", "max/mean": 1.5},
                    {"layer": "layer 3", "tokens per expert": "2 2 2", "max/mean": 1.0}]


def test_expert_rows_without_tokens_have_no_ratio() -> None:
    rows = expert_rows({"empty": [], "idle": [0, 0]})
    assert [r["max/mean"] for r in rows] == [None, None]
    assert rows[0]["tokens per expert"] == ""


def test_tables_put_the_expert_load_first_then_the_losses() -> None:
    result = {"final": {"step": 40, "expert_tokens": {"1": [5, 3]}},
              "losses": [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}]}
    out = tables(result, _rows_table)
    assert [key for key, _ in out] == [None, "losses"]
    title, rows = out[0][1]
    assert title == "expert load balance (step 40, tokens per expert)"
    assert rows == expert_rows({"1": [5, 3]})
    assert out[1][1][0] == "losses (2 steps)"


def test_tables_without_a_final_step_name_it_with_a_question_mark() -> None:
    [(key, (title, _))] = tables({"final": {"expert_tokens": {"1": [1]}}}, _rows_table)
    assert key is None and title == "expert load balance (step ?, tokens per expert)"


def test_tables_without_expert_tokens_hold_the_losses_alone() -> None:
    result = {"final": {"step": 3, "expert_tokens": {}}, "losses": [{"step": 1, "loss": 1.0}]}
    assert [key for key, _ in tables(result, _rows_table)] == ["losses"]
    assert tables({"final": "not a dict"}, _rows_table) == []
    assert tables({"final": {"expert_tokens": [1, 2]}}, _rows_table) == []


def test_progress_is_none_without_steps_in_the_spec_or_without_a_loss() -> None:
    assert progress(_job(steps=None, summary={"loss": 2.0, "step": 5})) is None
    assert progress(_job(steps=0, summary={"loss": 2.0, "step": 5})) is None
    assert progress(_job(steps=100, summary={"tokens_per_s": 9.0})) is None
    assert progress(_job(steps=100)) is None


def test_progress_shows_the_summarys_step_loss_and_tokens_per_second() -> None:
    text = _text(progress(_job(steps=200, summary={"loss": 3.43581, "step": 10, "tokens_per_s": 6065.2})))
    assert "step 10/200" in text and "loss 3.4358" in text and "6,065 tok/s" in text
    assert "lr " not in text and "s/step" not in text


def test_progress_adds_the_learning_rate_and_the_step_time_spread_when_reported() -> None:
    summary = {"loss": 1.0, "step": 5, "lr": 1.5e-4, "step_time_min": 0.1234, "step_time_max": 0.2}
    text = _text(progress(_job(steps=10, summary=summary)))
    assert "lr 1.50e-04" in text and "0.123-0.2 s/step" in text


def test_progress_uses_the_summarys_min_step_when_its_metrics_hold_no_step() -> None:
    text = _text(progress(_job(steps=50, summary={"loss": 2.0}, min_step=7)))
    assert "step 7/50" in text


def test_progress_before_a_summary_loss_uses_the_lowest_rank_reporting_one() -> None:
    job = _job(steps=30, summary={}, ranks=[(3, 9, {"loss": 4.0}), (1, 8, {"loss": 5.5}), (0, 8, {"lr": 1.0})])
    text = _text(progress(job))
    assert "step 8/30" in text and "loss 5.5000" in text


def test_printed_step_prints_first_last_evaluated_and_about_twenty_steps() -> None:
    printed = [s for s in range(1, 201) if printed_step(s, 200, False)]
    assert printed[0] == 1 and printed[-1] == 200
    assert printed == [1] + list(range(10, 201, 10))
    assert len(printed) == PRINTED_STEPS + 1
    assert printed_step(7, 200, True) is True
    assert printed_step(7, 200, False) is False


def test_printed_step_of_a_short_run_prints_every_step() -> None:
    assert all(printed_step(s, 10, False) for s in range(1, 11))


def test_step_line_reads_as_megatrons_with_each_reported_figure() -> None:
    metrics = {"loss": 3.43581, "lr": 1.5e-4, "grad_norm": 2.5812, "tokens_per_s": 6065.2, "step_time_s": 0.1691}
    assert step_line(10, 200, metrics) == "step 10/200  loss 3.4358  lr 1.5e-04  grad 2.58  6,065 tok/s  0.169 s"


def test_step_line_skips_figures_that_are_missing_or_not_numbers() -> None:
    metrics = {"loss": None, "val_loss": 2.0, "lr": "high", "grad_norm": True, "tokens_per_s": 10}
    assert step_line(3, 4, metrics) == "step 3/4  val loss 2.0000  10 tok/s"
    assert step_line(1, 1, {}) == "step 1/1"
