"""A key given twice in one mapping is refused (YAML's loaders keep the last one silently): in a job file, at any
depth, in a ``--set`` value, through ``ctl`` and through the coordinator's submit. Pure: no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from rankctl.cli.main import cli
from rankctl.contract.jobfile import SpecError, load_yaml_text, parse_override
from rankctl.coordinator.jobs.core import Coordinator
from rankctl.coordinator.store.database import Store
from rankctl.kinds.spec import build_spec

TWO_NAMES = "name: x\nname: y\nkind: comm-check\nresources: {nodes: 1, slots_per_node: 2}\n"
RULE = "a key may appear once in a mapping"


def refusal(text: str) -> str:
    with pytest.raises(SpecError) as err:
        load_yaml_text(text, "job.yaml")
    assert len(err.value.errors) == 1
    return err.value.errors[0]


def test_a_top_level_key_given_twice_is_refused_naming_the_key_and_both_lines() -> None:
    assert refusal(TWO_NAMES) == (f"job.yaml: 'name': duplicate key (line 2, column 1; first at line 1, column 1); "
                                  f"{RULE}")


@pytest.mark.parametrize("text, key, line", [
    ("name: x\nresources:\n  nodes: 1\n  nodes: 2\n", "'nodes'", 4),
    ("name: x\nresources: {nodes: 1, slots_per_node: 2, nodes: 4}\n", "'nodes'", 2),
    ("name: x\npython:\n  env:\n    A: '1'\n    B: '2'\n    A: '3'\n", "'A'", 6),
    ("name: x\nlist:\n  - {a: 1}\n  - {a: 1, b: 2, a: 3}\n", "'a'", 4),
    ("name: x\n1: a\n1.0: b\n", "1.0", 3),     # equal keys once built, though written differently
    ("name: x\n'name': y\n", "'name'", 2),     # quoting does not make another key
])
def test_a_key_given_twice_is_refused_at_any_depth(text: str, key: str, line: int) -> None:
    problem = refusal(text)
    assert problem.startswith(f"job.yaml: {key}: duplicate key (line {line}, ") and problem.endswith(RULE)


def test_distinct_keys_and_merge_keys_are_still_accepted() -> None:
    assert load_yaml_text("name: x\nresources: {nodes: 1, slots_per_node: 2}\nrestart: {max_restarts: 1}\n") == {
        "name": "x", "resources": {"nodes": 1, "slots_per_node": 2}, "restart": {"max_restarts": 1}}
    merged = load_yaml_text("base: &b {nodes: 1, slots_per_node: 2}\nresources:\n  <<: *b\n  nodes: 2\n")
    assert merged["resources"] == {"nodes": 2, "slots_per_node": 2}  # an explicit key overrides a merged one


def test_a_set_value_with_a_key_given_twice_is_refused_not_taken_as_a_string() -> None:
    with pytest.raises(SpecError, match=rf"--set 'train': 'lr': duplicate key \(line 1, column 9; .*{RULE}"):
        parse_override("train={lr: 1, lr: 2}")
    with pytest.raises(SpecError, match="duplicate key"):
        build_spec({"name": "x"}, ["resources={nodes: 1, nodes: 2}"])
    assert parse_override("train={lr: 1, warmup: 2}") == (["train"], {"lr": 1, "warmup": 2})


@pytest.mark.parametrize("command", ["plan", "submit"])
def test_ctl_refuses_a_job_file_with_a_key_given_twice(tmp_path: Path, command: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(TWO_NAMES)
    res = CliRunner().invoke(cli, [command, str(path)], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert f"'name': duplicate key (line 2, column 1; first at line 1, column 1); {RULE}" in res.output
    assert "Traceback" not in res.output


def test_the_coordinator_refuses_it_and_stores_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path)
    try:
        core = Coordinator(store)
        with pytest.raises(SpecError, match=rf"submitted.yaml: 'name': duplicate key \(line 2.*{RULE}"):
            core.submit(TWO_NAMES, source="submitted.yaml", queue_anyway=True)
        assert core.list() == [] and store.load_jobs() == []
    finally:
        store.close()
