"""A real Slurm cluster on this one machine, for end-to-end tests (no mocks).

One ``munged`` with its own key and socket, one ``slurmctld`` and one ``slurmd -N nK`` per node (Debian's
build has MULTIPLE_SLURMD), on ports picked free at start (they listen on all addresses; every address in
slurm.conf is 127.0.0.1). Everything lives under one base dir: key, socket, slurm.conf, state and spool dirs,
pid and log files (``log/``), job output (``out/``). Clients must use ``cluster.env`` (``SLURM_CONF``) or
``cluster.run("squeue", "-h")``. Needs root, ``slurm-wlm`` and ``munge``; ``slurm_problem()`` says why not.

From a shell, for contributors::

    python tests/slurmcluster.py up --nodes 3 --dir /tmp/slurm-x    # prints `export SLURM_CONF=...` and
                                                                     # the pids; Ctrl-C or SIGTERM stops it
    python tests/slurmcluster.py down --dir /tmp/slurm-x            # ends what the dir's pid files name

``stop()`` and ``down`` end only processes they can show are this cluster's: the pids it recorded (checked
against their start times), ``slurmstepd`` processes holding a file under the base dir, and job processes
whose environment names this cluster's ``SLURM_CONF``, with their descendants. They remove no file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cluster import free_ports

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
NUL = b"\0"
PIDS_FILE = "cluster.pids"  # "role pid starttime" per line: what `down` and `stop()` may end


class ClusterError(RuntimeError):
    """A daemon failed to start or the cluster did not become ready; the message names it."""


def slurm_problem() -> str | None:
    """Why a local cluster cannot run here, or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return f"not installed: {', '.join(missing)} (Debian packages slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- processes: which are ours, and ending them ------------------------------------------------------

def _read(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in ticks) of a live process, or None (gone or a zombie)."""
    raw = _read(pid, "stat")
    fields = raw[raw.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[19])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _protected() -> set[int]:
    """This process and its ancestors: never ours to end."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        st = _stat(pid)
        pid = st[0] if st else 0
    return out


def _holds_file_under(pid: int, base: str) -> bool:
    try:  # an fd closed meanwhile reads as "no": callers look again
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{base}/")
                   for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def job_processes(base: Path, conf: Path) -> list[int]:
    """Live ``slurmstepd`` processes of this cluster (they hold its log or spool files open), processes of
    its jobs (``SLURM_JOB_ID`` with this ``SLURM_CONF`` in their environment), and their descendants."""
    protected, found, parents = _protected(), set(), {}
    marker = b"SLURM_CONF=" + str(conf).encode()
    for pid in _pids():
        st = _stat(pid)
        if st is None or pid in protected:
            continue
        parents[pid] = st[0]
        if _read(pid, "comm").strip() == b"slurmstepd":
            if _holds_file_under(pid, str(base)):
                found.add(pid)
            continue
        env = _read(pid, "environ").split(NUL)
        if marker in env and any(v.startswith(b"SLURM_JOB_ID=") for v in env):
            found.add(pid)
    grown = True
    while grown:
        more = {p for p, pp in parents.items() if pp in found and p not in found and p not in protected}
        found |= more
        grown = bool(more)
    return sorted(found)


def end_processes(pids: list[int], grace: float = 4.0) -> None:
    """SIGTERM each, then SIGKILL whatever is still alive after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        alive = [p for p in pids if _stat(p) is not None]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in alive if _stat(p) is not None]
        if not alive:
            return


def recorded_pids(base: Path) -> list[tuple[str, int]]:
    """The (role, pid) pairs of ``base/cluster.pids`` that are still the same processes (start time),
    this process (a foreground ``up``) and its ancestors aside."""
    path, out, protected = base / PIDS_FILE, [], _protected()
    for line in (path.read_text().splitlines() if path.exists() else []):
        role, pid, start = line.split()
        st = _stat(int(pid))
        if st is not None and st[1] == int(start) and int(pid) not in protected:
            out.append((role, int(pid)))
    return out


def _cmdline(pid: int) -> str:
    return _read(pid, "cmdline").replace(NUL, b" ").decode(errors="replace").strip()


def processes_of(base: Path, any_command: bool = False) -> list[int]:
    """Live processes of the cluster under ``base``: its daemons and their forks (``base`` in the command
    line; with ``any_command`` any program naming it) and ``job_processes``. Never this one or its ancestors."""
    needle, daemons = f"{base}/".encode(), {b"munged", b"slurmctld", b"slurmd", b"slurmstepd", b"slurmscriptd"}
    named = {p for p in _pids() if needle in _read(p, "cmdline")
             and (any_command or _read(p, "comm").strip() in daemons) and _stat(p) is not None}
    return sorted((named - _protected()) | set(job_processes(base, base / "slurm.conf")))


def sweep(base: Path, grace: float = 4.0) -> None:
    """End ``processes_of(base)`` until none is left (a slurmd forks before it execs), a few rounds at most."""
    for _ in range(3):
        left = processes_of(base)
        if not left:
            return
        end_processes(left, grace)


# -- the cluster ---------------------------------------------------------------------------------------

CONF = """\
ClusterName=local
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={base}/ctld
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdSpoolDir={base}/spool/%n
SlurmdPidFile={base}/run/slurmd-%n.pid
SlurmdLogFile={base}/log/slurmd-%n.log
# the nodes' CPUs= may exceed this host's: without config_overrides slurmctld would refuse the nodes
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout=10
InactiveLimit=0
KillWait=2
# Slurm's default: an ended job's record (CANCELLED, COMPLETED ...) stays for `scontrol show job` as on a real
# cluster; at 2 s a coordinator's look at a cancelled allocation under load found it forgotten (GONE)
MinJobAge=300
"""


class SlurmCluster:
    """``nodes`` slurmd daemons (``{prefix}1`` ...) of ``cpus`` CPUs each in one partition, all under ``base``;
    ``extra_conf`` lines are appended to slurm.conf."""

    def __init__(self, base: Path, nodes: int = 3, cpus: int = 4, prefix: str = "n", partition: str = "debug",
                 timeout: float = 60.0, extra_conf: str = "") -> None:
        self.base, self.cpus, self.partition, self.timeout = Path(base).resolve(), cpus, partition, timeout
        self.names, self.extra_conf = [f"{prefix}{i}" for i in range(1, nodes + 1)], extra_conf
        self.conf, self.out_dir = self.base / "slurm.conf", self.base / "out"
        self.munge_socket = self.base / "munge" / "munge.socket.2"
        self.host = socket.gethostname().split(".")[0]  # what `hostname -s` prints
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_", "SBATCH_"))}
        self.env = {**inherited, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}
        self._started = False

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Write the config, start munged, slurmctld and every slurmd, and wait until all nodes are idle."""
        self._started = True
        try:
            self._layout()
            self._start_munge()
            self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-c", "-f", str(self.conf)])
            for name in self.names:
                self._spawn(f"slurmd-{name}", [_exe("slurmd"), "-D", "-N", name, "-f", str(self.conf)])
            self._wait(self.nodes_idle, "every node idle in sinfo")
        except BaseException:
            self.stop()
            raise

    def _layout(self) -> None:
        for sub in ("munge", "run", "log", "ctld", "out", *(f"spool/{n}" for n in self.names)):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        (self.base / PIDS_FILE).write_text("")
        ctld_port, *node_ports = free_ports(1 + len(self.names))
        text = CONF.format(host=self.host, ctld_port=ctld_port, munge_socket=self.munge_socket, base=self.base)
        for name, port in zip(self.names, node_ports):
            text += (f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                     f"CPUs={self.cpus} State=UNKNOWN\n")
        text += (f"PartitionName={self.partition} Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE "
                 "State=UP\n")
        self.conf.write_text(text + self.extra_conf)

    def _start_munge(self) -> None:
        d = self.base / "munge"
        key, mungekey = d / "munge.key", [_exe("mungekey"), "--create", f"--keyfile={d / 'munge.key'}"]
        if not key.exists() and subprocess.run(mungekey, capture_output=True).returncode != 0:
            key.write_bytes(os.urandom(1024))  # what `dd if=/dev/urandom bs=1k count=1` would write
        key.chmod(0o400)
        self._spawn("munged", [_exe("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
                               f"--seed-file={d / 'munged.seed'}",  # --log-file is unused in the foreground
                               f"--log-file={self.base / 'log' / 'munged.log'}"])
        self._wait(self.munge_socket.exists, "the munge socket", role="munged")

    def _spawn(self, role: str, args: list[str]) -> None:
        """Start a daemon in its own session (a Ctrl-C meant for us does not reach it), output in log/ROLE.out."""
        with open(self.base / "log" / f"{role}.out", "ab") as out:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env, cwd=self.base, start_new_session=True)
        self.procs[role] = proc
        st = _stat(proc.pid)
        with open(self.base / PIDS_FILE, "a") as f:
            f.write(f"{role} {proc.pid} {st[1] if st else 0}\n")

    def _wait(self, ready, what: str, timeout: float | None = None, role: str | None = None) -> None:
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.dead():
                raise ClusterError(self._failure(self._first_dead(), f"exited (while waiting for {what})"))
            if ready():
                return
            time.sleep(0.2)
        raise ClusterError(self._failure(role, f"timed out after {timeout:.0f} s waiting for {what}"))

    def _failure(self, role: str | None, what: str) -> str:
        """Who failed, how, and the tail of its output (in the foreground the daemons copy their logs there)."""
        if role is None:
            what += f"; sinfo says {self.node_states() or 'nothing'}"
        parts = [f"Slurm cluster under {self.base}: {role or 'the cluster'} {what}"]
        for r in [role] if role else [r for r in self.procs if r != "munged"]:
            parts += [f"--- {self.base / 'log' / r}.out:", _tail(self.base / "log" / f"{r}.out")]
        return "\n".join(parts)

    def _first_dead(self, settle: float = 2.0) -> str:
        """The first started of the daemons that exited, once the others had ``settle`` s to exit too: a bad
        config kills slurmctld and every slurmd alike, and under load a slurmd may go first; the controller,
        started before them, is the one that says why."""
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline and len(self.dead()) < len(self.procs):
            time.sleep(0.05)
        return self.dead()[0]

    def dead(self) -> list[str]:
        """The roles whose daemon has exited."""
        return [role for role, p in self.procs.items() if p.poll() is not None]

    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.procs.items()}

    def run(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A client command against this cluster (text output captured; run in ``out_dir``)."""
        out = subprocess.run(list(args), env=self.env, cwd=self.out_dir, capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
        if check and out.returncode != 0:
            raise ClusterError(f"{' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
        return out

    def node_states(self) -> dict[str, str]:
        """Node name -> state as sinfo prints it (``idle``, ``allocated``, ``down*`` ...); {} if unreachable."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=15)
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def nodes_idle(self) -> bool:
        states = self.node_states()
        return all(states.get(n) == "idle" for n in self.names)

    def squeue(self) -> list[dict]:
        """One dict per queued job: ``id``, ``name``, ``state``, ``nodes`` (count) and ``nodelist``."""
        jobs = []
        for line in self.run("squeue", "-h", "-o", "%i|%j|%T|%D|%N", timeout=15).stdout.splitlines():
            job_id, rest = line.split("|", 1)
            name, state, nodes, nodelist = rest.rsplit("|", 3)
            jobs.append({"id": job_id, "name": name, "state": state, "nodes": int(nodes), "nodelist": nodelist})
        return jobs

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the queue is empty and every node is idle."""
        self._wait(lambda: not self.squeue() and self.nodes_idle(), "an empty queue and idle nodes", timeout)

    def stop(self, grace: float = 4.0) -> None:
        """Cancel the jobs, end the daemons (slurmd first), then any slurmstepd or job process left.
        Safe to call twice and after a failed start; removes no file."""
        if not self._started:
            return
        if (ctld := self.procs.get("slurmctld")) is not None and ctld.poll() is None:
            self._cancel_all()
        for role in [r for r in self.procs if r.startswith("slurmd-")] + ["slurmctld", "munged"]:
            proc = self.procs.pop(role, None)
            if proc is not None:
                end_processes([proc.pid], grace)
                proc.wait()
        end_processes([pid for _, pid in recorded_pids(self.base)], grace)
        sweep(self.base, grace)
        self._started = False

    def _cancel_all(self) -> None:
        try:
            ids = [job["id"] for job in self.squeue()]
            if ids and self.run("scancel", *ids, check=False, timeout=10).returncode == 0:
                deadline = time.monotonic() + 10
                while self.squeue() and time.monotonic() < deadline:
                    time.sleep(0.2)
        except (subprocess.TimeoutExpired, ClusterError, ValueError):
            pass  # the daemons are ended next either way


def _up(args: argparse.Namespace) -> int:
    cluster = SlurmCluster(Path(args.dir), nodes=args.nodes, cpus=args.cpus, prefix=args.prefix)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background with `&`
    started = time.monotonic()
    try:
        cluster.start()
        with open(cluster.base / PIDS_FILE, "a") as f:
            f.write(f"up {os.getpid()} {_stat(os.getpid())[1]}\n")
        print(f"export SLURM_CONF={cluster.conf}")
        print(f"# up in {time.monotonic() - started:.1f} s, nodes {','.join(cluster.names)}; pids: "
              + " ".join(f"{role}={pid}" for role, pid in [*cluster.pids().items(), ("up", os.getpid())]))
        print(f"# Ctrl-C, SIGTERM or `down --dir {args.dir}` stops it", flush=True)
        while not cluster.dead():
            time.sleep(1)
        print(f"{cluster.dead()[0]} exited (see {cluster.base / 'log'}); stopping", file=sys.stderr)
        return 1
    except ClusterError as e:
        print(e, file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        began = time.monotonic()
        cluster.stop()
        print(f"# down in {time.monotonic() - began:.1f} s", file=sys.stderr)


def _down(args: argparse.Namespace) -> int:
    base = Path(args.dir).resolve()
    recorded = recorded_pids(base)
    end_processes([pid for role, pid in recorded if role == "up"], grace=30.0)  # `up` stops its own cluster
    end_processes([pid for role, pid in recorded if role.startswith("slurm")])
    end_processes([pid for _, pid in recorded_pids(base)])
    sweep(base)
    left = processes_of(base, any_command=True)
    print(f"ended {len(recorded)} recorded processes and what their jobs left", file=sys.stderr)
    for pid in left:
        print(f"still alive: {pid} {_cmdline(pid)}", file=sys.stderr)
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a cluster and keep it up until Ctrl-C or SIGTERM")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--cpus", type=int, default=4, help="CPUs per node")
    up.add_argument("--prefix", default="n", help="node names are PREFIX1..PREFIXN")
    up.add_argument("--dir", required=True, help="base directory; everything lives under it")
    down = sub.add_parser("down", help="end the processes named in the dir's pid file")
    down.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    problem = slurm_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    return _up(args) if args.command == "up" else _down(args)


if __name__ == "__main__":
    sys.exit(main())
