"""A size flag given as 0 is refused like -1; its default applies only when the flag is not given. Pure: click's
CliRunner (``ctl up`` refuses before it starts anything)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from rankctl.cli.errors import CtlError
from rankctl.cli.main import cli
from rankctl.cli.commands.up import _cluster_shape
from rankctl.kinds.spec import build_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.mark.parametrize("gpn", ["0", "-1"])
def test_plan_refuses_zero_gpus_per_node_like_a_negative_one(gpn: str) -> None:
    res = run("plan", "--world-size", "8", "--gpus-per-node", gpn)
    assert res.exit_code == 2, res.output
    assert f"error: --gpus-per-node={gpn} must be between 1 and 1024" in res.output
    assert "Traceback" not in res.output


def test_plan_defaults_gpus_per_node_only_when_it_is_not_given() -> None:
    assert "on 1 node(s) x 8 slots" in run("plan", "--world-size", "8").output
    assert "on 4 node(s) x 2 slots" in run("plan", "--world-size", "8", "--gpus-per-node", "2").output
    job = run("plan", str(EXAMPLES / "gpt-tp-dp.yaml"), "--gpus-per-node", "0")
    assert job.exit_code == 2 and "--gpus-per-node=0 must be between 1 and 1024" in job.output


SPEC = build_spec({"name": "j", "kind": "comm-check", "resources": {"nodes": 2, "slots_per_node": 2}})


@pytest.mark.parametrize("nodes, slots, shown", [(0, None, "--nodes=0 and --slots=2"),
                                                 (-1, None, "--nodes=-1 and --slots=2"),
                                                 (None, 0, "--nodes=2 and --slots=0"),
                                                 (0, 0, "--nodes=0 and --slots=0")])
def test_up_refuses_zero_nodes_or_slots_like_a_negative_one(nodes: int | None, slots: int | None, shown: str) -> None:
    with pytest.raises(CtlError, match=f"^{shown} must be at least 1$"):
        _cluster_shape(SPEC, nodes, slots)


def test_up_takes_the_job_file_shape_only_for_a_flag_not_given() -> None:
    assert _cluster_shape(SPEC, None, None) == (2, 2)
    assert _cluster_shape(SPEC, 3, None) == (3, 2)
    assert _cluster_shape(SPEC, None, 4) == (2, 4)


def test_up_starts_an_elastic_job_on_as_few_nodes_as_it_may_run_on() -> None:
    """``ctl up --nodes 1`` of a job with ``nodes: 2, min_nodes: 1`` was refused (an outside probe)."""
    elastic = build_spec({"name": "j", "kind": "comm-check", "resources": {"nodes": 4, "slots_per_node": 2,
                                                                           "min_nodes": 2}})
    assert _cluster_shape(elastic, 2, None) == (2, 2)
    with pytest.raises(CtlError, match=r"needs resources.nodes=2..4 x resources.slots_per_node=2, but up would "
                                       r"start 1 node\(s\) x 2 slot\(s\)"):
        _cluster_shape(elastic, 1, None)


@pytest.mark.parametrize("flag", ["--nodes", "--slots"])
def test_ctl_up_with_a_zero_flag_exits_2_and_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           flag: str) -> None:
    from rankctl.worker.launcher import procutil

    monkeypatch.setattr(procutil, "configure_logging", lambda **_: None)  # keep this process's logging as it is
    state = tmp_path / "state"
    res = run("up", str(EXAMPLES / "comm-check.yaml"), flag, "0", "--state-dir", str(state))
    assert res.exit_code == 2, res.output
    assert f"{flag}=0" in res.output and "must be at least 1" in res.output
    assert not state.exists()
