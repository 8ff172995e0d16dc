"""What in-memory snapshots (``train.snapshot_every``) cost per step, against no snapshot and against a disk
checkpoint at the same interval, side by side in one run.

A real ``ctl coordinator`` and two worker daemons (1 slot each) on loopback run the same train job (a GPT
of ``--hidden`` x ``--layers``, data parallel over the 2 nodes, gloo) once per setting, the settings
interleaved over ``--rounds`` rounds so that machine noise hits all of them alike:

* ``none``: no snapshot, no checkpoint (the baseline);
* ``snapshot_every K``: a copy of the rank's state (model, AdamW moments, RNG, history) at the step
  boundary, written to the node's tmpfs by a background thread and pushed to the peer node by the daemon;
* ``checkpoint_every K``: the same state written synchronously to the node's disk (and replicated).

Per step: the median of the ranks' step intervals (``ts`` of consecutive ``running`` records in each
rank's ``rank-R.status.jsonl``), over steps after the warm-up. Prints each setting's median and mean
step time, its overhead against ``none`` per step, and per snapshot/checkpoint (overhead x K).

    python bench/snapshot_cost.py [--steps 40] [--hidden 256] [--layers 4] [--every 1 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from cluster import ProcCluster  # noqa: E402

JOB = """
name: {name}
kind: train
resources: {{nodes: 2, slots_per_node: 1}}
backend: gloo
model: {{layers: {layers}, hidden: {hidden}, heads: 4, seq_len: 64, vocab: 256}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 4, lr: 1.0e-3, warmup: 2, seed: 5, data: builtin:pydoc,
         {save}}}
"""
WARMUP = 3


def intervals(root: Path, job: str) -> list[float]:
    """Every rank's step intervals after the warm-up (seconds)."""
    out = []
    for path in root.glob(f"*/jobs/{job}/1/rank-*.status.jsonl"):
        ts = {}
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("phase") == "running" and isinstance(rec.get("step"), int):
                ts[rec["step"]] = rec["ts"]
        out += [ts[s] - ts[s - 1] for s in sorted(ts) if s > WARMUP and s - 1 in ts]
    return out


def state_bytes(root: Path) -> int:
    """Size of rank 0's newest checkpoint file under ``root`` (a snapshot holds the same state)."""
    files = sorted(root.rglob("rank-00000.pt"), key=lambda p: p.stat().st_mtime)
    return files[-1].stat().st_size if files else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--every", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--rounds", type=int, default=2)
    ns = ap.parse_args()
    settings = [("none", "")]
    for k in ns.every:
        settings += [(f"snapshot_every {k}", f"snapshot_every: {k}"), (f"checkpoint_every {k}", f"checkpoint_every: {k}")]
    samples: dict[str, list[float]] = {name: [] for name, _ in settings}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="rankctl-snapcost-") as tmp:
        root = Path(tmp)
        cluster = ProcCluster(root, ["node-0", "node-1"], 1)
        try:
            for rnd in range(ns.rounds):
                for i, (name, save) in enumerate(settings):
                    job_name = f"cost-{rnd}-{i}"
                    path = root / f"{job_name}.yaml"
                    path.write_text(JOB.format(name=job_name, layers=ns.layers, hidden=ns.hidden, steps=ns.steps,
                                               save=save or "checkpoint_every: 0"))
                    job = cluster.submit(str(path))
                    done = cluster.wait_state(job, {"SUCCEEDED", "FAILED", "CANCELLED"}, 900)
                    if done["state"] != "SUCCEEDED":
                        print(f"{name}: {done['state']}: {done['reason']}", file=sys.stderr)
                        return 1
                    samples[name] += intervals(root, job)
                    if name.startswith("checkpoint") and not sizes:
                        sizes[name] = state_bytes(root / "node-0" / "checkpoints" / job_name)
                    print(f"round {rnd + 1}: {name}: {statistics.median(intervals(root, job)) * 1e3:.1f} ms/step",
                          flush=True)
        finally:
            cluster.stop()
    base = statistics.median(samples["none"])
    print(f"\nmodel: {ns.layers} layers x hidden {ns.hidden}, dp2 over 2 nodes, {ns.steps} steps, {ns.rounds} rounds; "
          f"steps after {WARMUP}, every rank's intervals")
    size = next(iter(sizes.values()), 0)
    if size:
        print(f"state per rank (model + AdamW + RNG + history): {size / 2**20:.1f} MiB")
    print(f"{'setting':<22}{'median ms/step':>16}{'mean ms/step':>14}{'overhead/step':>15}{'per save':>12}")
    for name, _ in settings:
        med, mean = statistics.median(samples[name]), statistics.fmean(samples[name])
        k = int(name.split()[-1]) if name != "none" else 0
        over = med - base
        per = f"{over * k * 1e3:+.1f} ms" if k else "-"
        print(f"{name:<22}{med * 1e3:>16.1f}{mean * 1e3:>14.1f}{over * 1e3:>+12.1f} ms{per:>12}"
              f"   ({med / base:.3f}x none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
