"""Unit tests of cli.contexts: context names and addresses, the config file's rules, saving, selection, precedence."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from rankctl.cli.contexts import (
    CONFIG_ENV, DEFAULT_COORDINATOR, Config, ConfigError, Context, address_problem, config_path, load, name_problem,
    parse, resolve, save, selected,
)
from rankctl.cli.errors import EXIT_USAGE, CtlError

PATH = Path("/cfg/config.yaml")


def _error(doc: object) -> str:
    with pytest.raises(ConfigError) as err:
        parse(PATH, doc)
    assert err.value.exit_code == EXIT_USAGE
    return err.value.message


@pytest.mark.parametrize("name", ["a", "prod", "Lab-2", "x.y_z", "9" * 63])
def test_a_context_name_of_letters_digits_dot_underscore_and_dash_is_accepted(name: str) -> None:
    assert name_problem(name) is None


@pytest.mark.parametrize("name", ["", "-a", ".a", "_a", "a b", "a/b", "a" * 64, "é"])
def test_a_context_name_breaking_the_rule_is_refused_with_the_rule(name: str) -> None:
    problem = name_problem(name)
    assert problem is not None and repr(name) in problem and "must be 1-63 letters" in problem


@pytest.mark.parametrize("address", ["host:7420", "10.0.0.1:1", "[::1]:65535", "a:1,b:2,c:3", "unix:/run/c.sock"])
def test_an_address_host_port_several_of_them_or_unix_is_accepted(address: str) -> None:
    assert address_problem(address) is None


@pytest.mark.parametrize("address", ["host", "host:0", "host:65536", ":7420", "host:port", "host:-1", "unix:",
                                     "a:1,", "a:1,b", "a :1", "host:74 20", ""])
def test_an_address_that_cannot_be_one_is_refused_naming_it(address: str) -> None:
    problem = address_problem(address)
    assert problem is not None and repr(address) in problem and "port 1-65535" in problem


def test_config_path_is_the_env_value_when_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "mine.yaml"))
    assert config_path() == tmp_path / "mine.yaml"


def test_config_path_defaults_to_config_yaml_in_the_app_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert config_path() == tmp_path / "rankctl" / "config.yaml"


def test_to_doc_leaves_out_an_unset_tls_dir() -> None:
    config = Config(current="a", contexts={"a": Context(coordinator="h:1"), "b": Context(coordinator="h:2",
                                                                                           tls_dir="/t")})
    assert config.to_doc() == {"current-context": "a",
                               "contexts": {"a": {"coordinator": "h:1"}, "b": {"coordinator": "h:2", "tls_dir": "/t"}}}


def test_with_context_adds_or_replaces_one_and_leaves_the_original_as_it_was() -> None:
    base = Config(contexts={"a": Context(coordinator="h:1")})
    more = base.with_context("a", Context(coordinator="h:9")).with_context("b", Context(coordinator="h:2"))
    assert more.contexts == {"a": Context(coordinator="h:9"), "b": Context(coordinator="h:2")}
    assert base.contexts == {"a": Context(coordinator="h:1")}


def test_without_removes_a_context_and_clears_current_only_when_it_was_that_one() -> None:
    config = Config(current="a", contexts={"a": Context(coordinator="h:1"), "b": Context(coordinator="h:2")})
    assert config.without("a") == Config(current=None, contexts={"b": Context(coordinator="h:2")})
    assert config.without("b").current == "a"
    assert config.without("missing") == config


def test_parse_of_an_empty_file_is_an_empty_config() -> None:
    assert parse(PATH, None) == Config()
    assert parse(PATH, {"contexts": None}) == Config()


def test_parse_reads_contexts_and_the_current_one() -> None:
    doc = {"current-context": "lab", "contexts": {"lab": {"coordinator": "lab:7420", "tls_dir": "~/tls"},
                                                  "local": {"coordinator": "unix:/run/c.sock"}}}
    assert parse(PATH, doc) == Config(current="lab", contexts={
        "lab": Context(coordinator="lab:7420", tls_dir="~/tls"), "local": Context(coordinator="unix:/run/c.sock")})


def test_parse_refuses_a_document_that_is_no_mapping() -> None:
    assert _error(["a"]) == f"{PATH}: the file holds list: it must be a mapping with current-context and contexts"


def test_parse_refuses_an_unknown_top_level_field_naming_the_first() -> None:
    assert _error({"zeta": 1, "alpha": 2, "contexts": {}}) == (
        f"{PATH}: alpha: unknown field (fields: current-context, contexts)")


def test_parse_refuses_contexts_that_are_no_mapping() -> None:
    assert _error({"contexts": ["a"]}) == (
        f"{PATH}: contexts is ['a']: must be a mapping NAME -> {{coordinator, tls_dir}}")


def test_parse_refuses_a_bad_context_name() -> None:
    assert "contexts.-bad: context name '-bad' must be" in _error({"contexts": {"-bad": {"coordinator": "h:1"}}})


def test_parse_refuses_a_context_body_that_is_no_mapping() -> None:
    assert _error({"contexts": {"a": "h:1"}}) == (
        f"{PATH}: contexts.a is 'h:1': must be a mapping with coordinator (and tls_dir)")


def test_parse_refuses_an_unknown_context_field() -> None:
    assert _error({"contexts": {"a": {"coordinator": "h:1", "token": "x"}}}) == (
        f"{PATH}: contexts.a.token: unknown field (fields: coordinator, tls_dir)")


def test_parse_refuses_a_missing_or_bad_coordinator() -> None:
    assert _error({"contexts": {"a": {}}}) == f"{PATH}: contexts.a.coordinator=None: a string HOST:PORT is required"
    assert _error({"contexts": {"a": {"coordinator": 7420}}}).endswith("a string HOST:PORT is required")
    assert "contexts.a.coordinator='h': coordinator 'h' must be HOST:PORT" in _error(
        {"contexts": {"a": {"coordinator": "h"}}})


@pytest.mark.parametrize("tls_dir", ["", 5, ["/t"]])
def test_parse_refuses_a_tls_dir_that_is_not_a_path(tls_dir: object) -> None:
    assert _error({"contexts": {"a": {"coordinator": "h:1", "tls_dir": tls_dir}}}) == (
        f"{PATH}: contexts.a.tls_dir={tls_dir!r}: must be a directory path (a string)")


def test_parse_refuses_a_current_context_that_names_no_context() -> None:
    assert _error({"current-context": "b", "contexts": {"a": {"coordinator": "h:1"}}}) == (
        f"{PATH}: current-context='b' names no context (contexts: a)")
    assert _error({"current-context": "b"}) == f"{PATH}: current-context='b' names no context (contexts: none)"


def test_load_of_a_missing_file_is_an_empty_config(tmp_path: Path) -> None:
    assert load(tmp_path / "none.yaml") == Config()


def test_load_names_the_line_and_column_of_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("contexts:\n  a: [\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+, column \d+") as err:
        load(path)
    assert err.value.message.startswith(f"{path}: ")


def test_load_of_an_unreadable_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Is a directory"):
        load(tmp_path)


def test_save_writes_a_file_that_loads_back_with_mode_0600_in_a_0700_directory(tmp_path: Path) -> None:
    path = tmp_path / "new" / "config.yaml"
    config = Config(current="a", contexts={"a": Context(coordinator="h:1", tls_dir="/t"),
                                           "b": Context(coordinator="x:2,y:3")})
    assert save(config, path) == path
    assert load(path) == config
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert os.listdir(path.parent) == ["config.yaml"]


def test_save_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    save(Config(current="a", contexts={"a": Context(coordinator="h:1")}), path)
    save(Config(), path)
    assert load(path) == Config()
    assert sorted(os.listdir(tmp_path)) == ["config.yaml"]


def test_selected_prefers_the_name_given_over_the_current_context() -> None:
    config = Config(current="a", contexts={"a": Context(coordinator="h:1"), "b": Context(coordinator="h:2")})
    assert selected(config, "b", PATH) == Context(coordinator="h:2")
    assert selected(config, None, PATH) == Context(coordinator="h:1")
    assert selected(Config(), None, PATH) is None


def test_selected_refuses_a_name_that_is_no_context_listing_the_ones_there() -> None:
    config = Config(contexts={"a": Context(coordinator="h:1")})
    with pytest.raises(ConfigError, match=r"no context 'zz' \(contexts: a; `ctl config set-context"):
        selected(config, "zz", PATH)


def _config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    monkeypatch.setenv(CONFIG_ENV, str(path))
    return path


def test_resolve_refuses_a_given_address_that_cannot_be_one() -> None:
    with pytest.raises(CtlError, match=r"--coordinator \(or env RANKCTL_COORDINATOR\): coordinator 'nope'"):
        resolve("nope", None, None)


def test_resolve_with_address_and_tls_dir_given_does_not_read_the_file(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    _config_file(monkeypatch, tmp_path, "not: [valid")
    assert resolve("h:1", "/tls", None) == ("h:1", "/tls")


def test_resolve_without_a_file_gives_the_default_address_and_no_tls(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "absent.yaml"))
    assert resolve(None, None, None) == (DEFAULT_COORDINATOR, None)


def test_resolve_fills_what_is_not_given_from_the_current_context(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    _config_file(monkeypatch, tmp_path,
                 "current-context: lab\ncontexts:\n  lab: {coordinator: 'lab:7420', tls_dir: '~/tls'}\n")
    assert resolve(None, None, None) == ("lab:7420", str(tmp_path / "tls"))
    assert resolve("mine:1", None, None) == ("mine:1", str(tmp_path / "tls"))
    assert resolve(None, "/given", None) == ("lab:7420", "/given")


def test_resolve_reads_a_named_context_even_when_both_values_are_given(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    _config_file(monkeypatch, tmp_path, "contexts:\n  lab: {coordinator: 'lab:7420'}\n")
    assert resolve("h:1", "/tls", "lab") == ("h:1", "/tls")
    with pytest.raises(ConfigError, match="no context 'other'"):
        resolve("h:1", "/tls", "other")


def test_a_port_of_non_ascii_digits_is_a_problem_not_a_traceback() -> None:
    """``str.isdigit`` accepts "²" and Arabic-Indic digits that ``int`` refuses or reads: both are named problems."""
    from rankctl.cli.contexts import address_problem

    assert address_problem("host:\u00b2") is not None
    assert address_problem("host:\u0667\u0664\u0662\u0660") is not None
    assert address_problem("host:7420") is None


def test_a_context_name_yaml_read_as_a_number_or_null_is_named_with_the_rule() -> None:
    from pathlib import Path

    import pytest

    from rankctl.cli.contexts import ConfigError, parse

    for key in (1, None):
        with pytest.raises(ConfigError) as err:
            parse(Path("c.yaml"), {"contexts": {key: {"coordinator": "h:1"}}})
        assert f"contexts.{key}: a context name is a string" in str(err.value) and not str(err.value).endswith("None")
