"""Collective counters (``runtime.collectives``): what a rank entered and completed, per group, and
how long it waited, read back by the daemon's reader (``contract.files.collfiles``). Forked gloo ranks."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ranks import fork_ranks
from rankctl.contract.files.collfiles import read_counters
from rankctl.runtime.collectives import CollectiveCounters, install
from rankctl.runtime.status import StatusWriter


def _world(rank: int, world: int, store_path: str) -> None:
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _counted_ops(rank: int, world: int, store_path: str, run_dir: str) -> None:
    _world(rank, world, store_path)
    groups = {"tp": [0, 1] if rank < 2 else [2, 3], "pp": [rank % 2, rank % 2 + 2]}
    counters = CollectiveCounters(run_dir, rank, world, groups)
    undo = install(counters)
    status = StatusWriter(run_dir, rank, counters=counters)
    try:
        tp = dist.new_group([0, 1]), dist.new_group([2, 3])
        pp = dist.new_group([0, 2]), dist.new_group([1, 3])
        my_tp, my_pp = tp[rank // 2], pp[rank % 2]
        status.write("running")
        x = torch.ones(4)
        for _ in range(3):
            dist.all_reduce(x, group=my_tp)
        handle = dist.all_reduce(x, group=my_tp, async_op=True)
        handle.wait()
        peer = rank + 2 if rank < 2 else rank - 2
        buf = torch.zeros(4)
        ops = [dist.P2POp(dist.isend, x, peer, my_pp), dist.P2POp(dist.irecv, buf, peer, my_pp)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        assert torch.equal(buf, x)
        if rank == 3:
            time.sleep(0.5)  # the others wait for rank 3 in the world barrier
        dist.barrier()
        status.write("running", step=1)
        # ranks 0..2 enter a tp/pp collective rank 3 never enters: they stay in it until torn down
        if rank == 1:
            dist.all_reduce(x, group=my_pp, async_op=True)  # launched, never waited on
    finally:
        undo()
        status.close()
    assert dist.all_reduce is not None and not getattr(dist.all_reduce, "__rankctl_counted__", False)
    dist.destroy_process_group()


def test_counters_per_group_kind_and_wait_time(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    codes = fork_ranks(4, _counted_ops, str(tmp_path / "store"), run_dir)
    assert codes == [0, 0, 0, 0]
    by_rank = {r: read_counters(run_dir, r) for r in range(4)}
    for rank, c in by_rank.items():
        groups = {g["kind"]: g for g in c["groups"]}
        assert groups["tp"]["entered"] == groups["tp"]["completed"] == 4, groups
        assert groups["tp"]["members"] == ([0, 1] if rank < 2 else [2, 3])
        assert groups["pp"]["completed"] == 1 and groups["pp"]["op"] in ("batch_isend_irecv", "all_reduce")
        assert groups["world"]["entered"] == groups["world"]["completed"] == 1
        assert groups["world"]["op"] == "barrier"
        assert c["in"] == -1
    # rank 1 launched an async all_reduce on pp and never waited: entered, not completed, not blocked
    pp1 = {g["kind"]: g for g in by_rank[1]["groups"]}["pp"]
    assert (pp1["entered"], pp1["completed"], pp1["op"]) == (2, 1, "all_reduce")
    # the world barrier waited ~0.5 s for rank 3 on the other ranks, not on rank 3
    world_wait = {r: {g["kind"]: g for g in c["groups"]}["world"]["wait_s"] for r, c in by_rank.items()}
    assert min(world_wait[0], world_wait[1], world_wait[2]) > 0.3 > world_wait[3], world_wait
    records = {r: [json.loads(line) for line in open(os.path.join(run_dir, f"rank-{r}.status.jsonl"))]
               for r in range(4)}
    step = {r: next(x for x in recs if x["step"] == 1) for r, recs in records.items()}
    assert step[0]["wait_s"] > 0.3 and step[3]["wait_s"] < 0.3 <= step[3]["compute_s"], step
