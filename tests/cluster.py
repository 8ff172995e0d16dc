"""Helpers for end-to-end tests: real ``ctl coordinator`` / ``ctl worker`` processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator
from pathlib import Path

CTL = [sys.executable, "-m", "rankctl.cli.main"]


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago (all held open while choosing)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Proc:
    """A daemon subprocess with its stderr kept in a file for post-mortems."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, prefix: list[str] = ()) -> None:
        self.log = log
        self._fh = open(log, "ab")
        self.p = subprocess.Popen([*prefix, *CTL, *args], stdout=self._fh, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.p.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
        self.p.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        self._fh.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_coordinator(state: Path, heartbeat_timeout: float = 3.0, listen: str = "127.0.0.1:0",
                      extra: tuple[str, ...] = (), http_listen: str | None = None) -> tuple[Proc, str]:
    """A ``ctl coordinator`` and its gRPC address; with ``http_listen`` it serves the dashboard too (its
    address: ``http_address(state)``)."""
    state.mkdir(parents=True, exist_ok=True)
    addr_file = state / "address"
    addr_file.unlink(missing_ok=True)
    (state / "http_address").unlink(missing_ok=True)
    plain = [] if listen.startswith("127.") else ["--insecure"]  # e.g. a test bridge between namespaces
    http = ["--http-listen", http_listen] if http_listen else []
    proc = Proc(["coordinator", "--listen", listen, "--state-dir", str(state),
                 "--heartbeat-timeout", str(heartbeat_timeout), *plain, *http, *extra],
                state.parent / f"{state.name}.log")
    address = wait_for(lambda: addr_file.exists() and addr_file.read_text().strip(), 30, "coordinator address")
    return proc, address


def http_address(state: Path, timeout: float = 30) -> str:
    """The dashboard's bound ``host:port``, as the coordinator wrote it to ``state/http_address``."""
    path = state / "http_address"
    return wait_for(lambda: path.exists() and path.read_text().strip(), timeout, "dashboard address")


def start_worker(address: str, name: str, slots: int, root: Path, extra: tuple[str, ...] = (),
                 data_roots: tuple[str, ...] = ("/",), idle_warm: bool = True) -> Proc:
    """A worker daemon; by default its jobs may name any path (``data_roots=()``: the state dir only). ``idle_warm``
    False: its launcher does not warm every job kind when first idle (``--no-idle-warm``)."""
    state = root / name
    state.mkdir(parents=True, exist_ok=True)
    roots = [arg for r in data_roots for arg in ("--data-root", r)]
    return Proc(["worker", "--coordinator", address, "--slots", str(slots), "--name", name,
                 "--state-dir", str(state), *roots, *(() if idle_warm else ("--no-idle-warm",)), *extra],
                root / f"{name}.log")


def ctl(address: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + ["--coordinator", address, *args], capture_output=True, text=True, timeout=timeout)


def ctl_status(address: str, job: str) -> dict:
    """``ctl status JOB --json``, through the real command."""
    out = ctl(address, "status", job, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# What `ctl status JOB --json` prints, from one warm process per pytest process: ctl's own client and renderer,
# without an interpreter start per poll (~0.5 s of CPU each: tests that polled four times a second spent a core
# on it). No gRPC ever starts in the pytest process itself (its forked ranks would hang).
STATUS_READER = """
import json, sys
from rankctl.cli.client import Client
from rankctl.cli.view.render import job_to_dict
from rankctl.proto import rankctl_pb2 as pb
clients = {}
for line in sys.stdin:
    address, job = line.split()
    try:
        client = clients.get(address) or clients.setdefault(address, Client(address))
        if job == "-ready-nodes":   # the READY nodes' names (``ready_nodes``)
            print(json.dumps({"doc": [n.name for n in client.nodes() if n.state == pb.NODE_STATE_READY]}), flush=True)
            continue
        print(json.dumps({"doc": job_to_dict(client.get(job, rank_limit=0))}), flush=True)
    except BaseException as exc:  # noqa: BLE001 - the caller asserts on it
        old = clients.pop(address, None)
        if old is not None:
            old.close()
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


class _StatusReader:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def query(self, address: str, job: str) -> Any:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = subprocess.Popen([sys.executable, "-c", STATUS_READER], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, text=True, bufsize=1)
            self.proc.stdin.write(f"{address} {job}\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            self.proc = None
            raise AssertionError("the status reader died")
        answer = json.loads(line)
        assert "error" not in answer, answer.get("error")
        return answer["doc"]


_READER = _StatusReader()


EVENTS = """
import json, sys
from rankctl.cli.client import Client
with Client(sys.argv[1]) as c:
    print(json.dumps([[ev.kind, ev.message, ev.event_time.ToNanoseconds() / 1e9] for ev in c.watch(sys.argv[2])]))
"""


def timed_events(address: str, job: str) -> list[tuple[str, str, float]]:
    """The job's events so far, (kind, message, when the coordinator recorded it: epoch seconds), through WatchJob
    in a subprocess (no gRPC in the test process)."""
    out = subprocess.run([sys.executable, "-c", EVENTS, address, job], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [(k, m, t) for k, m, t in json.loads(out.stdout)]


def events(address: str, job: str) -> list[tuple[str, str]]:
    """The job's events so far, (kind, message)."""
    return [(k, m) for k, m, _ in timed_events(address, job)]


def status(address: str, job: str) -> dict:
    """What ``ctl status JOB --json`` says (``ctl_status``), read cheaply: for polls."""
    return _READER.query(address, job)


def wait_state(address: str, job: str, states: set[str], timeout: float) -> dict:
    """The job's status once its state is one of ``states``: polled cheaply, then read through ``ctl status`` (that
    reading, if the job is still in one of ``states``; a job that moved on meanwhile: the poll's)."""
    seen = wait_for(lambda: (s := status(address, job))["state"] in states and s, timeout, f"{job} in {states}")
    final = ctl_status(address, job)
    return final if final["state"] in states else seen


def ready_nodes(address: str) -> list[str]:
    """The READY nodes' names, read by the warm reader (none while the coordinator does not answer)."""
    try:
        return _READER.query(address, "-ready-nodes")
    except AssertionError:
        return []


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _written_status_files(pid: str) -> list[str]:
    """The rank status files (``rank-R.status.jsonl``) a process holds open for writing: a rank holds its own
    (``runtime.status.StatusWriter``); a daemon's tailer only reads them."""
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not target.endswith(".status.jsonl"):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration, ValueError):
            continue
        if flags & 3:  # O_WRONLY or O_RDWR
            found.append(target)
    return found


def rank_pids(job_id: str) -> list[int]:
    """PIDs of a job's live rank processes: each writes its status file under ``jobs/<job_id>/``."""
    return sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit()  # a rank before a child it forked
                  and any(f"/jobs/{job_id}/" in t for t in _written_status_files(entry)) and alive(int(entry)))


class ProcCluster:
    """A real ``ctl coordinator`` and worker daemons (one process each) on loopback."""

    def __init__(self, root: Path, names: list[str], slots: int, heartbeat_timeout: float = 3.0,
                 http_listen: str | None = None, coord_extra: tuple[str, ...] = (),
                 data_roots: tuple[str, ...] = ("/",)) -> None:
        self.root, self.slots, self.heartbeat_timeout = root, slots, heartbeat_timeout
        self.data_roots = data_roots
        self.coord, self.address = start_coordinator(root / "coord", heartbeat_timeout, http_listen=http_listen,
                                                     extra=coord_extra)
        self.http_url = f"http://{http_address(root / 'coord')}" if http_listen else None
        self.workers = {name: start_worker(self.address, name, slots, root, data_roots=data_roots) for name in names}
        self.wait_ready()

    def wait_ready(self) -> None:
        names = sorted(self.workers)
        wait_for(lambda: sorted(ready_nodes(self.address)) == names, 60, f"workers {names} READY")

    def restart_worker(self, name: str) -> None:
        self.workers[name] = start_worker(self.address, name, self.slots, self.root, data_roots=self.data_roots)
        self.wait_ready()

    def submit(self, *args: str) -> str:
        out = ctl(self.address, "submit", *args)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def wait_state(self, job: str, states: set[str], timeout: float) -> dict:
        return wait_state(self.address, job, states, timeout)

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.coord.stop()


def rank_pid(job: str, rank: int) -> int:
    """The pid of one rank of the job: the process writing its ``rank-R.status.jsonl``."""
    for pid in rank_pids(job):
        if any(t.endswith(f"/rank-{rank}.status.jsonl") for t in _written_status_files(str(pid))):
            return pid
    raise AssertionError(f"no process of rank {rank} of job {job}")


class Throttle:
    """SIGSTOP / SIGCONT one process in turn (a thread): stopped ``stop_s``, then running ``run_s``, over and over,
    until ``stop``, which always leaves it running (a CPU throttled to ``run_s / (stop_s + run_s)``)."""

    def __init__(self, pid: int, stop_s: float, run_s: float) -> None:
        self.pid, self.stop_s, self.run_s, self._done = pid, stop_s, run_s, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.run_s)
        except ProcessLookupError:
            pass
        finally:
            self._cont()

    def _cont(self) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        self._cont()


def status_files(root: Path, job_id: str, attempt: int | str = "*") -> Iterator[tuple[str, int, int, Path]]:
    """(node, attempt, rank, path) of each rank status file of the job's ``attempt`` ("*": every attempt's) under
    ``root`` (each node's state dir)."""
    for path in Path(root).glob(f"*/jobs/{job_id}/{attempt}/rank-*.status.jsonl"):
        yield path.relative_to(root).parts[0], int(path.parent.name), int(path.name.split("-")[1].split(".")[0]), path


def status_records(path: Path) -> Iterator[dict]:
    """The records of one rank status file, as its rank wrote them; a torn last line (a rank writing it now, or
    killed while it did) is skipped."""
    for line in path.read_text(errors="replace").splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            continue


def rank_steps(root: Path, job_id: str, attempt: int) -> dict[int, tuple[str, int]]:
    """rank -> (its node, the highest step it wrote) for every rank of ``attempt`` with a status file under
    ``root`` (each node's state dir): what the ranks did, read at once, without asking the coordinator (a
    ``ctl status`` process takes seconds on a loaded machine, long enough for a short job to end)."""
    return {rank: (node, _highest(path)) for node, _, rank, path in status_files(root, job_id, attempt)}


def stepping(root: Path, job_id: str, world: int, step: int, timeout: float = 240) -> dict:
    """Wait until every rank of attempt 1 has written ``step``; a status-like dict: ``nodes`` (job node k runs
    ranks k*slots..), ``summary.min_step``."""
    def ready():  # noqa: ANN202
        steps = rank_steps(root, job_id, 1)
        return len(steps) == world and min(s for _, s in steps.values()) >= step and steps
    steps = wait_for(ready, timeout, f"every rank of {job_id} past step {step}", interval=0.05)
    nodes = list(dict.fromkeys(steps[r][0] for r in sorted(steps)))
    return {"nodes": nodes, "summary": {"min_step": min(s for _, s in steps.values())}}


def _highest(path: Path) -> int:
    top = 0
    for record in status_records(path):
        step = record.get("step")
        if isinstance(step, int) and step > top:
            top = step
    return top


def highest_step(root: Path, job_id: str, attempt: int) -> int:
    """The highest step any rank of ``attempt`` wrote to its status file (every node's state dir under
    ``root``): how far the attempt really got, which a status query taken just before a fault understates
    (the summary follows batched reports)."""
    return max((step for _, step in rank_steps(root, job_id, attempt).values()), default=0)
