"""Unit tests of kinds.python.results: a python job's result from its ranks' reports."""

from __future__ import annotations

from rankctl.kinds.python.results import python_result

LOSSES = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]


def test_the_lowest_rank_with_complete_losses_reports_them_with_its_own_metrics() -> None:
    results = {
        3: {"losses": LOSSES, "metrics": {"loss": 2.0, "acc": 0.5}, "final": {"step": 2}},
        1: {"losses": LOSSES, "metrics": {"loss": 2.0, "acc": 0.9}, "final": {"step": 2},
            "val_losses": [{"step": 2, "loss": 2.1}], "resumed_from": 1},
        0: {"metrics": {"acc": 0.1}},
    }
    out = python_result(results)
    assert out == {"losses": LOSSES, "final": {"step": 2}, "reported_by": 1, "metrics": {"loss": 2.0, "acc": 0.9}}


def test_val_losses_and_resumed_from_are_left_out_of_a_python_result() -> None:
    out = python_result({0: {"losses": LOSSES, "val_losses": LOSSES, "resumed_from": 5}})
    assert "val_losses" not in out and "resumed_from" not in out
    assert out["metrics"] == {}


def test_a_rank_with_a_missing_loss_is_passed_over() -> None:
    results = {0: {"losses": [{"step": 1, "loss": None}], "metrics": {"m": 0}},
               2: {"losses": LOSSES, "metrics": {"m": 2}}}
    out = python_result(results)
    assert out["reported_by"] == 2 and out["metrics"] == {"m": 2}


def test_without_losses_the_lowest_rank_with_metrics_gives_metrics_and_final() -> None:
    results = {5: {"metrics": {"m": 5}, "final": {"step": 9}}, 2: {"metrics": {"m": 2}, "final": {"step": 4}},
               0: {"metrics": {}}, 1: "not a mapping"}
    out = python_result(results)
    assert out == {"losses": [], "final": {"step": 4}, "reported_by": None, "metrics": {"m": 2}}


def test_a_rank_with_metrics_and_no_final_gives_an_empty_final() -> None:
    out = python_result({0: {"metrics": {"m": 1}}})
    assert out["final"] == {} and out["metrics"] == {"m": 1}


def test_no_rank_with_losses_or_metrics_gives_an_empty_result() -> None:
    assert python_result({0: None, 1: {}}) == {"losses": [], "final": {}, "reported_by": None, "metrics": {}}
    assert python_result({}) == {"losses": [], "final": {}, "reported_by": None, "metrics": {}}


def test_the_metrics_are_a_copy_not_the_ranks_own_dict() -> None:
    metrics = {"m": 1}
    out = python_result({0: {"losses": LOSSES, "metrics": metrics}})
    out["metrics"]["m"] = 2
    assert metrics == {"m": 1}


def test_an_early_stop_and_a_resumed_layout_are_kept() -> None:
    out = python_result({0: {"losses": LOSSES, "ended": "stop_at 2", "resumed_layout": "tp2 dp2"}})
    assert out["ended"] == "stop_at 2" and out["resumed_layout"] == "tp2 dp2"


def test_an_argument_may_be_as_long_as_linux_passes_and_all_of_them_are_bounded() -> None:
    """Issue 53, item 8: one argument up to 131,071 characters (Linux's MAX_ARG_STRLEN less its NUL), all of them
    up to 196,608; past either, the error names the field and the rule."""
    import pytest

    from rankctl.contract.jobfile import SpecError
    from rankctl.kinds.spec import build_spec

    def spec(args: list[str]):  # noqa: ANN202
        return build_spec({"name": "a", "kind": "python", "resources": {"nodes": 1, "slots_per_node": 1},
                           "python": {"entrypoint": "t.py", "args": args}})

    assert spec(["x" * 100_000]).python.args[0] == "x" * 100_000
    with pytest.raises(SpecError, match=r"python\.args\.0.*131071"):
        spec(["x" * 131_072])
    with pytest.raises(SpecError, match=r"python\.args.*196608"):
        spec(["x" * 100_000, "y" * 100_000])
