"""Hang detection at scale: a rank stopped in a job of 8 to 16,384 ranks; how soon is it named and acted on?

For each size in ``--ranks`` (``--slots`` ranks a node, one node for the smallest), one real ``ctl coordinator``
with its defaults serves the job's simulated daemons (``bench/scale_sim.py``, as ``bench/scale.py`` does). The job
(``comm-check`` run for ever, ``restart.max_restarts: 1``, no ``hang_timeout``: 300 s) steps at ``--step-rate``;
once its slowest rank stored step ``--hang-step``, every generator is told ``hang VICTIM WORLD`` at t0 (unix
time; everything runs on this one machine): each simulated daemon stops stepping and sends, in one batch, what a
real daemon sends once its ranks' counters stood still (``worker.runs.hangwatch``): one report a rank with its
evidence (waiting in the job's all-reduce), the victim's process "stopped"; the victim's daemon at t0 (the moment
a real one confirms the stop), the others 0.2 s later (when theirs see their ranks still for their 0.5 s stall
time). Measured on the coordinator's clock:

  t0 -> the attempt failed (its RESTARTING event), and whether the reason names ``rank VICTIM stopped``.

What the daemons add before t0 (their 0.1 s look, the 0.3 s in which a stopped rank's CPU time must stay still)
is the same at every size; the coordinator's rule holds a stop ``coordinator.diagnosis.pace.STOP_HOLD_S`` (0.6 s)
on its own clock and waits up to ``EVIDENCE_GRACE_S`` more for every rank's evidence. The figure is flat when the
coordinator's intake and judgement of 16,384 ranks' evidence fit in that hold.

    python bench/scale_hang.py [--ranks 8,64,512,4096,16384] [--slots 8] [--step-rate 0.5] [--hang-step 3]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import CLIENT_OPTIONS, JOB, Generator, event_s, start_coordinator  # noqa: E402

from rankctl.proto import rankctl_pb2 as pb  # noqa: E402
from rankctl.proto import rankctl_pb2_grpc  # noqa: E402
from rankctl.proto import short_name  # noqa: E402

STEPS = 1_000_000


async def one_size(ns: argparse.Namespace, ranks: int, root: Path) -> dict:
    slots = min(ns.slots, ranks)
    nodes = math.ceil(ranks / slots)
    ns.heartbeat_timeout, ns.relay_width = None, None
    coord, address, _ = start_coordinator(ns, sys.executable, None, root)
    procs = min(4, math.ceil(nodes / 1024))
    per = math.ceil(nodes / procs)
    common = ["--address", address, "--total", str(nodes), "--slots", str(slots), "--steps", str(STEPS),
              "--step-rate", str(ns.step_rate)]
    gens = [Generator(common + ["--first", str(first), "--count", str(min(per, nodes - first))], root / f"gen{i}.log")
            for i, first in enumerate(range(0, nodes, per))]
    channel = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
    client = rankctl_pb2_grpc.ClientServiceStub(channel)
    out: dict = {"ranks": ranks, "nodes": nodes}
    try:
        deadline = time.monotonic() + 60 + 0.02 * nodes
        while time.monotonic() < deadline:
            listed = (await client.ListNodes(pb.ListNodesRequest(), timeout=60)).nodes
            if sum(1 for x in listed if x.state == pb.NODE_STATE_READY) >= nodes:
                break
            await asyncio.sleep(0.5)
        spec = JOB.format(nodes=nodes, slots=slots) + "restart: {max_restarts: 1}\n"
        job_id = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec, source="scale-hang.yaml"),
                                         timeout=600)).job.id
        deadline = time.monotonic() + 120 + 10 * ns.hang_step / ns.step_rate
        while time.monotonic() < deadline:
            job = await client.GetJob(pb.GetJobRequest(job_id=job_id, summary_only=True), timeout=60)
            if job.summary.min_step >= ns.hang_step and short_name(pb.JobState, job.state) == "RUNNING":
                break
            await asyncio.sleep(0.2)
        else:
            out["error"] = "the job never reached its steady steps"
            return out
        victim = ranks // 2 + 1 if ranks > 1 else 0
        t0 = time.time()
        for g in gens:
            g.p.stdin.write(f"hang {victim} {ranks}\n")
            g.p.stdin.flush()
        out["acted_s"] = await restarting_at(client, job_id, t0) - t0
        job = await client.GetJob(pb.GetJobRequest(job_id=job_id, summary_only=True), timeout=60)
        reason = job.attempts[0].reason if job.attempts else job.reason
        out["named"] = f"rank {victim} stopped" in reason
        out["reason"] = reason[:240]
        await client.CancelJob(pb.CancelJobRequest(job_id=job_id, reason="bench done"), timeout=60)
    finally:
        await channel.close()
        for g in gens:
            g.stop()
        coord.terminate()
        coord.wait(timeout=30)
    return out


async def restarting_at(client: rankctl_pb2_grpc.ClientServiceStub, job_id: str, t0: float,
                        timeout: float = 60.0) -> float:
    """The coordinator's time of the job's first RESTARTING event after ``t0`` (nan: none within ``timeout``)."""
    async def read() -> float:
        async for batch in client.WatchJobBatches(pb.WatchJobRequest(job_id=job_id)):
            for ev in batch.events:
                if event_s(ev) >= t0 and ev.kind == "transition" and short_name(pb.JobState, ev.state) == "RESTARTING":
                    return event_s(ev)
        return math.nan
    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        return math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="8,64,512,4096,16384")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--step-rate", type=float, default=0.5)
    ap.add_argument("--hang-step", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="print each attempt's reason (its start)")
    ns = ap.parse_args()
    print(f"{'ranks':>7} {'nodes':>6} {'acted on':>9}  named")
    rows = []
    for ranks in (int(x) for x in ns.ranks.split(",")):
        root = Path(tempfile.mkdtemp(prefix=f"rankctl-scale-hang-{ranks}-"))
        try:
            r = asyncio.run(one_size(ns, ranks, root))
        finally:
            if not ns.keep:
                shutil.rmtree(root, ignore_errors=True)
        rows.append(r)
        acted = r.get("acted_s", math.nan)
        print(f"{r['ranks']:>7} {r['nodes']:>6} {acted:>8.2f}s  {'yes' if r.get('named') else 'NO'}"
              f"{'  ' + r['error'] if r.get('error') else ''}", flush=True)
        if ns.verbose:
            print(f"        reason: {r.get('reason', '')}")
    done = [r["acted_s"] for r in rows if not math.isnan(r.get("acted_s", math.nan))]
    if len(done) >= 2:
        print(f"largest / smallest: {done[-1] / done[0]:.2f}x (flat: the coordinator's cost does not grow with the "
              f"job)")


if __name__ == "__main__":
    main()
