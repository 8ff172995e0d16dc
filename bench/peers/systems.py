"""The peers of ``bench/peers.py``: torchrun, NVRx ``ft_launcher`` (default and tuned) and torchft, each launched as
its users run it, on loopback, in the peers' own virtual environment; and what every side shares: the ranks' status
records, the launched processes (each in its own session, stopped by whole process trees).

A system's ``launch(where, shape, world)`` starts one job: ``flat`` (one launcher with every rank: torchrun's
``--standalone``), ``nodes`` (two launchers of two ranks, a spare started when one is lost) or ``startup`` (``world``
ranks, one launcher). The job (a ``Job``) knows how to lose a node, when it acted on a fault and whether it named the
rank; the bench (``bench/peers.py``) does the rest from the ranks' own records.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from recovery import free_port, kill_node  # noqa: E402

ELASTIC_RANK = HERE / "elastic_rank.py"
TORCHFT_RANK = HERE / "torchft_rank.py"
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE": "1"}
TUNED_YAML = """# NVRx's heartbeat guide (docs/source/fault_tolerance/integration/heartbeats.rst; its example
# examples/fault_tolerance/fault_tol_cfg_heartbeats.yaml): null timeouts, calculated by the ranks from the heartbeat
# intervals they observe (RankMonitorClient.calculate_and_set_hb_timeouts: safety_factor x the longest interval)
fault_tolerance:
  initial_rank_heartbeat_timeout: null
  rank_heartbeat_timeout: null
"""
CALC_AT = 5   # ftl-tuned: the step after which the ranks calculate their heartbeat timeouts (before the fault's)


class Records:
    """Every status line under ``out`` (``rank-R-PID.jsonl``, one file a process), read incrementally."""

    def __init__(self, out: Path) -> None:
        self.out, self.lines, self._at = out, [], {}

    def read(self) -> list[dict]:
        for path in self.out.glob("rank-*.jsonl"):
            at = self._at.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(at)
                    chunk = f.read()
            except OSError:
                continue
            whole = chunk[:chunk.rfind(b"\n") + 1]   # a line still being written waits for the next read
            self._at[path] = at + len(whole)
            for line in whole.decode(errors="replace").splitlines():
                try:
                    self.lines.append(json.loads(line))
                except ValueError:
                    pass
        return self.lines


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def in_tree(root_pid: int, pid: int) -> bool:
    """Whether ``pid`` descends from ``root_pid`` (walking its parents)."""
    while pid > 1:
        if pid == root_pid:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


class Proc:
    """One launched process in its own session, its output in ``log``."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> None:
        self.log = log
        with open(log, "ab") as fh:
            self.p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                                      env={**os.environ, **LOOPBACK, **(env or {})})

    def kill(self) -> float:
        """SIGKILL of the whole tree (stopped first, as a lost node goes); the time of the kill."""
        t = kill_node(self.p.pid) if self.p.poll() is None else time.time()
        self.p.wait(timeout=30)
        return t

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def stamp(line: str) -> float | None:
    """The local-time stamp a log line starts with (``[2026-12-07 05:34:50,010]`` or ``2026-12-07T05:36:05.153``)."""
    m = re.match(r"^\[?(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)[.,](\d+)", line)
    return None if m is None else datetime.fromisoformat(f"{m[1]}T{m[2]}.{m[3][:6]}").timestamp()


def lines_after(text: str, t0: float) -> list[str]:
    """The lines stamped at or after ``t0`` (an unstamped line goes with the stamp before it)."""
    out, keep = [], False
    for line in text.splitlines():
        t = stamp(line)
        keep = keep if t is None else t >= t0
        if keep:
            out.append(line)
    return out


class Job:
    """One launched job of a peer: its processes (``procs``; ``spare`` makes a replacement node), its records."""

    survivors_go_on = False   # torchft: the survivors take the next step without the lost rank

    def __init__(self, where: Path, world: int) -> None:
        self.where, self.world, self.procs = where, world, []
        self.out = where / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.records = Records(self.out)
        self.spare = None

    def node_of(self, pid: int) -> Proc:
        return next(p for p in self.procs if in_tree(p.p.pid, pid))

    def lose_node(self, victim_pid: int) -> tuple[float, str]:
        raise NotImplementedError

    def respawn(self, rank: int) -> None:
        """Start a lost rank again where the system itself does not (torchft)."""

    def acted(self, t_fault: float) -> float | None:
        """When the system acted on the fault by its own record (None: the bench's own observation decides)."""
        return None

    def named(self, t_fault: float, victim: int, pids: dict[int, int]) -> str:
        return "no: nothing acted"

    def stop(self) -> None:
        for p in self.procs:
            p.kill()


class ElasticJob(Job):
    """torchrun or ft_launcher: one agent (flat, startup) or two with a store host (nodes)."""

    def __init__(self, where: Path, world: int, launcher: list[str], rank_args: list[str], shape: str) -> None:
        super().__init__(where, world)
        self.launcher, self.rank_args, self.port, self.n = launcher, rank_args, free_port(), 0
        if shape == "nodes":
            self.procs = [self.agent(True), self.agent(False)]
        else:
            self.procs = [self.start([f"--nproc-per-node={world}", "--standalone"])]

    def start(self, args: list[str]) -> Proc:
        self.n += 1
        name = f"agent-{self.n}"
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: see bench/recovery.py (a replacement agent deadlocks without it)
        return Proc([*self.launcher, *args, "--max-restarts=3", "--monitor-interval=0.1", "--local-addr=127.0.0.1",
                     f"--log-dir={self.where / ('logs-' + name)}", str(ELASTIC_RANK), str(self.out), *self.rank_args],
                    self.where / f"{name}.log", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, cwd=self.where)

    def agent(self, is_host: bool) -> Proc:
        return self.start(["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                           f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=peers-bench",
                           f"--rdzv-conf=is_host={str(is_host).lower()},join_timeout=120"])

    def lose_node(self, victim_pid: int) -> tuple[float, str]:
        """The agent that does not host the rendezvous store (its loss is the job's end: no agent recovers from
        it), its ranks with it; a replacement agent at once."""
        lost = self.procs.pop(1)
        latest = {x["rank"]: x["pid"] for x in sorted(self.records.read(), key=lambda x: x["ts"])}
        ranks = ", ".join(str(r) for r, pid in sorted(latest.items()) if in_tree(lost.p.pid, pid))
        t = lost.kill()
        self.procs.append(self.agent(False))
        return t, f"the agent not hosting the rendezvous store, with ranks {ranks}; a spare agent started at once"

    def named(self, t_fault: float, victim: int, pids: dict[int, int]) -> str:
        """The ranks the launchers' lines after the fault blame: a rank monitor's timeout (``RankMonServer..:R]``)
        or the agent's first failed worker (``failed (exitcode: ..) local_rank: L (pid: P)``)."""
        blamed: set[int] = set()
        by_pid = {pid: rank for rank, pid in pids.items()}
        for p in self.procs:
            for line in lines_after(p.text(), t_fault):
                if m := re.search(r"RankMonServer\d+@[^\]]*:(\d+)\] Did not get", line):
                    blamed.add(int(m[1]))
                if (m := re.search(r"failed \(exitcode: -?\d+\) local_rank: \d+ \(pid: (\d+)\)", line)) and \
                        int(m[1]) in by_pid:
                    blamed.add(by_pid[int(m[1])])
        if not blamed:
            return "no: no line names a rank"
        ranks = ", ".join(map(str, sorted(blamed)))
        return f"yes: rank {victim}" if blamed == {victim} else f"no: names rank(s) {ranks}"


class Elastic:
    """torchrun, or ft_launcher with the FT config ``ft`` (None: torchrun) and the rank's mode."""

    def __init__(self, key: str, label: str, python: Path, ft: str | None, mode: str) -> None:
        self.key, self.label, self.python, self.ft, self.mode = key, label, python, ft, mode

    def launch(self, where: Path, shape: str, world: int) -> Job:
        where.mkdir(parents=True, exist_ok=True)
        if self.ft is None:
            launcher = [str(self.python), "-m", "torch.distributed.run"]
        else:
            launcher = [str(self.python.parent / "ft_launcher")]
            if self.ft:
                (where / "ft.yaml").write_text(self.ft)
                launcher.append(f"--ft-cfg-path={where / 'ft.yaml'}")
            else:
                launcher.append("--ignore-missing-fault-tol-cfg")   # its defaults (no config: it refuses to start)
        return ElasticJob(where, world, launcher, [self.mode], shape)


class TorchftJob(Job):
    """A Lighthouse and ``world`` replica groups of one rank each (``min_replicas`` = world - 1)."""

    survivors_go_on = True

    def __init__(self, where: Path, world: int, python: Path) -> None:
        super().__init__(where, world)
        self.python, port = python, free_port()
        self.lighthouse = f"http://127.0.0.1:{port}"
        self.min = max(1, world - 1)
        self.procs = [Proc([str(python.parent / "torchft_lighthouse"), "--bind", f"127.0.0.1:{port}",
                            "--min_replicas", str(self.min)], where / "lighthouse.log")]
        self.procs += [self.replica(r) for r in range(world)]

    def replica(self, r: int) -> Proc:
        proc = Proc([str(self.python), str(TORCHFT_RANK), str(self.out), str(r), self.lighthouse, str(self.min)],
                    self.where / f"replica-{r}.log", {"OMP_NUM_THREADS": "1"})
        proc.rank = r
        return proc

    def lose_node(self, victim_pid: int) -> tuple[float, str]:
        """The replica group of the victim (one rank: the whole group), and a replacement group at once (the
        restart that torchft leaves to the scheduler)."""
        lost = self.node_of(victim_pid)
        r = lost.rank
        t = lost.kill()
        self.respawn(r)
        return t, f"replica group {r} (its only rank); a replacement group started at once"

    def respawn(self, rank: int) -> None:
        self.procs.append(self.replica(rank))

    def acted(self, t_fault: float) -> float | None:
        """The Lighthouse's first quorum change after the fault (``Detected quorum change``)."""
        for line in lines_after(self.procs[0].text(), t_fault):
            if "Detected quorum change" in line:
                return stamp(line)
        return None

    def named(self, t_fault: float, victim: int, pids: dict[int, int]) -> str:
        words = ("timed out", "timeout", "dead", "expired", "remov", "fail", "unhealthy")
        texts = [p.text() for p in self.procs if p.p.poll() is None or p is self.procs[0]]
        for line in (ln for text in texts for ln in lines_after(text, t_fault)):
            low = line.lower()   # (a quorum's dump lists its members with their "commit_failures": no blame)
            if f"replica_{victim}:" in line and "QuorumMember" not in line and any(w in low for w in words):
                return f"yes: {line[:100]}"
        return "no: the quorum goes on without it; no line names it"


class Torchft:
    key, label = "torchft", "torchft"

    def __init__(self, python: Path) -> None:
        self.python = python

    def launch(self, where: Path, shape: str, world: int) -> Job:
        where.mkdir(parents=True, exist_ok=True)
        return TorchftJob(where, world, self.python)


def peers(venv: Path) -> dict:
    python = venv / "bin" / "python"
    return {"torchrun": Elastic("torchrun", "torchrun", python, None, "plain"),
            "ftl": Elastic("ftl", "ft_launcher", python, "", "ft"),
            "ftl-tuned": Elastic("ftl-tuned", "ft_launcher(tuned)", python, TUNED_YAML, f"ft-calc-at-{CALC_AT}"),
            "torchft": Torchft(python)}


def ensure_venv(venv: Path) -> None:
    """The peers' virtual environment: created and filled when missing (torch's CPU build first, as here)."""
    if (venv / "bin" / "ft_launcher").exists() and (venv / "bin" / "torchft_lighthouse").exists():
        return
    print(f"creating the peers' virtual environment {venv} (torch, nvidia-resiliency-ext, torchft)", flush=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    pip = str(venv / "bin" / "pip")
    subprocess.run([pip, "install", "torch==2.13.0"], check=True)
    subprocess.run([pip, "install", "nvidia-resiliency-ext", "torchft"], check=True)


def signal_pid(pid: int, sig: int) -> float:
    t = time.time()
    os.kill(pid, sig)
    return t


STOP, KILL = signal.SIGSTOP, signal.SIGKILL
