"""Number fields of the job file are strict: a bool or a string is refused naming the field, the value and the rule;
an integer is still a number (``lr: 1``), and an integer field refuses a float. Pure: no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from rankctl.cli.main import cli
from rankctl.contract.jobfile import SpecError, load_yaml_text
from rankctl.kinds.spec import build_spec

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
NUMBER = "must be a number"
INTEGER = "must be an integer"
PYTHON = {"name": "j", "kind": "python", "python": {"entrypoint": "t.py"}}


def with_field(section: str, field: str, value: object, kind: str) -> dict:
    doc = {"name": "j", "kind": kind, section: {field: value}}
    if kind == "python":
        doc[section]["entrypoint"] = "t.py"
    return doc


FLOAT_FIELDS = [("restart", "collective_timeout", "comm-check"), ("restart", "hang_timeout", "comm-check"),
                ("comm_check", "duration", "comm-check"), ("train", "lr", "train"), ("train", "grad_clip", "train")]


@pytest.mark.parametrize("section, field, kind", FLOAT_FIELDS)
@pytest.mark.parametrize("value, shown", [(True, "True"), ("12", "'12'"), ("1e3", "'1e3'")])
def test_a_number_field_refuses_a_bool_or_a_string(section: str, field: str, kind: str, value: object,
                                                   shown: str) -> None:
    with pytest.raises(SpecError) as err:
        build_spec(with_field(section, field, value, kind))
    assert err.value.errors == [f"{section}.{field} (got {shown}): {NUMBER}"]


@pytest.mark.parametrize("field, value", [("aux_loss", False), ("capacity_factor", "1.5")])
def test_moe_numbers_are_strict_too(field: str, value: object) -> None:
    doc = {"name": "j", "model": {"moe": {"experts": 2, field: value}}}
    with pytest.raises(SpecError, match=rf"model\.moe\.{field} \(got .*\): {NUMBER}"):
        build_spec(doc)


@pytest.mark.parametrize("section, field, kind", FLOAT_FIELDS)
def test_an_integer_is_still_a_number(section: str, field: str, kind: str) -> None:
    value = getattr(getattr(build_spec(with_field(section, field, 1, kind)), section), field)
    assert value == 1.0 and isinstance(value, float)


def test_yaml_and_set_numbers_still_work() -> None:
    spec = build_spec(load_yaml_text("name: j\ntrain: {lr: 1}\nrestart: {collective_timeout: 12}\n"),
                      ["train.lr=0.01", "train.grad_clip=2", "restart.hang_timeout=1e3"])
    assert (spec.train.lr, spec.train.grad_clip, spec.restart.collective_timeout) == (0.01, 2.0, 12.0)
    assert spec.restart.hang_timeout == 1000.0
    with pytest.raises(SpecError, match=rf"train\.lr \(got True\): {NUMBER}"):
        build_spec({"name": "j"}, ["train.lr=true"])


def test_an_exponent_without_a_dot_is_a_number_and_quoted_it_is_a_string() -> None:
    """YAML 1.1 (PyYAML) reads ``3e-4`` as a string, which the strict fields would refuse; the loader reads it as
    YAML 1.2 does."""
    spec = build_spec(load_yaml_text("name: j\ntrain: {lr: 3e-4}\nrestart: {collective_timeout: 1E3}\n"))
    assert (spec.train.lr, spec.restart.collective_timeout) == (3e-4, 1000.0)
    with pytest.raises(SpecError, match=rf"train\.lr \(got '3e-4'\): {NUMBER}"):
        build_spec(load_yaml_text("name: j\ntrain: {lr: '3e-4'}\n"))


@pytest.mark.parametrize("field", ["workdir_max_mb", "workdir_max_unpacked_mb"])
@pytest.mark.parametrize("value, shown", [(True, "True"), ("5", "'5'"), (5.0, "5.0")])
def test_the_python_workdir_limits_are_strict_integers(field: str, value: object, shown: str) -> None:
    with pytest.raises(SpecError) as err:
        build_spec({**PYTHON, "python": {"entrypoint": "t.py", field: value}})
    assert err.value.errors == [f"python.{field} (got {shown}): {INTEGER}"]
    assert getattr(build_spec({**PYTHON, "python": {"entrypoint": "t.py", field: 5}}).python, field) == 5


def test_ctl_refuses_a_bool_for_a_number_and_names_every_field(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\nkind: comm-check\nresources: {nodes: 1, slots_per_node: 2}\n"
                    "restart: {collective_timeout: true}\ncomm_check: {duration: \"1e3\"}\n")
    res = CliRunner().invoke(cli, ["plan", str(path)], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert f"restart.collective_timeout (got True): {NUMBER}" in res.output
    assert f"comm_check.duration (got '1e3'): {NUMBER}" in res.output


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_still_plans(example: str) -> None:
    res = CliRunner().invoke(cli, ["plan", str(EXAMPLES / example)], catch_exceptions=False)
    assert res.exit_code == 0, res.output


def test_a_set_number_override_of_an_example_still_works() -> None:
    res = CliRunner().invoke(cli, ["plan", str(EXAMPLES / "gpt-tp-dp.yaml"), "--set", "train.lr=0.01", "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
