"""Job start-up latency: rankctl's warm daemon vs torchrun, side by side in one run.

rankctl: a coordinator and one worker daemon (8 slots) are already running; we time
``ctl submit --wait`` of an 8-rank comm-check on that node (CLI start, submit, placement,
fork of 8 ranks from the warm launcher, rendezvous, groups, all-reduce + all-gather, exit).
torchrun: ``torchrun --standalone --nproc-per-node 8`` of a minimal gloo script (init,
one group, one all-reduce). Each is run ``--repeat`` times; medians and the ratio are printed.

    python bench/startup.py [--repeat 3] [--ranks 8]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster import CTL, ready_nodes, start_coordinator, start_worker, wait_for  # noqa: E402

MINIMAL = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
g = dist.new_group(list(range(dist.get_world_size())))
t = torch.ones(1)
dist.all_reduce(t, group=g)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""

JOB = """
name: startup-bench
kind: comm-check
resources: {{nodes: 1, slots_per_node: {ranks}}}
backend: gloo
comm_check: {{size_bytes: 1024, iters: 1, warmup: 0}}
"""


def timed(cmd: list[str], **kw) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8)
    ns = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rankctl-bench-startup-"))
    job, script = root / "job.yaml", root / "minimal.py"
    job.write_text(JOB.format(ranks=ns.ranks))
    script.write_text(MINIMAL)
    coord, address = start_coordinator(root / "coord")
    worker = start_worker(address, "bench-node", ns.ranks, root)
    try:
        wait_for(lambda: ready_nodes(address) == ["bench-node"], 120, "the worker to register")
        ours, theirs = [], []
        for _ in range(ns.repeat):  # interleaved, so both see the same machine load
            ours.append(timed(CTL + ["--coordinator", address, "submit", "--wait", str(job)], timeout=300))
            theirs.append(timed([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc-per-node={ns.ranks}", str(script)], timeout=600, cwd=root))
    finally:
        worker.stop()
        coord.stop()
    m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
    print(f"start-up bench: {ns.ranks} ranks on one node, gloo, median of {ns.repeat}")
    print(f"  rankctl  ctl submit --wait (warm daemon) : {m_ours:7.2f} s   runs {[round(t, 2) for t in ours]}")
    print(f"  torchrun --nproc-per-node {ns.ranks} (minimal) : {m_theirs:7.2f} s   runs {[round(t, 2) for t in theirs]}")
    print(f"  rankctl is {m_theirs / m_ours:.1f}x faster")


if __name__ == "__main__":
    main()
