"""``ctl`` conventions (docs/cli.md): global options anywhere, --json everywhere, pipes (no wrapping, no
colour, a closed pipe is exit 0), an example ending every --help, shell completion, config contexts."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import click
import pytest
import yaml
from click.shell_completion import BashComplete
from click.testing import CliRunner

from rankctl.cli.view import console
from rankctl.cli.globalopts import hoist, lower_json, option_spec
from rankctl.cli.main import COMMANDS, cli
from rankctl.proto import rankctl_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
CTL = [sys.executable, "-m", "rankctl.cli.main"]
JOB_FILE = str(ROOT / "examples" / "comm-check.yaml")
SEEDED = 120  # jobs in the shared coordinator: `jobs --json` is far more than a pipe holds (64 KiB)
LONG_NAME = "a-job-name-long-enough-for-a-table-row-to-pass-80-cols"


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def sh(command: str, **env: str) -> subprocess.CompletedProcess:
    """``command`` in sh with pipefail: its exit status is ctl's, not the last reader's."""
    full = {**os.environ, "CTL": " ".join(CTL), **env}
    return subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True,
                          env=full, timeout=120, cwd=ROOT)


@pytest.fixture(autouse=True)
def no_user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test has its own (absent) config file and no coordinator or context from the environment."""
    path = tmp_path / "config" / "config.yaml"
    monkeypatch.setenv("RANKCTL_CONFIG", str(path))
    for var in ("RANKCTL_COORDINATOR", "RANKCTL_TLS_DIR", "RANKCTL_CONTEXT", "NO_COLOR", "FORCE_COLOR"):
        monkeypatch.delenv(var, raising=False)
    return path


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conventions")


@pytest.fixture(scope="module")
def coordinator(shared_root: Path):
    """A real ``ctl coordinator`` process (and its dashboard) with SEEDED pending jobs (no nodes: they wait)."""
    from cluster import start_coordinator

    root = shared_root
    proc, address = start_coordinator(root / "coord", http_listen="127.0.0.1:0")
    seed = (f"from rankctl.cli.client import Client\nc = Client({address!r})\n"
            f"text = open({JOB_FILE!r}).read()\n"
            f"for i in range({SEEDED}): c.submit(text, [f'name={LONG_NAME}-{{i}}'], 'seed', queue_anyway=True)\n")
    subprocess.run([sys.executable, "-c", seed], check=True, timeout=120)
    yield address
    proc.stop()


@pytest.fixture(scope="module")
def dashboard(coordinator: str, shared_root: Path) -> str:
    """The shared coordinator's dashboard (HTTP) address."""
    from cluster import http_address

    return http_address(shared_root / "coord")


# -- global options before or after the subcommand ---------------------------------------------
def _hoist(*args: str) -> list[str]:
    return hoist(list(args), option_spec(cli), lambda name: cli.get_command(click.Context(cli), name))


@pytest.mark.parametrize("args, expected", [
    (["jobs", "--coordinator", "h:1", "--json"], ["--coordinator", "h:1", "jobs", "--json"]),
    (["jobs", "--json", "--coordinator=h:1"], ["--coordinator=h:1", "jobs", "--json"]),
    (["status", "j1", "--tls-dir", "/id", "--context", "prod"], ["--tls-dir", "/id", "--context", "prod", "status", "j1"]),
    (["--context", "a", "cancel", "j1", "--reason", "--coordinator"], ["--context", "a", "cancel", "j1", "--reason",
                                                                        "--coordinator"]),  # a value of --reason
    (["logs", "j1", "--", "--coordinator", "h:1"], ["logs", "j1", "--", "--coordinator", "h:1"]),
    (["worker", "--coordinator", "h:1", "--tls-dir", "/node", "--state-dir", "s"],
     ["worker", "--coordinator", "h:1", "--tls-dir", "/node", "--state-dir", "s"]),  # the worker's own options
    (["config", "set-context", "p", "--coordinator", "h:1"], ["config", "set-context", "p", "--coordinator", "h:1"]),
    (["config", "current-context", "--coordinator", "h:1"], ["--coordinator", "h:1", "config", "current-context"]),
    (["certs", "issue", "ca", "--context", "p"], ["--context", "p", "certs", "issue", "ca"]),
    (["nosuch", "--coordinator", "h:1"], ["nosuch", "--coordinator", "h:1"]),
    (["run", "--nnodes", "2", "--coordinator", "h:1", "t.py", "--coordinator", "x"],
     ["--coordinator", "h:1", "run", "--nnodes", "2", "t.py", "--coordinator", "x"]),  # after SCRIPT: the script's
    (["run", "-m", "pkg.mod", "--context=p"], ["run", "-m", "pkg.mod", "--context=p"]),
])
def test_global_options_after_the_subcommand_move_in_front_of_it(args: list[str], expected: list[str]) -> None:
    assert _hoist(*args) == expected


@pytest.mark.parametrize("args, expected", [
    (["--json", "jobs", "--limit", "3"], ["jobs", "--limit", "3", "--json"]),
    (["--context", "--json", "jobs"], ["--context", "--json", "jobs"]),  # a context named --json stays
    (["--json", "config", "get-contexts"], ["config", "get-contexts", "--json"]),
    (["--json", "logs", "j1", "--", "-x"], ["logs", "j1", "--json", "--", "-x"]),
    (["jobs", "--json"], ["jobs", "--json"]),
])
def test_json_before_the_subcommand_moves_to_its_end(args: list[str], expected: list[str]) -> None:
    assert lower_json(args, option_spec(cli), lambda name: cli.get_command(click.Context(cli), name)) == expected


def test_the_same_global_option_after_the_subcommand_wins(no_user_config: Path) -> None:
    res = run("--coordinator", "first:1", "config", "current-context", "--json", "--coordinator", "second:2")
    assert json.loads(res.stdout)["coordinator"] == "second:2"


def test_the_worker_keeps_its_own_coordinator_and_tls_dir(tmp_path: Path) -> None:
    """``ctl worker --tls-dir`` is the daemon's identity: a user certificate there is refused by the worker."""
    from rankctl.security.certs import init_ca, issue

    init_ca(tmp_path / "ca", [])
    user = issue(tmp_path / "ca", tmp_path / "alice", user="alice", role="viewer")
    res = CliRunner().invoke(cli, ["worker", "--coordinator", "127.0.0.1:9", "--name", "n1", "--tls-dir", str(user),
                                   "--state-dir", str(tmp_path / "w")])
    assert res.exit_code == 2 and "needs a node certificate" in res.output


# -- config contexts and precedence -------------------------------------------------------------
def write_config(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))


CONTEXTS = {"current-context": "cur", "contexts": {"cur": {"coordinator": "cur:1", "tls_dir": "/cur"},
                                                    "other": {"coordinator": "other:2"}}}


@pytest.mark.parametrize("flag, env, context, file, expected", [
    (None, None, None, None, ("127.0.0.1:7420", None)),            # default
    (None, None, None, CONTEXTS, ("cur:1", "/cur")),               # the file's current context
    (None, None, "other", CONTEXTS, ("other:2", None)),            # --context / RANKCTL_CONTEXT selects
    (None, "env:3", None, CONTEXTS, ("env:3", "/cur")),            # env beats the context (per field)
    (None, "env:3", "other", CONTEXTS, ("env:3", None)),
    ("flag:4", "env:3", None, CONTEXTS, ("flag:4", "/cur")),        # the flag beats the env
    ("flag:4", None, None, None, ("flag:4", None)),
])
@pytest.mark.parametrize("context_by", ["flag", "env"])
def test_precedence_flag_env_context_default(no_user_config: Path, flag, env, context, file, expected,
                                             context_by: str) -> None:
    if file:
        write_config(no_user_config, file)
    args = ["--coordinator", flag] if flag else []
    environ = {"RANKCTL_COORDINATOR": env} if env else {}
    if context and context_by == "flag":
        args += ["--context", context]
    elif context:
        environ["RANKCTL_CONTEXT"] = context
    res = run(*args, "config", "current-context", "--json", env=environ)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["coordinator"], doc["tls_dir"]) == expected
    assert doc["name"] == (context or (file or {}).get("current-context"))


def test_tls_dir_flag_and_env_beat_the_context(no_user_config: Path) -> None:
    write_config(no_user_config, CONTEXTS)
    assert json.loads(run("config", "current-context", "--json", env={"RANKCTL_TLS_DIR": "/env"}).stdout)["tls_dir"] \
        == "/env"
    res = run("config", "current-context", "--json", "--tls-dir", "/flag", env={"RANKCTL_TLS_DIR": "/env"})
    assert json.loads(res.stdout)["tls_dir"] == "/flag"


def test_set_use_get_delete_contexts(no_user_config: Path, tmp_path: Path) -> None:
    assert run("config", "set-context", "prod", "--coordinator", "head:7420", "--tls-dir", str(tmp_path)).exit_code == 0
    assert run("config", "set-context", "dev", "--coordinator", "127.0.0.1:7420").exit_code == 0
    assert run("config", "current-context").stdout == "prod\n"  # the first context became current
    assert run("config", "use-context", "dev").exit_code == 0
    rows = json.loads(run("config", "get-contexts", "--json").stdout)
    assert rows == [{"name": "prod", "coordinator": "head:7420", "tls_dir": str(tmp_path), "current": False},
                    {"name": "dev", "coordinator": "127.0.0.1:7420", "tls_dir": None, "current": True}]
    assert run("config", "set-context", "prod", "--coordinator", "head:7421").exit_code == 0  # tls_dir kept
    assert json.loads(run("config", "view", "--json").stdout)["contexts"]["prod"] == \
        {"coordinator": "head:7421", "tls_dir": str(tmp_path)}
    assert run("config", "delete-context", "dev").exit_code == 0
    res = run("config", "current-context")
    assert res.exit_code == 1 and "no current context" in res.output
    assert no_user_config.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in no_user_config.parent.iterdir()] == ["config.yaml"]  # no temporary file left
    # the coordinators of one replicated store: several addresses, each HOST:PORT
    assert run("config", "set-context", "ha", "--coordinator", "head1:7420,head2:7420").exit_code == 0
    bad = run("config", "set-context", "ha", "--coordinator", "head1:7420,head2")
    assert bad.exit_code == 2 and "several joined by commas" in bad.output


@pytest.mark.parametrize("text, words", [
    ("contexts: [a, b]\n", ["contexts is", "must be a mapping"]),
    ("contexts: {prod: {coordinator: 7420}}\n", ["contexts.prod.coordinator=7420", "HOST:PORT"]),
    ("contexts: {prod: {coordinator: 'head'}}\n", ["contexts.prod.coordinator='head'", "port 1-65535"]),
    ("contexts: {prod: {coordinator: 'h:1,h'}}\n", ["contexts.prod.coordinator='h:1,h'", "joined by commas"]),
    ("contexts: {prod: {coordinator: 'h:1', tls: x}}\n", ["contexts.prod.tls", "unknown field"]),
    ("contexts: {'bad name': {coordinator: 'h:1'}}\n", ["contexts.bad name", "letters, digits"]),
    ("current-context: gone\ncontexts: {prod: {coordinator: 'h:1'}}\n", ["current-context='gone'", "prod"]),
    ("contexts: {prod: {coordinator: 'h:1'\n", ["not valid YAML at line"]),
    ("- 1\n", ["holds list", "must be a mapping"]),
])
def test_a_malformed_config_file_is_a_clear_error_exit_2(no_user_config: Path, text: str, words: list[str]) -> None:
    no_user_config.parent.mkdir(parents=True)
    no_user_config.write_text(text)
    res = CliRunner().invoke(cli, ["jobs"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.output.startswith(f"error: {no_user_config}: ")
    for word in words:
        assert word in res.output


def test_an_unknown_context_is_exit_2_naming_the_file(no_user_config: Path) -> None:
    write_config(no_user_config, CONTEXTS)
    res = CliRunner().invoke(cli, ["jobs", "--context", "nope"])
    assert res.exit_code == 2 and str(no_user_config) in res.output and "no context 'nope'" in res.output
    assert "cur, other" in res.output
    res = CliRunner().invoke(cli, ["config", "use-context", "nope"])
    assert res.exit_code == 2 and "no context 'nope'" in res.output


def test_commands_that_need_no_coordinator_ignore_a_broken_config(no_user_config: Path) -> None:
    no_user_config.parent.mkdir(parents=True)
    no_user_config.write_text("{{{")
    assert run("plan", "--world-size", "8", "--tp", "2").exit_code == 0


# -- --help ends with an example ------------------------------------------------------------------
def _walk(command: click.Command, path: tuple[str, ...]):
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _walk(sub, (*path, name))


def every_command():
    ctx = click.Context(cli)
    return [item for name in sorted(COMMANDS) for item in _walk(cli.get_command(ctx, name), (name,))]


COMMAND_TREE = [((), cli), *every_command()]


@pytest.mark.parametrize("path, command", COMMAND_TREE, ids=[" ".join(("ctl", *p)) for p, _ in COMMAND_TREE])
def test_every_help_ends_with_an_example(path: tuple[str, ...], command: click.Command) -> None:
    text = (command.epilog or command.help or "").strip()
    last = text.split("\n\n")[-1].replace("\b\n", "").strip()
    assert last.startswith("Example"), f"ctl {' '.join(path)}: help ends with {last!r}"
    assert "ctl " in last
    shown = run(*path, "--help").output
    assert "Example" in shown and "Traceback" not in shown
    if command.epilog:  # printed after the options: the example block is the end of --help
        assert shown.rindex("Example") > shown.rindex("Options:") and "ctl " in shown[shown.rindex("Example"):]


# -- output to pipes and terminals ----------------------------------------------------------------
def test_a_pipe_gets_no_colour_and_an_unlimited_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("FORCE_COLOR", "1")
    c = console.stdout_console()
    assert c.width == console.PIPE_WIDTH and c.no_color and c.color_system is None and not c.is_terminal


def test_a_terminal_honours_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console, "is_terminal", lambda stream: True)
    monkeypatch.setenv("NO_COLOR", "1")
    assert console.stdout_console().no_color
    monkeypatch.delenv("NO_COLOR")
    assert not console.stdout_console().no_color


def test_a_table_to_a_pipe_has_one_line_per_row_and_no_escapes(coordinator: str) -> None:
    out = sh(f'$CTL jobs --coordinator {coordinator} --limit 5 | cat', COLUMNS="40")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if LONG_NAME in line]
    assert len(rows) == 5 and all("waiting for capacity" in row and "PENDING" in row for row in rows)
    assert max(map(len, rows)) > 120 and "\x1b[" not in out.stdout


@pytest.mark.parametrize("command", [
    "$CTL jobs --json --coordinator {address} | head -1",
    "$CTL --coordinator {address} jobs | head -3",
    "$CTL plan --world-size 4096 --tp 8 --all-ranks --json | head -c 10",
    "$CTL plan --world-size 4096 --tp 8 --all-ranks | head -1",
])
def test_a_reader_that_leaves_early_is_exit_0_without_noise(coordinator: str, command: str) -> None:
    out = sh(command.format(address=coordinator))
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and out.stdout


# -- --json on every command that prints a result -------------------------------------------------
@pytest.mark.grpc_in_process
def test_submit_cancel_jobs_status_watch_json(coordinator: str) -> None:
    res = run("submit", JOB_FILE, "--queue-anyway", "--set", "name=json-shapes", "--json", "--coordinator", coordinator)
    sub = json.loads(res.stdout)
    assert set(sub) == {"id", "name", "kind", "state", "world_size"} and sub["state"] == "PENDING"
    assert sub["name"] == "json-shapes" and sub["world_size"] == 8
    assert json.loads(run("status", sub["id"], "--json", "--coordinator", coordinator).stdout)["id"] == sub["id"]
    listed = json.loads(run("jobs", "--limit", "1", "--json", "--coordinator", coordinator).stdout)
    assert [j["id"] for j in listed] == [sub["id"]]
    cancelled = json.loads(run("cancel", sub["id"], "--json", "--coordinator", coordinator).stdout)
    assert cancelled["state"] == "CANCELLED"
    res = CliRunner().invoke(cli, ["watch", sub["id"], "--json", "--coordinator", coordinator])
    assert res.exit_code == 1 and json.loads(res.stdout)["state"] == "CANCELLED"


@pytest.mark.grpc_in_process
def test_drain_of_an_unknown_node_is_exit_2_on_stderr(coordinator: str) -> None:
    res = CliRunner().invoke(cli, ["drain", "no-such-node", "--json", "--coordinator", coordinator])
    assert res.exit_code == 2 and res.stdout == "" and res.stderr.startswith("error: ")


def test_logs_json_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from rankctl.cli.context import Ctx
    from rankctl.contract.files.logrecords import RECORD_MARK

    asked = []

    class FakeClient:
        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def logs(self, job_id: str, rank, follow: bool, tail: int, records: bool):  # noqa: ANN001
            asked.append(records)
            yield pb.LogLine(rank=0, attempt=2, line="step 1 loss 2.5")
            yield pb.LogLine(rank=3, attempt=2, line='{"not": "parsed"}')
            if records:
                yield pb.LogLine(rank=3, attempt=2, line=RECORD_MARK + '{"event": "done", "level": "info", "rank": 3}')

    monkeypatch.setattr(Ctx, "client", lambda self: FakeClient())
    res = run("logs", "j1", "--json")
    assert [json.loads(line) for line in res.output.splitlines()] == [
        {"rank": 0, "attempt": 2, "line": "step 1 loss 2.5"}, {"rank": 3, "attempt": 2, "line": '{"not": "parsed"}'}]
    assert run("logs", "j1").output == '[rank 0] step 1 loss 2.5\n[rank 3] {"not": "parsed"}\n'
    assert run("logs", "j1", "--rank", "3").output == 'step 1 loss 2.5\n{"not": "parsed"}\n'
    res = run("--json", "logs", "j1", "--records")
    assert json.loads(res.output.split("\n")[2]) == {"rank": 3, "attempt": 2, "record": {
        "event": "done", "level": "info", "rank": 3}}
    assert run("logs", "j1", "--records").output.split("\n")[2] == "[rank 3] [rankctl info] done"
    assert asked == [False, False, False, True, True]


def test_state_names_drop_the_enum_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    from rankctl.cli.view import render

    monkeypatch.setattr(render.pb.JobState, "Name", lambda v: "JOB_STATE_RUNNING")
    monkeypatch.setattr(render.pb.NodeState, "Name", lambda v: "NODE_STATE_READY")
    assert render.state_name(2) == "RUNNING" and render.node_state_name(1) == "READY"


# -- shell completion --------------------------------------------------------------------------------
def test_completion_scripts() -> None:
    for shell, word in (("bash", "complete -o"), ("zsh", "compdef"), ("fish", "complete --no-files")):
        res = run("completion", shell)
        assert res.exit_code == 0 and word in res.output and "_CTL_COMPLETE" in res.output


def test_job_ids_complete_in_a_subprocess_from_the_coordinator(coordinator: str) -> None:
    env = {**os.environ, "_CTL_COMPLETE": "bash_complete", "COMP_WORDS": f"ctl --coordinator {coordinator} status "
           f"{LONG_NAME}-11", "COMP_CWORD": "4"}
    out = subprocess.run(CTL, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() and all(line.startswith(f"plain,{LONG_NAME}-11") for line in out.stdout.splitlines())


def test_completion_is_silent_when_no_coordinator_answers() -> None:
    env = {**os.environ, "_CTL_COMPLETE": "bash_complete", "COMP_WORDS": "ctl --coordinator 127.0.0.1:9 cancel ",
           "COMP_CWORD": "4"}
    out = subprocess.run(CTL, capture_output=True, text=True, env=env, timeout=60)
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, "", "")  # click ends even no answer with a newline


@pytest.fixture
def in_process_coordinator(tmp_path: Path):
    """A coordinator on its own event loop thread with one fake node registered (no daemon)."""
    from rankctl.coordinator.model.records import NodeHello
    from rankctl.coordinator.app.server import start_coordinator

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    server = call(start_coordinator("127.0.0.1:0", tmp_path / "state", heartbeat_timeout=3600.0))

    async def register() -> None:
        server.core.register(NodeHello("gpu-node-7", "10.0.0.7", 8, session="s1"), lambda msg: None)

    call(register())
    yield server
    call(server.stop(0.1))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.mark.grpc_in_process
def test_node_names_and_job_ids_complete_in_process(in_process_coordinator) -> None:
    from rankctl.cli.client import Client

    address = in_process_coordinator.address
    with Client(address) as client:
        job = client.submit(Path(JOB_FILE).read_text(), ["name=complete-me"], "test", queue_anyway=True)
    complete = BashComplete(cli, {}, "ctl", "_CTL_COMPLETE")
    nodes = complete.get_completions(["--coordinator", address, "drain"], "gpu")
    assert [(c.value, c.help) for c in nodes] == [("gpu-node-7", "READY")]
    jobs = complete.get_completions(["status", "--coordinator", address], "comp")
    assert [(c.value, c.help) for c in jobs] == [(job.id, "complete-me PENDING")]
    assert complete.get_completions(["--coordinator", address, "cancel"], "zzz") == []


def test_a_ctx_made_in_code_ignores_the_config_file(no_user_config: Path) -> None:
    """``ctl up`` and tests talk to the cluster they started, whatever context the user has."""
    from rankctl.cli.context import Ctx

    write_config(no_user_config, CONTEXTS)
    assert (Ctx(coordinator="local:1").coordinator, Ctx(coordinator="local:1").tls_dir) == ("local:1", None)
    assert Ctx.from_options("local:1", None, None).tls_dir == "/cur"


# -- issue 23, item 8: -o, --json before the subcommand, the dashboard's port, --context completion --
def test_jobs_output_yaml_and_json_are_one_document_and_wide_has_more_columns(coordinator: str) -> None:
    as_json = sh(f"$CTL jobs --coordinator {coordinator} --limit 3 --json")
    for command in ("jobs -o json", "--json jobs", "jobs --json -o json"):
        out = sh(f"$CTL {command} --coordinator {coordinator} --limit 3")
        assert out.returncode == 0 and out.stdout == as_json.stdout, (command, out.stderr)
    yml = sh(f"$CTL jobs -o yaml --coordinator {coordinator} --limit 3")
    assert yml.returncode == 0 and yaml.safe_load(yml.stdout) == json.loads(as_json.stdout)
    wide = sh(f"$CTL jobs -o wide --coordinator {coordinator} --limit 3 | cat")
    header = wide.stdout.split("\n")[2]
    assert all(col in header for col in ("name", "kind", "attempt", "nodes", "finished")), wide.stdout
    # one line per row: the 3 newest jobs (other tests of the module add jobs beside the seeded ones)
    assert sum(" comm-check " in line for line in wide.stdout.split("\n")) == 3, wide.stdout
    both = sh(f"$CTL jobs -o yaml --json --coordinator {coordinator}")
    assert both.returncode == 2 and "--json and -o yaml" in both.stderr and both.stdout == ""


def test_json_before_the_subcommand_goes_to_it_and_one_without_json_refuses_it(coordinator: str) -> None:
    nodes = sh(f"$CTL --json --coordinator {coordinator} nodes")
    assert nodes.returncode == 0 and json.loads(nodes.stdout) == []
    config = sh("$CTL --json config get-contexts -- ")
    assert config.returncode == 0 and json.loads(config.stdout) == []
    refused = sh("$CTL --json completion bash")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "--json: `ctl completion` has no JSON output" in refused.stderr and "Traceback" not in refused.stderr


def test_the_dashboards_port_is_named_an_http_server_exit_3(coordinator: str, dashboard: str) -> None:
    out = sh(f"$CTL --coordinator {dashboard} jobs")
    assert out.returncode == 3 and out.stdout == "", out.stderr
    assert out.stderr == (f"error: {dashboard} is an HTTP server (the dashboard?), not the coordinator's gRPC "
                          "port: give --coordinator the address `ctl coordinator --listen` serves (by default "
                          "port 7420)\n")
    assert sh(f"$CTL --coordinator {coordinator} nodes").returncode == 0  # the gRPC port is no HTTP server


def test_context_names_complete_for_the_global_option(no_user_config: Path) -> None:
    write_config(no_user_config, {"current-context": "prod", "contexts": {
        "prod": {"coordinator": "head:7420"}, "prod-eu": {"coordinator": "eu:7420"}, "dev": {"coordinator": "d:1"}}})
    for words, cword in (("ctl --context pr", "2"), ("ctl jobs --context pr", "3")):
        env = {**os.environ, "_CTL_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": cword}
        out = subprocess.run(CTL, capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and out.stdout.split() == ["plain,prod", "plain,prod-eu"], (words, out)


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """A rich table's rows by their first cell, each a dict by the header's names."""
    lines = [[c.strip() for c in re.split("[│┃]", line)[1:-1]] for line in text.split("\n") if line[:1] and line[0] in "│┃"]
    return {row[0]: dict(zip(lines[0], row)) for row in lines[1:]}


@pytest.mark.parametrize("words, cword, expected", [
    ("ctl --json completion ", "3", ["plain,bash", "plain,zsh", "plain,fish"]),  # refused when run, not completing
    ("ctl --json jobs --sta", "3", ["plain,--state"]),
])
def test_completion_after_a_leading_json_flag(words: str, cword: str, expected: list[str]) -> None:
    env = {**os.environ, "_CTL_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": cword}
    out = subprocess.run(CTL, capture_output=True, text=True, env=env, timeout=60)
    assert (out.returncode, out.stdout.split(), out.stderr) == (0, expected, "")


def test_nodes_show_cpu_memory_and_gpu_use_or_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    from rankctl.cli.context import Ctx

    gib = 1 << 30
    used = pb.NodeUsage(cpu_percent=37.4, memory_used_bytes=3 * gib, memory_total_bytes=16 * gib,
                        gpus=[pb.GpuUsage(index=i, utilization=80 + 10 * i, memory_used_bytes=gib,
                                          memory_total_bytes=80 * gib) for i in range(2)])

    class FakeClient:
        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def nodes(self) -> list:
            return [pb.Node(name="g0", slots=2, usage=used), pb.Node(name="c0", slots=1)]

    monkeypatch.setattr(Ctx, "client", lambda self: FakeClient())
    rows = table_rows(run("nodes", "-o", "wide").output)
    assert {k: rows["g0"][k] for k in ("cpu", "memory", "gpu use", "per gpu")} == {
        "cpu": "37%", "memory": "3.0/16.0 GiB", "gpu use": "2x avg 85% 2.0/160.0 GiB", "per gpu": "0:80% 1:90%"}
    assert {k: rows["c0"][k] for k in ("cpu", "memory", "gpu use", "per gpu")} == dict.fromkeys(
        ("cpu", "memory", "gpu use", "per gpu"), "-")
    docs = {n["name"]: n["usage"] for n in json.loads(run("nodes", "--json").output)}
    assert docs["c0"] is None and docs["g0"]["gpus"][1] == {
        "index": 1, "utilization": 90.0, "memory_used_bytes": gib, "memory_total_bytes": 80 * gib}


def test_with_tls_the_dashboards_port_is_named_and_the_grpc_port_still_asks_for_a_certificate(
        tmp_path: Path) -> None:
    """A TLS coordinator: its HTTPS dashboard offers no HTTP/2, so it is no gRPC port (with a user's
    identity or without); its gRPC port without one still says it serves mutual TLS."""
    from cluster import http_address, start_coordinator

    from rankctl.security.certs import init_ca, issue

    init_ca(tmp_path / "ca", sans=[])
    issue(tmp_path / "ca", tmp_path / "alice", user="alice", role="admin")
    proc, address = start_coordinator(tmp_path / "coord", http_listen="127.0.0.1:0",
                                      extra=("--tls-dir", str(tmp_path / "ca" / "coordinator")))
    try:
        web = http_address(tmp_path / "coord")
        for identity in ([], ["--tls-dir", str(tmp_path / "alice")]):
            out = subprocess.run([*CTL, "--coordinator", web, *identity, "nodes"], capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 3 and f"{web} is an HTTP server (the dashboard?)" in out.stderr, out.stderr
        out = subprocess.run([*CTL, "--coordinator", address, "--tls-dir", str(tmp_path / "alice"), "nodes", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr
        out = subprocess.run([*CTL, "--coordinator", address, "nodes"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "it serves mutual TLS" in out.stderr, out.stderr
    finally:
        proc.stop()


def _interrupted() -> None:
    raise KeyboardInterrupt


INTERRUPTED = click.Command("interrupted-here", callback=_interrupted)


def test_ctrl_c_exits_130_saying_interrupted(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """click's standalone mode printed "Aborted!" and exited 1, which ctl's exit codes read as "the job failed"."""
    from rankctl.cli import main as ctl_main

    monkeypatch.setitem(COMMANDS, "interrupted-here", (__name__, "INTERRUPTED", ""))
    assert ctl_main._run(["interrupted-here"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted" and "Aborted" not in err


@pytest.mark.parametrize("args, words", [
    (["--coordinator", "bogus", "jobs"], ["--coordinator (or env RANKCTL_COORDINATOR)", "'bogus'", "HOST:PORT"]),
    (["--coordinator", "127.0.0.1:99999", "jobs"], ["'127.0.0.1:99999'", "a port 1-65535"]),
    (["logs", "j", "--rank", "2147483648"], ["--rank", "2147483648 is not in the range 0<=x<=2147483647"]),
    (["logs", "j", "--tail", "4294967296"], ["--tail", "4294967296 is not in the range"]),
    (["status", "j", "--ranks", "99999999999999999999"], ["--ranks", "0 <= A <= B <= 2147483647"]),
    (["jobs", "--limit", "-1"], ["--limit", "-1 is not in the range"]),
])
def test_addresses_and_numbers_ctl_cannot_send_are_refused_before_any_call(args: list[str], words: list[str]) -> None:
    """Each waited ~5 s for a connection or said "internal error: ValueError: Value out of range" (an outside probe)."""
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "internal error" not in res.output
    for w in words:
        assert w in res.output, (w, res.output)


def test_the_losses_table_has_step_first_whatever_order_the_wire_gave() -> None:
    """A result's rows come from a protobuf Struct, whose keys come in any order: `ctl status` showed `loss | step`
    on one call and `step | loss` on the next (an outside probe)."""
    from rankctl.cli.view.render import rows_table
    from rankctl.kinds.common import loss_tables

    for rows in ([{"loss": 2.5, "step": 1}], [{"step": 1, "loss": 2.5}], [{"tokens": 3, "loss": 2.5, "step": 1}]):
        (_, table), = loss_tables({"losses": rows}, rows_table)
        assert [c.header for c in table.columns][:2] == ["step", "loss"], rows


def test_jobs_wide_shows_how_many_nodes_a_listed_job_runs_on() -> None:
    """ListJobs names no nodes (its pages stay bounded): `ctl jobs -o wide` showed '-' for every job (a probe)."""
    from rankctl.cli.commands.jobs import _job_row
    from rankctl.cli.view.render import job_to_dict
    from rankctl.coordinator.api.convert import job_summary_pb
    from rankctl.coordinator.model.records import JobRecord
    from rankctl.coordinator.model.states import JobState
    from rankctl.kinds.spec import build_spec

    job = JobRecord(id="cc-0a1b2c", name="cc", kind="comm-check", spec=build_spec({"name": "cc"}),
                    state=JobState.RUNNING, reason="", world_size=4, slots_per_node=2, created_at=0.0,
                    nodes=["n1", "n2"])
    listed = job_to_dict(job_summary_pb(job))
    assert listed["nodes"] == [] and listed["node_count"] == 2
    assert _job_row(listed, wide=True)["nodes"] == "2"


def _running_job(world: int) -> "pb.Job":
    from rankctl.proto import rankctl_pb2 as pb

    job = pb.Job(id="gpt-0a1b2c", kind="train", state=pb.JOB_STATE_RUNNING, world_size=world, attempt=1,
                 nodes=[f"n{k}" for k in range(world // 4)],
                 ranks=[pb.RankStatus(rank=r, node=f"n{r // 4}", phase="running", step=7) for r in range(64)])
    job.summary.phases["running"] = world
    job.summary.running, job.summary.min_step, job.summary.max_step = world, 7, 7
    job.summary.preflight_ms.update({"dp": 1.0, "tp": 2.0})
    return job


def test_a_live_view_never_grows_past_its_terminal_and_a_table_title_never_wraps() -> None:
    """Issue 43, item 8: a live view taller than the terminal left copies of its head in the scrollback, and
    titles such as `losses (100 steps)` wrapped over the narrow table beneath them."""
    from rich.console import Console

    from rankctl.cli.view.render import live_view, rows_table

    for width, height in ((80, 24), (120, 40)):
        console = Console(width=width, height=height, force_terminal=True, color_system=None)
        with console.capture() as seen:
            console.print(live_view(_running_job(256), console, height))
        lines = seen.get().splitlines()
        assert len(lines) <= height - 2 and "showing ranks 0-" in seen.get(), lines
        assert any(re.match(r"│ +0 │ n0 +│ running │ +7 │", line) for line in lines), lines
        with console.capture() as seen:
            console.print(rows_table("losses (100 steps)", [{"step": 1, "loss": 2.5}]))
        assert seen.get().splitlines()[0].strip() == "losses (100 steps)", seen.get()


def test_a_job_without_steps_has_no_step_line_and_the_preflight_reads_in_layout_order() -> None:
    """`steps: 0-0` on a job without steps; the pre-flight's kinds came in the wire map's order (twice, in two
    orders, beside its event)."""
    from rankctl.cli.view.render import job_to_dict, summary_text

    job = _running_job(8)
    assert "steps: 7-7" in summary_text(job_to_dict(job)["summary"], 8).plain
    job.summary.min_step = job.summary.max_step = 0
    text = summary_text(job_to_dict(job)["summary"], 8).plain
    assert "steps:" not in text and "pre-flight: all-reduce tp 2.00 ms, dp 1.00 ms" in text, text
