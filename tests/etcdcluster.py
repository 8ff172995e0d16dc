"""A real etcd cluster on loopback for tests and benchmarks: ``members`` Debian ``etcd`` processes, each with
its own client and peer port (free loopback ports) and data dir, ended by PID.

    with EtcdCluster(tmp) as etcd:
        etcd.url              # etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/rankctl
        etcd.kill(0)          # SIGKILL one member
        etcd.stop_all(); etcd.start_all()   # every member down, then back with its data

Timing is set for a shared, loaded machine (heartbeat 100 ms, election 1,500 ms). Data dirs are under
``root``; ``/dev/shm`` is used when it exists so that etcd's fsyncs cost nothing on CI disks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from cluster import free_ports

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL = shutil.which("etcdctl") or "/usr/bin/etcdctl"


def available() -> bool:
    return Path(ETCD).exists() and os.access(ETCD, os.X_OK)


class EtcdCluster:
    def __init__(self, root: Path | str | None = None, members: int = 3, prefix: str = "/rankctl") -> None:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.root = Path(tempfile.mkdtemp(prefix="rankctl-etcd-", dir=base))
        self.logs = Path(root) if root is not None else self.root
        self.logs.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        ports = free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        self.procs: list[subprocess.Popen | None] = [None] * members
        self._started = [False] * members

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    @property
    def url(self) -> str:
        return f"etcd://{','.join(self.endpoints)}{self.prefix}"

    def _cmd(self, i: int) -> list[str]:
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        return [
            ETCD, "--name", self.names[i], "--data-dir", str(self.root / self.names[i]),
            "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--initial-cluster", initial, "--initial-cluster-token", self.root.name,
            "--initial-cluster-state", "existing" if self._started[i] else "new",
            "--heartbeat-interval", "100", "--election-timeout", "1500",
            "--log-level", "warn", "--logger", "zap",
        ]

    def start(self, i: int) -> None:
        out = open(self.logs / f"etcd-{self.names[i]}.log", "ab")
        self.procs[i] = subprocess.Popen(self._cmd(i), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        out.close()
        self._started[i] = True

    def start_all(self, timeout: float = 30.0) -> None:
        for i in range(len(self.names)):
            if self.procs[i] is None or self.procs[i].poll() is not None:
                self.start(i)
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until a write through the cluster succeeds (a leader exists)."""
        end = time.monotonic() + timeout
        while True:
            try:   # etcdctl gives up after its --command-timeout (5 s); the process is killed only past that
                r = self.ctl("put", f"{self.prefix}-probe", "1", check=False, timeout=8)
                ok, why = r.returncode == 0, r.stderr.strip()
            except subprocess.TimeoutExpired:   # a put waiting on an election: not healthy yet (CI saw it escape)
                ok, why = False, "etcdctl put did not return within 8 s"
            if ok:
                return
            if time.monotonic() > end:
                raise RuntimeError(f"etcd cluster not healthy after {timeout} s: {why}")
            time.sleep(0.2)

    def ctl(self, *args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
        env = {**os.environ, "ETCDCTL_API": "3"}
        return subprocess.run([ETCDCTL, "--endpoints", ",".join(self.endpoints), "--dial-timeout", "2s",
                               "--command-timeout", "5s", *args],
                              capture_output=True, text=True, env=env, check=check, timeout=timeout)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                proc.wait(15)

    def stop_all(self) -> None:
        for i in range(len(self.names)):
            self.kill(i, signal.SIGKILL)

    def __enter__(self) -> "EtcdCluster":
        self.start_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                proc.kill()
                proc.wait(15)
        shutil.rmtree(self.root, ignore_errors=True)
