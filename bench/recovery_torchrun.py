"""torchrun's side of ``bench/recovery.py``: rankctl's own ``train`` rank, started by a torchrun agent.

    python -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d ... \
        bench/recovery_torchrun.py JOB.yaml SHARED_DIR

The same job file as rankctl's side, read the way ``ctl`` reads it, with ``train.resume=true``
(so that torchrun's restart of the worker group resumes from the newest checkpoint every rank
holds). Checkpoints go to ``SHARED_DIR/checkpoints/{job name}``, shared by every agent on this
machine (a shared file system, as torchrun users have). The rank's coordinates and groups come
from ``parallel.layout`` as a daemon computes them (``worker/runs/assign.py``); the default group is
created here from torchrun's environment (``env://``: the agent's store, ``TORCHELASTIC_USE_AGENT_STORE``)
with the job's ``restart.collective_timeout``, then ``runtime.rank.run_rank`` runs the rank as a
rankctl launcher would (it keeps a default group it finds). Status lines go to
``SHARED_DIR/jobs/torchrun/{agent's restart count}-{pid}/rank-R.status.jsonl``; the bench reads them.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist

from rankctl.contract.assignment import RankAssignment
from rankctl.contract.jobfile import load_yaml_text, read_job_text
from rankctl.kinds.spec import build_spec, check_job
from rankctl.parallel.layout import RankLayout
from rankctl.runtime.rank import run_rank

JOB_ID = "recovery-torchrun"


def main() -> int:
    job_file, shared = sys.argv[1], sys.argv[2]
    spec = build_spec(load_yaml_text(read_job_text(job_file), job_file), ["train.resume=true"])
    layout = RankLayout(check_job(spec))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != layout.world_size:
        raise SystemExit(f"torchrun started {world} ranks; the job's layout has {layout.world_size}")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    seconds = spec.restart.collective_timeout
    dist.init_process_group("gloo", timeout=timedelta(seconds=seconds))
    assignment = RankAssignment(
        job_id=JOB_ID, attempt=restarts + 1, rank=rank, world_size=world, local_rank=int(os.environ["LOCAL_RANK"]),
        node=f"agent-{os.environ.get('GROUP_RANK', '0')}", coords=layout.coords(rank),
        groups=layout.rank_groups(rank), rendezvous=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        backend="gloo", kind=spec.kind, spec=spec,
        run_dir=os.path.join(shared, "jobs", "torchrun", f"{restarts}-{os.getpid()}"),
    )
    return run_rank(assignment, timeout_s=seconds)


if __name__ == "__main__":
    sys.exit(main())
