"""``ctl up`` shows one final status (issue 23, item 2): on a terminal (a tmux pane, read back with
``capture-pane``), and with stdout redirected to a file, which holds exactly the final status (``--json``:
the JSON alone) and nothing of the progress."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from cluster import CTL

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "examples" / "comm-check.yaml"
HEADER = "SUCCEEDED  attempt 1"  # the first line of a job's view


def _tmux(sock: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def tmux(tmp_path: Path):
    if shutil.which("tmux") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("tmux is not installed (.ci/run installs it)")
        pytest.skip("tmux is not installed")
    sock = f"rankctl-test-{os.getpid()}"
    yield sock
    subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)


def test_a_terminal_shows_the_final_status_once(tmux: str, tmp_path: Path) -> None:
    done = tmp_path / "exit"
    cmd = f"{' '.join(CTL)} up {JOB} --state-dir {tmp_path / 'state'}; echo $? > {done}; sleep 300"
    _tmux(tmux, "new-session", "-d", "-x", "160", "-y", "120", "-s", "up", "-c", str(REPO), cmd)
    deadline = time.monotonic() + 240
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    screen = _tmux(tmux, "capture-pane", "-p", "-t", "up")
    assert done.exists() and done.read_text().strip() == "0", screen
    headers = [n for n, line in enumerate(screen.splitlines()) if HEADER in line]
    assert len(headers) == 1, screen
    assert "comm-check per kind" in screen and screen.count("comm-check per kind") == 1, screen


def _up_to_file(tmp_path: Path, *extra: str) -> tuple[str, str]:
    out = tmp_path / "stdout"
    with open(out, "w") as fh:
        proc = subprocess.run([*CTL, "up", str(JOB), "--state-dir", str(tmp_path / "state"), *extra],
                              stdout=fh, stderr=subprocess.PIPE, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return out.read_text(), proc.stderr


def test_stdout_to_a_file_holds_exactly_the_final_status(tmp_path: Path) -> None:
    text, err = _up_to_file(tmp_path)
    lines = text.splitlines()
    assert HEADER in lines[0] and sum(HEADER in line for line in lines) == 1, text
    assert "comm-check per kind" in text
    for progress in ("starting a coordinator", "submitted "):  # stderr's lines, not the results'
        assert progress not in text and progress in err, (text, err)


def test_stdout_to_a_file_with_json_holds_the_json_alone(tmp_path: Path) -> None:
    text, err = _up_to_file(tmp_path, "--json")
    doc = json.loads(text)  # the whole file is one JSON document
    assert doc["state"] == "SUCCEEDED" and doc["world_size"] == 8, doc
    assert "submitted " in err and HEADER in err  # the live view's last frame stays on stderr
