"""Job start-up latency: rankctl's warm daemon vs torchrun, side by side in one run.

rankctl: a coordinator and one worker daemon (8 slots) are already running; we time
``ctl submit --wait`` of an 8-rank comm-check on that node (CLI start, submit, placement,
fork of 8 ranks from the warm launcher, rendezvous, groups, all-reduce + all-gather, exit).
torchrun: ``torchrun --standalone --nproc-per-node 8`` of a minimal gloo script (init,
one group, one all-reduce). Each is run ``--repeat`` times, alternating; medians and the ratio
are printed, and each run's phase timeline (seconds after the command started): rankctl's from
the coordinator's event times, torchrun's from timestamps its ranks write. ``--load N`` runs N
busy-loop processes beside the bench for its whole duration.

    python bench/startup.py [--repeat 3] [--ranks 8] [--load 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster import CTL, ready_nodes, start_coordinator, start_worker, wait_for  # noqa: E402

MINIMAL = """
import json, os, sys, time
marks = {"started": time.time()}
import torch, torch.distributed as dist
dist.init_process_group("gloo")
marks["initialised"] = time.time()
g = dist.new_group(list(range(dist.get_world_size())))
t = torch.ones(1)
dist.all_reduce(t, group=g)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
marks["done"] = time.time()
with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json"), "w") as f:
    json.dump(marks, f)
"""

JOB = """
name: startup-bench
kind: comm-check
resources: {{nodes: 1, slots_per_node: {ranks}}}
backend: gloo
comm_check: {{size_bytes: 1024, iters: 1, warmup: 0}}
"""

OURS = ("submitted", "placed", "all running", "all exited", "terminal", "ctl returned")
THEIRS = ("all started", "all initialised", "all done", "torchrun returned")


def run(cmd: list[str], **kw) -> tuple[float, float, str]:
    """(unix start, seconds taken, stdout) of a command that must succeed."""
    start, t0 = time.time(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return start, elapsed, out.stdout


def rankctl_marks(address: str, job_id: str, start: float, elapsed: float) -> dict[str, float]:
    """Seconds after ``ctl`` started at which the coordinator recorded each phase of the job."""
    from rankctl.cli.context import Ctx
    from rankctl.proto import rankctl_pb2 as pb

    with Ctx(coordinator=address).client() as client:
        events = list(client.watch(job_id))
    at = {}
    for ev in events:
        t = ev.event_time.seconds + ev.event_time.nanos / 1e9
        at.setdefault("submitted", t)
        if ev.kind == "transition" and ev.state == pb.JOB_STATE_PLACED:
            at.setdefault("placed", t)
        if ev.kind == "rank" and ev.rank.phase == "running" and not ev.rank.exited:
            at["all running"] = t
        if ev.kind == "rank" and ev.rank.exited:
            at["all exited"] = t
        at["terminal"] = t
    marks = {k: v - start for k, v in at.items()}
    marks["ctl returned"] = elapsed
    return marks


def torchrun_marks(out: Path, ranks: int, start: float, elapsed: float) -> dict[str, float]:
    files = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]
    marks = {f"all {k}": max(f[k] for f in files) - start for k in ("started", "initialised", "done")}
    marks["torchrun returned"] = elapsed
    return marks


def timeline(marks: dict[str, float], names: tuple[str, ...]) -> str:
    return "  ".join(f"{n} {marks[n]:5.2f}" if n in marks else f"{n} -" for n in names)


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def bench(ns: argparse.Namespace, root: Path, address: str) -> tuple[list, list]:
    job, script = root / "job.yaml", root / "minimal.py"
    job.write_text(JOB.format(ranks=ns.ranks))
    script.write_text(MINIMAL)
    ours, theirs = [], []
    for k in range(ns.repeat):  # interleaved, so both see the same machine load
        start, took, stdout = run(CTL + ["--coordinator", address, "submit", "--wait", str(job)], timeout=300)
        ours.append((took, rankctl_marks(address, stdout.split()[0], start, took)))
        out = root / f"torchrun-{k}"
        out.mkdir()
        start, took, _ = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={ns.ranks}", str(script), str(out)], timeout=600, cwd=root)
        theirs.append((took, torchrun_marks(out, ns.ranks, start, took)))
    return ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--load", type=int, default=0, help="busy-loop processes to run beside the bench")
    ns = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rankctl-bench-startup-"))
    coord, address = start_coordinator(root / "coord")
    worker = start_worker(address, "bench-node", ns.ranks, root, idle_warm=True)   # as users run it
    load = []
    try:
        wait_for(lambda: ready_nodes(address) == ["bench-node"], 120, "the worker to register")
        load = busy(ns.load)
        ours, theirs = bench(ns, root, address)
    finally:
        for p in load:
            p.kill()
            p.wait()
        worker.stop()
        coord.stop()
    m_ours, m_theirs = statistics.median(t for t, _ in ours), statistics.median(t for t, _ in theirs)
    print(f"start-up bench: {ns.ranks} ranks on one node, gloo, median of {ns.repeat}, {ns.load} busy loop(s) beside")
    print(f"  rankctl  ctl submit --wait (warm daemon) : {m_ours:7.2f} s   runs {[round(t, 2) for t, _ in ours]}")
    print(f"  torchrun --nproc-per-node {ns.ranks} (minimal) : {m_theirs:7.2f} s   runs {[round(t, 2) for t, _ in theirs]}")
    print(f"  rankctl is {m_theirs / m_ours:.1f}x faster")
    print("  timelines (s after the command started):")
    for (_, mine), (_, other) in zip(ours, theirs):
        print(f"    rankctl : {timeline(mine, OURS)}")
        print(f"    torchrun: {timeline(other, THEIRS)}")


if __name__ == "__main__":
    main()
