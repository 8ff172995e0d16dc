"""A rank's result within its report's bound (issue 53, item 2): long loss lists sampled, never the result lost."""

from __future__ import annotations

import json

from rankctl.contract.resultsize import RESULT_CHARS, result_json


def test_a_1500_step_result_keeps_its_losses_sampled_first_and_last_included() -> None:
    losses = [{"step": s, "loss": 1.0 / s + 1e-9 * s} for s in range(1, 1501)]
    result = {"losses": losses, "metrics": {"acc": 0.5}, "final": {"step": 1500}}
    assert len(json.dumps(result)) > RESULT_CHARS          # (a 900-step one fits whole)
    doc = json.loads(result_json(result))
    assert len(json.dumps(doc)) <= RESULT_CHARS
    kept = [r["step"] for r in doc["losses"]]
    assert kept[0] == 1 and kept[-1] == 1500 and doc["losses_total"] == {"losses": 1500}
    assert kept[1] - kept[0] == doc["losses_every"] and doc["metrics"] == {"acc": 0.5}
    small = {"losses": losses[:900]}
    assert json.loads(result_json(small)) == small
