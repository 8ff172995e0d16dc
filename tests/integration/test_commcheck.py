"""comm-check: exact verification, bandwidth formulas, aggregation, and a corrupted collective."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rankctl.kinds.comm_check.results import comm_check_result
from rankctl.parallel.groups import ProcessGroups
from rankctl.parallel.layout import ParallelConfig, RankLayout
from rankctl.kinds.comm_check import run as commcheck
from ranks import fork_ranks
from rankctl.kinds.comm_check.spec import CommCheckSpec
from rankctl.kinds.spec import SpecError, build_spec
from rankctl.kinds.comm_check.run import (
    CommCheckError, _Group, metrics, verify_allgather,
    verify_allreduce,
)


def group(rank: int = 1) -> _Group:
    return _Group(names=["dp", "dp_cp"], members=[1, 3, 5], pg=None, rank=rank)


def test_verify_accepts_the_right_values() -> None:
    verify_allreduce(torch.full((8,), 2.0 + 4.0 + 6.0), group())
    verify_allgather(torch.tensor([2.0, 2.0, 4.0, 4.0, 6.0, 6.0]), group())


def test_wrong_allreduce_names_kind_group_and_rank() -> None:
    out = torch.full((8,), 12.0)
    out[5] = 11.0
    with pytest.raises(CommCheckError) as err:
        verify_allreduce(out, group(rank=3))
    msg = str(err.value)
    assert "allreduce wrong on dp/dp_cp group [1, 3, 5] (observed on rank 3)" in msg
    assert "element 5 is 11.0, expected 12.0" in msg and "1 of 8 elements wrong" in msg


def test_wrong_allgather_names_the_source_rank() -> None:
    with pytest.raises(CommCheckError, match=r"allgather wrong on dp/dp_cp group \[1, 3, 5\].*chunk from rank 3"):
        verify_allgather(torch.tensor([2.0, 2.0, 4.0, 0.0, 6.0, 6.0]), group())


def test_bus_bandwidth_follows_nccl_tests() -> None:
    m = metrics("allreduce", 1_000_000_000, 4, 1.0)
    assert m["algbw_gbps"] == pytest.approx(1.0) and m["busbw_gbps"] == pytest.approx(1.5)
    assert metrics("allgather", 1_000_000_000, 4, 2.0)["busbw_gbps"] == pytest.approx(0.375)
    assert m["us"] == pytest.approx(1e6)


def test_config_from_spec() -> None:
    job = {"name": "c", "kind": "comm-check"}
    assert build_spec(job).comm_check == CommCheckSpec()
    assert build_spec({**job, "comm_check": {"size_bytes": 64}}).comm_check.size_bytes == 64
    with pytest.raises(SpecError, match="comm_check.iters"):
        build_spec({**job, "comm_check": {"iters": 0}})


def _row(kinds: list[str], members: list[int], us: float) -> dict:
    return {"kinds": kinds, "members": members,
            **{op: metrics(op, 4096, len(members), us / 1e6) for op in commcheck.OPS}}


def test_merge_rounds_keeps_the_slowest_and_the_first_error() -> None:
    fast, slow = _row(["tp"], [0, 1], 10), _row(["tp"], [0, 1], 30)
    bad = _row(["tp"], [0, 1], 5)
    bad["allgather"]["error"] = "allgather wrong on tp group [0, 1]"
    merged = commcheck.merge_rounds(commcheck.merge_rounds([fast], [slow]), [bad])
    assert merged[0]["allreduce"]["us"] == pytest.approx(30) and "error" not in merged[0]["allreduce"]
    assert merged[0]["allgather"]["us"] == pytest.approx(30)
    assert commcheck.errors(merged) == ["allgather wrong on tp group [0, 1]"]


# -- a corrupted collective across real ranks ---------------------------------------------------

def _corrupt_allgather_input(real):
    """An all-gather whose caller contributes 100s instead of its payload."""
    def gather(out, inp, group=None):
        inp.fill_(100.0)
        return real(out, inp, group=group)
    return gather


def _check_rank(rank: int, world: int, store_path: str, corrupt: str | None, result_dir: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    pgs = ProcessGroups.build(rank, world, RankLayout(ParallelConfig(world_size=world, tp=2)).rank_groups(rank))
    if corrupt and rank == 1:
        commcheck._all_gather_single = _corrupt_allgather_input(commcheck._all_gather_single)
    cfg = CommCheckSpec(size_bytes=256, warmup=1, iters=2)
    rows = commcheck.check_groups(pgs, rank, cfg, torch.device("cpu"))
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(rows, f)


def test_clean_run_and_a_corrupted_collective(tmp_path) -> None:
    """Clean: no errors, aggregate has every kind. Then rank 1 puts 100 into its all-gather
    chunk: every group holding rank 1 reports it, tp group [2, 3] stays clean, nobody hangs."""
    clean, bad = tmp_path / "clean", tmp_path / "bad"
    clean.mkdir(), bad.mkdir()
    assert fork_ranks(4, _check_rank, str(clean / "store"), None, str(clean)) == [0] * 4
    rows = {r: json.loads((clean / f"{r}.json").read_text()) for r in range(4)}
    assert not any(commcheck.errors(v) for v in rows.values())
    table = comm_check_result({r: {"groups": v} for r, v in rows.items()})["comm"]
    assert {(t["kind"], t["groups"], t["size"]) for t in table} >= {("tp", 2, 2), ("dp", 2, 2), ("world", 1, 4)}

    assert fork_ranks(4, _check_rank, str(bad / "store"), "allgather", str(bad)) == [0] * 4
    errs = {r: commcheck.errors(json.loads((bad / f"{r}.json").read_text())) for r in range(4)}
    assert any(e.startswith("allgather wrong on tp/") and "group [0, 1] (observed on rank 0): "
               "the chunk from rank 1 has element 0 = 100.0, expected 2.0" in e for e in errs[0]), errs[0]
    assert any("group [0, 1, 2, 3] (observed on rank 2)" in e for e in errs[2]), errs[2]
    assert not any("group [2, 3]" in e for e in errs[2] + errs[3])
    assert all("allreduce" not in e for v in errs.values() for e in v)
