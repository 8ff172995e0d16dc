"""deploy/: the systemd units and the worker's Dockerfile, checked without systemd or docker running."""

from __future__ import annotations

import configparser
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNITS = {"coordinator": DEPLOY / "systemd" / "rankctl-coordinator.service",
         "coordinator-ha": DEPLOY / "systemd" / "rankctl-coordinator-ha.service",  # one of 3 on etcd (issue 27)
         "worker": DEPLOY / "systemd" / "rankctl-worker.service"}
ETCD_UNIT = DEPLOY / "systemd" / "etcd-rankctl.service"


def command_of(name: str) -> str:
    """The ctl command a unit runs (``coordinator-ha`` runs ``ctl coordinator``)."""
    return name.split("-")[0]
INSTALLED_CTL = "/opt/rankctl/venv/bin/ctl"
HEALTH_SERVER = """
import asyncio, sys
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

async def main():
    server, servicer = grpc.aio.server(), health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    for status in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING):
        await servicer.set("", status)  # the worker's overall service
        print(port, flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
    await server.stop(0)

asyncio.run(main())
"""

def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd's keys are case-sensitive
    parser.read_string(UNITS[name].read_text())
    return parser


def exec_start(name: str) -> list[str]:
    """ExecStart's words, its backslash continuations joined."""
    return shlex.split(unit(name)["Service"]["ExecStart"].replace("\\\n", " "))


def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")


def entrypoint() -> list[str]:
    [line] = [line for line in dockerfile().splitlines() if line.startswith("ENTRYPOINT")]
    return json.loads(line.removeprefix("ENTRYPOINT"))


@cache
def help_text(command: str) -> str:
    from rankctl.cli.main import cli

    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    return result.output


def options_used() -> list[tuple[str, str]]:
    """(ctl command, option) for every option the units' ExecStart and the image's ENTRYPOINT pass."""
    used = [(command_of(name), word) for name in UNITS for word in exec_start(name) if word.startswith("--")]
    return used + [("worker", word) for word in entrypoint() if word.startswith("--")]


def test_the_units_run_the_installed_ctl_as_a_dedicated_user() -> None:
    for name in UNITS:
        service = unit(name)["Service"]
        assert exec_start(name)[:2] == [INSTALLED_CTL, command_of(name)]
        assert service["Type"] == "simple" and service["User"] == "rankctl" and service["Restart"] == "on-failure"
        assert service["StateDirectory"] and service["LimitNOFILE"] and service["EnvironmentFile"]
        assert "--log-format" in exec_start(name) and "--tls-dir" in exec_start(name)
    assert "--store" in exec_start("coordinator-ha")
    worker = unit("worker")["Service"]
    assert worker["KillMode"] == "mixed"  # SIGTERM to the daemon alone: it stops its ranks
    assert "PrivateDevices" not in worker and "DevicePolicy" not in worker  # GPUs stay visible


@pytest.mark.parametrize(("command", "option"), sorted(set(options_used())))
def test_every_option_deployed_exists_in_ctl(command: str, option: str) -> None:
    assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text(command)), (
        f"ctl {command} has no {option} option")


def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the units were only parsed")
    ctl = Path(sys.executable).with_name("ctl")  # the installed path does not exist here
    for path in [*UNITS.values(), ETCD_UNIT]:
        (tmp_path / path.name).write_text(path.read_text().replace(INSTALLED_CTL, str(ctl)))
    done = subprocess.run([analyze, "verify", "--man=no", *sorted(map(str, tmp_path.iterdir()))],
                          capture_output=True, text=True, timeout=120)
    ours = [line for line in (done.stdout + done.stderr).splitlines() if "rankctl" in line]
    assert done.returncode == 0 and not ours, done.stdout + done.stderr


def test_the_dockerfile_uses_files_that_exist_and_a_torch_rankctl_accepts() -> None:
    from packaging.requirements import Requirement

    text = dockerfile()
    for line in text.splitlines():
        if line.startswith(("COPY", "ADD")):
            sources = [word for word in line.split()[1:-1] if not word.startswith("--")]
            assert sources and all((ROOT / s).exists() for s in sources), line
    assert "--mount=type=bind,source=.,target=/src" in text and 'pip install "/src[worker]"' in text
    torch_spec = re.search(r"^ARG TORCH_SPEC=(\S+)$", text, re.M).group(1)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["optional-dependencies"]["worker"]]  # the client needs no torch
    [torch] = [r for r in declared if r.name == "torch"]
    assert torch.specifier.contains(Requirement(torch_spec).specifier.__iter__().__next__().version)
    assert entrypoint()[:2] == ["ctl", "worker"] and re.search(r"^USER rankctl$", text, re.M)


def test_the_build_context_keeps_what_pip_installs() -> None:
    patterns = [p.removeprefix("**/") for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", project["project"]["readme"], *project["project"]["license-files"], "deploy/healthcheck.py",
              *project["tool"]["setuptools"]["package-dir"].values()]
    for path in needed:
        assert (ROOT / path).exists(), path
        hits = [p for p in patterns if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p)]
        assert not hits, f".dockerignore {hits} leaves {path} out of the image"


def test_the_healthcheck_probes_the_worker_health_service() -> None:
    words = entrypoint()
    listen = words[words.index("--health-listen") + 1]
    assert f'"RANKCTL_HEALTH_ADDRESS", "{listen}"' in (DEPLOY / "healthcheck.py").read_text()
    server = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        env = {**os.environ, "RANKCTL_HEALTH_ADDRESS": f"127.0.0.1:{server.stdout.readline().strip()}"}
        probe = [sys.executable, str(DEPLOY / "healthcheck.py")]
        assert subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode == 0
        server.stdin.write("\n")
        server.stdin.flush()
        server.stdout.readline()  # now NOT_SERVING
        down = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
        assert down.returncode == 1 and "NOT_SERVING" in down.stderr
    finally:
        server.stdin.close()
        server.wait(timeout=30)
