"""What mutual TLS costs a client: a plain-text cluster and an mTLS cluster side by side in one run.

Each side is a real ``ctl coordinator`` and one worker daemon (1 slot) on loopback; the mTLS side's
certificates come from ``ctl certs`` (a CA with SAN 127.0.0.1, a node identity, an admin user).
Measured on both, interleaved call by call or run by run so that machine noise hits both alike:

* status query: one ``GetJob`` (and one ``ListJobs``) through ``rankctl.cli.client.Client`` on an open
  channel, for a finished job; p50/p90/p99 over ``--calls`` calls each;
* new connection: a new ``Client`` (identity files read and checked, channel up: TCP and, on the mTLS
  side, the handshake) and its first ``GetJob``; median over ``--connects``. Each Client gets its own
  subchannel, as a new ``ctl`` process would (grpc shares connections between channels otherwise);
* ``ctl submit --wait``: wall time of the whole process for a 1-rank comm-check (CLI start-up, submit,
  placement, the rank, the watch to the end); median over ``--submits``, after one unmeasured run.
  The watch gets the job's end as soon as the coordinator stores it (whatever ``cli.view.follow.WAIT_INTERVAL``
  spaces the batches before it), so the runs no longer fall in two groups a batch interval apart.

    python bench/tls.py [--calls 300] [--connects 20] [--submits 5] [--keep]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from cluster import CTL, Proc, start_coordinator, start_worker, wait_for  # noqa: E402

import rankctl.cli.client as client_mod  # noqa: E402
from rankctl.cli.client import Client  # noqa: E402
from rankctl.proto import rankctl_pb2 as pb  # noqa: E402

NODE = "node-0"
JOB = """
name: tls-bench
kind: comm-check
resources: {nodes: 1, slots_per_node: 1}
backend: gloo
comm_check: {size_bytes: 1024, iters: 1, warmup: 0}
"""
WARM_CALLS = 20
READY = pb.NODE_STATE_READY
# a new channel must not ride on another channel's connection: each Client its own subchannel
client_mod.CHANNEL_OPTIONS = (*client_mod.CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))


@dataclass
class Side:
    """One cluster: its daemons, its address and the identity a client uses (None: plain text)."""

    name: str
    procs: list[Proc]
    address: str
    user: str | None
    job: str = ""

    def client(self) -> Client:
        return Client(self.address, tls_dir=self.user)

    def ctl(self, *args: str) -> list[str]:
        return [*CTL, "--coordinator", self.address, *(["--tls-dir", self.user] if self.user else []), *args]

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception as exc:  # noqa: BLE001 - stop the others all the same
                print(f"warning: {self.name}: stopping pid {p.pid}: {exc}", file=sys.stderr)


# -- the two clusters -----------------------------------------------------------------------------
def certs(*args: str) -> None:
    done = subprocess.run([*CTL, "certs", *args], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"ctl certs {args[0]} failed ({done.returncode}): {done.stderr.strip()}")


def make_identities(root: Path) -> tuple[str, str, str]:
    """(the coordinator's dir, the node's, an admin user's) under ``root``, all from one new CA."""
    ca = root / "ca"
    certs("init", str(ca), "--san", "127.0.0.1")
    certs("issue", str(ca), "--node", NODE, "--out", str(root / "node"))
    certs("issue", str(ca), "--user", "bench", "--role", "admin", "--out", str(root / "user"))
    return str(ca / "coordinator"), str(root / "node"), str(root / "user")


def start_side(root: Path, tls: bool) -> Side:
    """A coordinator and one 1-slot worker, READY; with ``tls``, both serve mutual TLS only."""
    root.mkdir(parents=True)
    coord_dir, node_dir, user = make_identities(root / "ids") if tls else (None, None, None)
    coord, address = start_coordinator(root / "coord", 10.0, extra=("--tls-dir", coord_dir) if tls else ())
    side = Side("mTLS" if tls else "plain", [coord], address, user)
    try:
        side.procs.append(start_worker(address, NODE, 1, root, ("--tls-dir", node_dir) if tls else (),
                                       data_roots=(), idle_warm=True))
        with side.client() as c:
            wait_for(lambda: [n.name for n in c.nodes() if n.state == READY] == [NODE], 60,
                     f"{NODE} READY ({side.name})")
    except BaseException:
        side.stop()
        raise
    return side


# -- measurements ---------------------------------------------------------------------------------
def interleaved(sides: list[Side], n: int, once: Callable[[Side], float]) -> dict[str, list[float]]:
    """``once(side)`` n times per side, the sides alternating (and which goes first, each round)."""
    out: dict[str, list[float]] = {s.name: [] for s in sides}
    for i in range(n):
        for s in sides if i % 2 == 0 else sides[::-1]:
            out[s.name].append(once(s))
    return out


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def query_latency(sides: list[Side], n: int) -> tuple[dict, dict]:
    """Per-call seconds of GetJob and of ListJobs, each side on one open channel."""
    clients = {s.name: s.client() for s in sides}
    try:
        for s in sides:
            for _ in range(WARM_CALLS):
                clients[s.name].get(s.job)
        get = interleaved(sides, n, lambda s: timed(lambda: clients[s.name].get(s.job)))
        lst = interleaved(sides, n, lambda s: timed(lambda: clients[s.name].jobs()))
    finally:
        for c in clients.values():
            c.close()
    return get, lst


def connect_once(s: Side) -> float:
    """A new Client and its first GetJob (closing it is not counted)."""
    t0 = time.perf_counter()
    c = s.client()
    try:
        c.get(s.job)
        return time.perf_counter() - t0
    finally:
        c.close()


def submit_once(s: Side, job_file: Path) -> tuple[float, str]:
    """Wall time of ``ctl submit --wait`` and the job's id; exits the bench if it fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANKCTL_TLS_DIR", "RANKCTL_COORDINATOR")}
    t0 = time.perf_counter()
    out = subprocess.run(s.ctl("submit", "--wait", str(job_file)), capture_output=True, text=True, timeout=300,
                         env=env)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{s.name}: ctl submit --wait failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return elapsed, out.stdout.split()[0]


# -- report ---------------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ys = sorted(xs)
    return ys[max(0, math.ceil(p / 100 * len(ys)) - 1)]


def ms(x: float) -> str:
    return f"{x * 1e3:.3f} ms" if x < 0.01 else f"{x * 1e3:.1f} ms"


def row(metric: str, plain: float, tls: float, unit: Callable[[float], str] = ms) -> list[str]:
    d = tls - plain
    sign = "+" if d >= 0 else "-"
    return [metric, unit(plain), unit(tls), sign + unit(abs(d)), f"{tls / plain:.2f}x"]


def table(rows: list[list[str]]) -> str:
    head = ["metric", "plain", "mTLS", "overhead", "ratio"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def rows_of(get: dict, lst: dict, conn: dict, sub: dict) -> list[list[str]]:
    out = []
    for name, xs in (("GetJob", get), ("ListJobs", lst)):
        out += [row(f"{name} p{p}", pct(xs["plain"], p), pct(xs["mTLS"], p)) for p in (50, 90, 99)]
    med = {k: {s: statistics.median(v) for s, v in d.items()} for k, d in (("conn", conn), ("sub", sub))}
    out.append(row("new connection + GetJob (median)", med["conn"]["plain"], med["conn"]["mTLS"]))
    out.append(row("ctl submit --wait (median)", med["sub"]["plain"], med["sub"]["mTLS"], lambda x: f"{x:.2f} s"))
    return out


def change(plain: float, tls: float, unit: Callable[[float], str] = ms) -> str:
    return f"{'+' if tls >= plain else '-'}{unit(abs(tls - plain))} ({(tls / plain - 1) * 100:+.0f}%)"


def verdict(get: dict, conn: dict, sub: dict) -> str:
    q = {s: pct(v, 50) for s, v in get.items()}
    c = {s: statistics.median(v) for s, v in conn.items()}
    w = {s: statistics.median(v) for s, v in sub.items()}
    return (f"TLS overhead: a status query on an open channel (p50) {change(q['plain'], q['mTLS'])}, opening "
            f"a connection (handshake, certificates) {change(c['plain'], c['mTLS'])}, a whole `ctl submit --wait` "
            f"{change(w['plain'], w['mTLS'], lambda x: f'{x:.2f} s')}")


def job_seconds(s: Side, ids: list[str]) -> float:
    """Median time from submit to end of these jobs, by the coordinator's clock."""
    with s.client() as c:
        return statistics.median((j.finish_time.ToNanoseconds() - j.create_time.ToNanoseconds()) / 1e9 for j in map(c.get, ids))


def measure(sides: list[Side], job_file: Path, ns: argparse.Namespace) -> list[str]:
    for s in sides:  # unmeasured warm-up; its finished job is the one the queries read
        _, s.job = submit_once(s, job_file)
    get, lst = query_latency(sides, ns.calls)
    conn = interleaved(sides, ns.connects, connect_once)
    ids: dict[str, list[str]] = {s.name: [] for s in sides}

    def submit(s: Side) -> float:
        t, job = submit_once(s, job_file)
        ids[s.name].append(job)
        return t

    sub = interleaved(sides, ns.submits, submit)
    notes = [f"  submit --wait runs, {s.name}: {' '.join(f'{t:.2f}' for t in sub[s.name])} s; the jobs took "
             f"{job_seconds(s, ids[s.name]):.2f} s from submit to end (median, coordinator's clock)" for s in sides]
    return [table(rows_of(get, lst, conn, sub)), verdict(get, conn, sub), *notes]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="GetJob and ListJobs calls per side")
    ap.add_argument("--connects", type=int, default=20, help="new connections per side")
    ap.add_argument("--submits", type=int, default=5, help="measured `ctl submit --wait` runs per side")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs, certificates)")
    ns = ap.parse_args()
    if min(ns.calls, ns.connects, ns.submits) < 1:
        ap.error("--calls, --connects and --submits must be at least 1")
    root = Path(tempfile.mkdtemp(prefix="rankctl-bench-tls-"))
    job_file = root / "job.yaml"
    job_file.write_text(JOB)
    sides: list[Side] = []
    t0 = time.monotonic()
    try:
        for tls in (False, True):
            sides.append(start_side(root / ("tls" if tls else "plain"), tls))
        lines = measure(sides, job_file, ns)
    finally:
        for s in sides:
            s.stop()
        if ns.keep:
            print(f"(working directory kept: {root})")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"tls bench: coordinator + 1 worker (1 slot) on loopback, plain text vs mutual TLS (EC P-256); "
          f"{ns.calls} calls, {ns.connects} connections, {ns.submits} submits per side, interleaved; "
          f"{time.monotonic() - t0:.0f} s in all")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
