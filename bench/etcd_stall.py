"""A stalled etcd under a leading coordinator: what a status query waits while etcd answers nothing.

Side by side in one run: this checkout's coordinator, which writes etcd behind its event loop
(``coordinator.ha.replicator``), and the same coordinator at ``--baseline`` (a git revision; by default the last
one that committed to etcd inside the transaction, on the loop). Each side has its own three etcd members
(``tests/etcdcluster.py``), one coordinator on ``--store etcd://...`` and two worker daemons running a python job
whose four ranks report a step every 50 ms (a report commit several times a second, as any running job).

Measured per side: ``GetJob`` on an open channel, one call every 20 ms, for 1 s before the stall and during it
(every etcd member SIGSTOPped for ``--stall`` seconds, below the coordinators' 3 s lease, so the leader stays the
leader); p50 and max of each window, and the calls answered during the stall. The ratio is the baseline's max
during the stall over ours.

    python bench/etcd_stall.py [--stall 2.5] [--baseline 3fa5cee] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
import etcdcluster  # noqa: E402
from cluster import CTL, Proc, free_ports, wait_for  # noqa: E402
from rankctl.cli.client import Client  # noqa: E402
from rankctl.cli.errors import CtlError  # noqa: E402
from rankctl.proto import rankctl_pb2 as pb  # noqa: E402

JOB = """
name: stall
kind: python
resources: {{nodes: 2, slots_per_node: 2}}
backend: gloo
python: {{entrypoint: steps.py, workdir: {workdir}}}
"""
STEPS_PY = """import time, rankctl
ctx = rankctl.context()
for step in range(1, 100000):
    time.sleep(0.05)
    ctx.report(step, loss=1.0)
"""


def package_tree(checkout: Path, into: Path) -> Path:
    """``rankctl`` of ``checkout`` as an importable tree of links (pyproject's package-dir), for PYTHONPATH."""
    dirs = tomllib.load(open(checkout / "pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
    for pkg, folder in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        target = into.joinpath(*pkg.split("."))
        if pkg == "rankctl":
            target.mkdir(parents=True)
            for name in os.listdir(checkout / folder):
                os.symlink(checkout / folder / name, target / name)
        elif not os.path.lexists(target):
            os.symlink(checkout / folder, target)
    return into


class Side:
    def __init__(self, name: str, root: Path, pythonpath: str | None) -> None:
        self.name, self.root = name, root
        env = {"PYTHONPATH": pythonpath} if pythonpath else None
        self.etcd = etcdcluster.EtcdCluster(root / "etcd")
        self.etcd.start_all()
        self.address = f"127.0.0.1:{free_ports(1)[0]}"
        self.procs = [Proc(["coordinator", "--listen", self.address, "--state-dir", str(root / "coord"),
                            "--heartbeat-timeout", "5", "--store", self.etcd.url], root / "coord.log", env=env)]
        self.procs += [Proc(["worker", "--coordinator", self.address, "--slots", "2", "--name", f"n{i}",
                             "--state-dir", str(root / f"n{i}"), "--data-root", "/"], root / f"n{i}.log", env=env)
                       for i in range(2)]
        self.client: Client | None = None
        self.refused = 0
        wait_for(lambda: self._ready(), 120, f"{name}: both nodes READY")
        (root / "steps.py").write_text(STEPS_PY)
        (root / "stall.yaml").write_text(JOB.format(workdir=root))
        out = subprocess.run([*CTL, "--coordinator", self.address, "submit", str(root / "stall.yaml")],
                             capture_output=True, text=True, check=True)
        self.job = out.stdout.split()[-1]
        wait_for(lambda: self.client.get(self.job).summary.min_step >= 20, 180, f"{name}: the job stepping")

    def _ready(self) -> bool:
        try:
            self.client = self.client or Client(self.address)
            return sum(n.state == pb.NODE_STATE_READY for n in self.client.nodes()) == 2
        except Exception:  # noqa: BLE001 - no leader yet
            return False

    def window(self, seconds: float) -> list[float]:
        """GetJob latencies, one call every 20 ms for ``seconds`` (a refused call counts its time; ``refused``)."""
        out, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            try:
                self.client.get(self.job)
            except CtlError:
                self.refused += 1
            out.append(time.perf_counter() - t)
            time.sleep(0.02)
        return out

    def stall(self, seconds: float) -> list[float]:
        for i in range(len(self.etcd.names)):
            self.etcd.kill(i, signal.SIGSTOP)
        try:
            return self.window(seconds)
        finally:
            for i in range(len(self.etcd.names)):
                self.etcd.kill(i, signal.SIGCONT)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        for p in reversed(self.procs):
            p.stop()
        self.etcd.close()


def row(name: str, before: list[float], during: list[float]) -> str:
    ms = lambda xs, f: f"{1000 * f(xs):8.1f}"  # noqa: E731
    return (f"{name:<10} {ms(before, statistics.median)} {ms(before, max)}   {ms(during, statistics.median)} "
            f"{ms(during, max)} {len(during):6d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stall", type=float, default=2.5)
    ap.add_argument("--baseline", default="3fa5cee")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if not etcdcluster.available():
        sys.exit("etcd is not installed (Debian: etcd-server)")
    tmp = Path(tempfile.mkdtemp(prefix="rankctl-etcd-stall-"))
    worktree = tmp / "baseline-checkout"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.baseline],
                   check=True, capture_output=True)
    sides: list[Side] = []
    try:
        sides.append(Side("this", tmp / "this", None))
        sides.append(Side(f"{args.baseline}", tmp / "baseline", str(package_tree(worktree, tmp / "baseline-pkg"))))
        results = []
        for side in sides:                      # one after the other: each stall alone on the machine
            before = side.window(1.0)
            results.append((side.name, before, side.stall(args.stall), side.refused))
        print(f"GetJob latency (ms), etcd stalled {args.stall:g} s (every member SIGSTOPped), a job reporting")
        print(f"{'side':<10} {'p50':>8} {'max':>8}   {'p50':>8} {'max':>8} {'calls':>6} {'refused':>8}")
        print(f"{'':<10} {'before the stall':>17}   {'during the stall':>17}")
        for name, before, during, refused in results:
            print(f"{row(name, before, during)} {refused:8d}")
        ours, theirs = max(results[0][2]), max(results[1][2])
        print(f"ratio (baseline max / this max during the stall): {theirs / ours:.1f}x")
    finally:
        for side in sides:
            side.stop()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], capture_output=True)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
