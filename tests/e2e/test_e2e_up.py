"""``ctl up`` shows one final status (issue 23, item 2): on a terminal (a tmux pane, read back with
``capture-pane``), and with stdout redirected to a file, which holds exactly the final status (``--json``:
the JSON alone) and nothing of the progress."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from cluster import CTL

REPO = Path(__file__).resolve().parents[2]
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


TRAIN = REPO / "examples" / "gpt-tp-dp.yaml"
TRAIN_STEPS = 30


def _frames_until_done(sock: str, done: Path, timeout: float = 300) -> list[str]:
    """What the pane showed, read back every 0.3 s until ``done`` exists."""
    frames, deadline = [], time.monotonic() + timeout
    while not done.exists() and time.monotonic() < deadline:
        frames.append(_tmux(sock, "capture-pane", "-p", "-t", "up"))
        time.sleep(0.3)
    return frames


def test_an_80_column_terminal_shows_each_ranks_phase_move_and_every_line_once(tmux: str, tmp_path: Path) -> None:
    """Issue 43, item 8: each rank's phase froze at its first one (a node's ranks report as one, and the view
    updated its last rank only) while the summary said running; the pre-flight line came twice, with
    "GPUs: no NVIDIA driver" on a CPU cluster; the head line stayed behind in the scrollback; table titles
    wrapped. A train job prints its steps (``[rank 3] step ...``) above the view."""
    done = tmp_path / "exit"
    cmd = (f"{' '.join(CTL)} up {TRAIN} --set train.steps={TRAIN_STEPS} --set train.eval_every=10 "
           f"--state-dir {tmp_path / 'state'}; echo $? > {done}; sleep 300")
    _tmux(tmux, "new-session", "-d", "-x", "80", "-y", "40", "-s", "up", "-c", str(REPO), cmd)
    frames = _frames_until_done(tmux, done)
    screen = _tmux(tmux, "capture-pane", "-p", "-S", "-", "-t", "up")   # the scrollback too
    assert done.exists() and done.read_text().strip() == "0", screen
    stepping = [f for f in frames if "RUNNING" in f and _phases(f) == {"running"} and _steps(f) - {0}]
    assert stepping, "no frame shows all 4 ranks running at a step:\n" + "\n----\n".join(frames[-5:])
    assert screen.count("  SUCCEEDED  attempt 1") == 1 and "  RUNNING  attempt 1" not in screen, screen
    assert screen.count("pre-flight: ") == 1 and "NVML" not in screen and "GPUs" not in screen, screen
    assert f"losses ({TRAIN_STEPS} steps)\n" in screen and "val losses (3 steps)\n" in screen, screen
    assert f"[rank 3] step {TRAIN_STEPS}/{TRAIN_STEPS}  loss " in screen, screen


def _rank_rows(frame: str) -> list[list[str]]:
    """The rows of a frame's rank table: [rank, node, phase, step, exit]."""
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in frame.splitlines() if line.startswith("│")]
    return [r for r in rows if len(r) == 5 and r[0].isdigit()]


def _phases(frame: str) -> set[str]:
    rows = _rank_rows(frame)
    return {r[2] for r in rows} if len(rows) == 4 else set()


def _steps(frame: str) -> set[int]:
    return {int(r[3]) for r in _rank_rows(frame) if r[3].isdigit()}


def test_up_of_a_python_example_shows_what_each_rank_printed(tmp_path: Path) -> None:
    """Issue 43, item 8: `ctl up examples/python-torchrun.yaml` showed none of the script's output; each line
    now comes on stderr as it is printed, after [rank R]. A job without steps has no `steps: 0-0` line."""
    out = tmp_path / "stdout"
    with open(out, "w") as fh:
        proc = subprocess.run([*CTL, "up", str(REPO / "examples" / "python-torchrun.yaml"), "--state-dir",
                               str(tmp_path / "state")], stdout=fh, stderr=subprocess.PIPE, text=True, timeout=240,
                              cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    for rank in range(4):
        assert f"[rank {rank}] rank {rank}/4 (local {rank % 2}/2, node {rank // 2}, " in proc.stderr, proc.stderr
    assert "all_reduce sum 20, expected 20; hello from rankctl" in proc.stderr
    assert "SUCCEEDED" in out.read_text() and "steps:" not in out.read_text(), out.read_text()


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.yaml")))
def test_every_example_prints_its_final_status_once_and_no_component_log_record(tmp_path: Path, example: str) -> None:
    """Issue 53, items 4 and 5: ``ctl up EXAMPLE > out 2>&1`` (a CI log) printed the final status twice (once from
    the live view on stderr, once on stdout) and, on a loaded machine, the daemons' raw ``rank stalled`` records.
    Both streams into one file now hold progress, the ranks' lines and one final status; the components' records
    go to their log file."""
    from test_e2e_run import component_records

    out = tmp_path / "out.txt"
    with open(out, "w") as f:   # (restarts: a rendezvous port another test's process took between the node's report
        # of it and rank 0's bind fails an attempt; the output is what this test reads, not the first attempt's luck)
        code = subprocess.run([*CTL, "up", str(REPO / "examples" / example), "--set", "restart.max_restarts=2"],
                              stdout=f, stderr=subprocess.STDOUT, timeout=600).returncode
    text = out.read_text()
    assert code == 0, text[-3000:]
    assert sum(bool(re.search(r"SUCCEEDED  attempt \d", line)) for line in text.splitlines()) == 1, text[-3000:]
    assert component_records(text) == [], component_records(text)[:5]
    assert "UserWarning" not in text, text[-3000:]   # item 12: Megatron-Core's CPU-only warnings buried its output
