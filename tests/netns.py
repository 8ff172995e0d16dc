"""Worker daemons in their own network namespaces, so that a network partition is a fault a test can inject.

Each node gets a namespace with one veth link (``eth0``, its own address on a private /24) plugged
into a bridge in the host namespace, where the coordinator listens on the bridge's address. A
partition is the host side of a node's link going down: its streams stall without a FIN, as when
a switch port dies. In each namespace the host name resolves to 127.0.0.1 (``/etc/netns/NS/hosts``, which
``ip netns exec`` binds over ``/etc/hosts``), as on many real hosts: nothing tells gloo or NCCL which interface
to use but rankctl itself. Needs root and ``ip``; ``netns_problem()`` says why it cannot run here.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

from cluster import Proc, ready_nodes, start_coordinator, wait_for


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def netns_problem() -> str | None:
    """Why namespaces cannot be used here (not root, no ``ip``, creation refused), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"rcprobe{os.getpid() % 10000}"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"ip netns add failed: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NetnsCluster:
    """A coordinator on a bridge and one worker daemon per namespace (node-0 ... node-N-1)."""

    def __init__(self, root: Path, nodes: int, slots: int, heartbeat_timeout: float = 3.0) -> None:
        self.root, self.slots = root, slots
        tag = os.getpid() % 1000
        self.subnet = f"10.{200 + tag % 50}.{tag % 250}"
        self.bridge = f"rcbr{tag}"
        self.names = [f"node-{i}" for i in range(nodes)]
        self.ns = {n: f"rc{tag}n{i}" for i, n in enumerate(self.names)}
        self.link = {n: f"rcv{tag}n{i}" for i, n in enumerate(self.names)}
        self.addr = {n: f"{self.subnet}.{10 + i}" for i, n in enumerate(self.names)}
        self.workers: dict[str, Proc] = {}
        self.coord = None
        try:
            self._network()
            self.coord, self.address = start_coordinator(root / "coord", heartbeat_timeout,
                                                         listen=f"{self.subnet}.1:0")
            for name in self.names:
                self.start_worker(name)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name in self.names:
            ns, link = self.ns[name], self.link[name]
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
            _ip("addr", "add", f"{self.addr[name]}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            hosts = self.hosts_file(name)
            hosts.parent.mkdir(parents=True, exist_ok=True)
            hosts.write_text(f"127.0.0.1 localhost {socket.gethostname()}\n")

    def hosts_file(self, name: str) -> Path:
        """The namespace's /etc/hosts: the host name is loopback there."""
        return Path("/etc/netns") / self.ns[name] / "hosts"

    def start_worker(self, name: str) -> None:
        state = self.root / name
        state.mkdir(parents=True, exist_ok=True)
        self.workers[name] = Proc(
            ["worker", "--coordinator", self.address, "--slots", str(self.slots), "--name", name,
             "--state-dir", str(state), "--advertise-address", self.addr[name], "--insecure"],  # a private bridge
            self.root / f"{name}.log", prefix=["ip", "netns", "exec", self.ns[name]])

    def wait_ready(self, names: list[str] | None = None) -> None:
        want = sorted(names or self.names)
        wait_for(lambda: sorted(n for n in ready_nodes(self.address) if n in want) == want, 90,
                 f"nodes {want} READY")

    def partition(self, name: str) -> None:
        """Cut the node off (its link goes down on the bridge side; nothing is closed)."""
        _ip("link", "set", self.link[name], "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self.link[name], "up")

    def slow_down(self, name: str, ms: int) -> str:
        """Make what the node sends slow (its end of the veth): ``ms`` of delay with ``tc netem``; where the
        kernel has no netem (``sch_netem`` missing: "Specified qdisc kind is unknown"), a ``tc tbf`` rate at
        which a 128 KiB message takes ``ms``. Returns which, for the test's output."""
        tc = ["ip", "netns", "exec", self.ns[name], "tc", "qdisc", "replace", "dev", "eth0", "root"]
        if subprocess.run([*tc, "netem", "delay", f"{ms}ms"], capture_output=True).returncode == 0:
            return f"{ms} ms of delay (tc netem)"
        kbit = 128 * 8 * 1024 * 1000 // ms // 1000
        subprocess.run([*tc, "tbf", "rate", f"{kbit}kbit", "burst", "16kbit", "latency", "5s"], check=True,
                       capture_output=True)
        return f"a rate of {kbit} kbit/s, 128 KiB in {ms} ms (tc tbf: this kernel has no netem)"

    def cut(self, a: str, b: str) -> None:
        """Cut the link between nodes ``a`` and ``b`` only (blackhole routes both ways; the coordinator and the
        other nodes still reach both; nothing is closed)."""
        for here, there in ((a, b), (b, a)):
            _ip("route", "add", "blackhole", f"{self.addr[there]}/32", ns=self.ns[here])

    def mend(self, a: str, b: str) -> None:
        for here, there in ((a, b), (b, a)):
            _ip("route", "del", "blackhole", f"{self.addr[there]}/32", ns=self.ns[here], check=False)

    def undelay(self, name: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.ns[name], "tc", "qdisc", "del", "dev", "eth0", "root"],
                       check=False, capture_output=True)

    def stop(self) -> None:
        for w in self.workers.values():
            try:
                w.kill()
            except Exception:  # noqa: BLE001 - best effort: the namespaces go next
                pass
        if self.coord is not None:
            self.coord.stop()
        for name, ns in self.ns.items():
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(self.hosts_file(name).parent, ignore_errors=True)
        try:
            os.rmdir("/etc/netns")  # only when no other namespace keeps a file there
        except OSError:
            pass
        _ip("link", "del", self.bridge, check=False)
