"""A train run's speed over the run, not its last step's (issue 53, item 13)."""

from __future__ import annotations

import pytest
from rich.console import Console

from rankctl.coordinator.model.histogram import RunTimes
from rankctl.kinds.train.render import progress
from rankctl.proto import rankctl_pb2 as pb


def test_the_summary_shows_the_median_step_time_and_its_range_over_the_run() -> None:
    times = RunTimes()
    for dt in [0.027] * 50 + [9.0] + [0.03] * 49:
        times.observe(dt)
    figures = times.figures()
    assert figures == {"step_time_median": pytest.approx(0.0285), "step_time_run_min": 0.027, "step_time_run_max": 9.0}
    job = pb.Job(id="j", state=pb.JOB_STATE_SUCCEEDED)
    job.spec.update({"name": "j", "kind": "train", "train": {"steps": 100}})
    job.summary.min_step = 100
    job.summary.metrics.update({"step": 100.0, "loss": 2.5, "tokens_per_s": 38567.0, "step_time_min": 0.0266,
                                "step_time_max": 0.0266, **figures})
    console = Console(width=200, record=True)
    console.print(progress(job))
    text = console.export_text()
    assert "0.0285 s/step (median; 0.027-9)" in text and "0.0266-0.0266" not in text, text
