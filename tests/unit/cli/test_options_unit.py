"""Unit tests of cli.options: ``--json``/``-o`` and their one format, documents on stdout, epilogs, the suggesting
command group."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from rankctl.cli.options import (
    OUTPUTS, SuggestingGroup, example, json_flag, json_option, log_format, output_format, output_option,
    print_document,
)


@pytest.mark.parametrize(("output", "as_json", "fmt"), [
    (None, False, "table"), (None, True, "json"), ("wide", False, "wide"), ("yaml", False, "yaml"),
    ("json", True, "json"), ("json", False, "json"), ("table", False, "table")])
def test_output_format_is_the_one_format_asked_for(output: str | None, as_json: bool, fmt: str) -> None:
    assert output_format(output, as_json) == fmt


@pytest.mark.parametrize("output", ["table", "wide", "yaml"])
def test_output_format_refuses_json_with_another_output(output: str) -> None:
    with pytest.raises(click.UsageError, match=f"--json and -o {output} ask for different output"):
        output_format(output, True)


def test_outputs_are_table_wide_json_and_yaml() -> None:
    assert OUTPUTS == ("table", "wide", "json", "yaml")


def _echo_command(*decorators) -> click.Command:
    def body(**kw: object) -> None:
        click.echo(json.dumps(kw, sort_keys=True))

    for decorate in reversed(decorators):
        body = decorate(body)
    return click.command()(body)


def test_the_json_option_sets_as_json_and_defaults_to_false() -> None:
    cmd = _echo_command(json_option)
    assert CliRunner().invoke(cmd, ["--json"]).output == '{"as_json": true}\n'
    assert CliRunner().invoke(cmd, []).output == '{"as_json": false}\n'


def test_json_flag_takes_its_own_help_text() -> None:
    cmd = _echo_command(json_flag("Every node as JSON."))
    assert "Every node as JSON." in CliRunner().invoke(cmd, ["--help"]).output


def test_the_output_option_takes_one_of_the_outputs_and_defaults_to_none() -> None:
    cmd = _echo_command(output_option)
    assert CliRunner().invoke(cmd, ["-o", "yaml"]).output == '{"output": "yaml"}\n'
    assert CliRunner().invoke(cmd, []).output == '{"output": null}\n'
    bad = CliRunner().invoke(cmd, ["--output", "xml"])
    assert bad.exit_code == 2 and "'xml' is not one of" in bad.output


def test_log_format_defaults_to_auto_and_reads_its_env_variable() -> None:
    cmd = _echo_command(log_format)
    assert CliRunner().invoke(cmd, []).output == '{"log_format": "auto"}\n'
    assert CliRunner(env={"RANKCTL_LOG_FORMAT": "json"}).invoke(cmd, []).output == '{"log_format": "json"}\n'
    assert CliRunner().invoke(cmd, ["--log-format", "plain"]).exit_code == 2


def test_print_document_as_json_is_one_indented_document(capsys: pytest.CaptureFixture[str]) -> None:
    print_document({"b": 1, "a": [1, 2]}, "json")
    out = capsys.readouterr().out
    assert json.loads(out) == {"b": 1, "a": [1, 2]}
    assert out == json.dumps({"b": 1, "a": [1, 2]}, indent=2) + "\n"


def test_print_document_as_yaml_keeps_key_order_block_style_unicode_and_long_lines(
        capsys: pytest.CaptureFixture[str]) -> None:
    long = "x" * 300
    print_document({"zeta": 1, "alpha": {"list": [1, 2]}, "name": "naïve", "long": long}, "yaml")
    out = capsys.readouterr().out
    assert out == f"zeta: 1\nalpha:\n  list:\n  - 1\n  - 2\nname: naïve\nlong: {long}\n"


def test_example_is_an_epilog_whose_lines_click_keeps() -> None:
    assert example("ctl status j", "ctl status j --json") == "\b\nExample:\n  ctl status j\n  ctl status j --json"


def _group() -> click.Group:
    @click.group(cls=SuggestingGroup)
    def root() -> None:
        pass

    @root.command()
    def status() -> None:
        click.echo("status ran")

    @root.command()
    def submit() -> None:
        click.echo("submit ran")

    return root


def test_a_misspelt_command_is_refused_naming_the_closest_one() -> None:
    result = CliRunner().invoke(_group(), ["stauts"])
    assert result.exit_code == 2
    assert "No such command 'stauts'. (did you mean status?)" in result.output


def test_a_command_close_to_none_is_refused_without_a_suggestion() -> None:
    result = CliRunner().invoke(_group(), ["zzzz"])
    assert result.exit_code == 2
    assert "No such command 'zzzz'." in result.output and "did you mean" not in result.output


def test_a_known_command_and_an_option_pass_through_the_suggesting_group() -> None:
    assert CliRunner().invoke(_group(), ["submit"]).output == "submit ran\n"
    assert "Usage:" in CliRunner().invoke(_group(), ["--help"]).output
