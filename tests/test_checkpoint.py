"""Checkpoint files, completeness, and the full export (single process, no groups)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from rankctl.models.gpt import GPT, GPTConfig
from rankctl.models.shard import build_shard, shard_slice
from rankctl.parallel.tensor import TPContext
from rankctl.kinds.train import checkpoint as ckpt

CFG = GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=255)  # 255: TP pads the vocabulary


def test_root_is_stable_across_job_ids(tmp_path) -> None:
    run_dir = tmp_path / "state" / "jobs" / "j-123" / "0"
    assert ckpt.checkpoint_root(str(run_dir), "gpt") == str(tmp_path / "state" / "checkpoints" / "gpt")
    other = tmp_path / "state" / "jobs" / "j-456" / "2"
    assert ckpt.checkpoint_root(str(other), "gpt") == ckpt.checkpoint_root(str(run_dir), "gpt")


def test_a_step_counts_only_when_every_rank_marked_it(tmp_path) -> None:
    root = str(tmp_path)
    for step, ranks in ((2, (0, 1)), (4, (0, 1)), (6, (1,))):
        for r in ranks:
            ckpt.save_rank(root, step, r, {"step": step, "x": torch.arange(3) * r}, "fp-a")
    assert ckpt.list_steps(root) == [2, 4, 6]
    assert ckpt.latest_complete(root, 2) == 4 and ckpt.latest_complete(root, 1) == 4
    assert ckpt.complete_for(root, [1]) == [2, 4, 6]
    assert ckpt.latest_complete(root, 2, "fp-a") == 4 and ckpt.latest_complete(root, 2, "fp-b") is None
    assert ckpt.latest_complete(root, 3) is None and ckpt.latest_complete(str(tmp_path / "none"), 1) is None
    assert torch.equal(ckpt.load_rank(root, 4, 1)["x"], torch.tensor([0, 1, 2]))
    assert not [n for n in os.listdir(ckpt.step_dir(root, 2)) if ".tmp" in n]
    assert ckpt.remove_rank_files(root, 1) == 6
    assert ckpt.latest_complete(root, 2) is None and ckpt.complete_for(root, [0]) == [2, 4]


def _rank_state(tp: int, rank: int, sp: bool, dp_rank: int = 0) -> dict:
    shard = build_shard(CFG, seed=3, tp=TPContext(None, rank, tp, sp))  # the real shards of the init
    return {"world_size": 2 * tp, "coords": {"tp": rank, "dp": dp_rank, "cp": 0, "pp": 0},
            "model": {n: p.detach().clone() for n, p in shard.named_parameters()},
            "meta": {n: dataclasses.asdict(m) for n, m in shard.meta.items()}}


@pytest.mark.parametrize("sp", [False, True])
def test_export_gathers_tp_shards_into_the_serial_model(tmp_path, sp: bool) -> None:
    root = str(tmp_path)
    for dp_rank in range(2):
        for r in range(2):
            ckpt.save_rank(root, 8, dp_rank * 2 + r, _rank_state(2, r, sp, dp_rank), "fp")
    full = ckpt.export_full_state_dict(ckpt.step_dir(root, 8))
    serial = _rank_state(1, 0, sp)["model"]
    assert full.keys() == serial.keys() and full["wte.weight"].shape == (255, 32)
    for name, value in serial.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
    GPT(CFG).load_state_dict(full, strict=True)
    for r in range(4):  # and it re-slices into another layout
        tp4 = _rank_state(4, r, sp)
        for name, value in tp4["model"].items():
            assert torch.equal(shard_slice(full[name], tp4["meta"][name]["shard_dim"], r, 4), value), name


def test_export_needs_every_rank_file(tmp_path) -> None:
    root = str(tmp_path)
    ckpt.save_rank(root, 1, 0, _rank_state(2, 0, False), "fp")
    with pytest.raises(ValueError, match="hold 1 rank files, but the checkpoint's world size is 4"):
        ckpt.export_full_state_dict(ckpt.step_dir(root, 1))
    with pytest.raises(FileNotFoundError):
        ckpt.export_full_state_dict(ckpt.step_dir(root, 2))


def test_export_refuses_a_damaged_shard_naming_it(tmp_path) -> None:
    """A shard whose bytes changed after it was written (size and marker kept) gathered into the export without a
    word: 3.5e+28 in wte.weight (an outside probe); a truncated one was an 'internal error' from torch.load."""
    root = str(tmp_path)
    for r in range(4):
        ckpt.save_rank(root, 6, r, _rank_state(2, r % 2, False, r // 2), "fp")
    shard = ckpt.rank_file(root, 6, 1)
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"rank 1's shard is damaged: .*rank-00001.pt does not match the SHA-256"):
        ckpt.export_full_state_dict(ckpt.step_dir(root, 6))
    open(shard, "wb").write(bytes(data[:100]))
    with pytest.raises(ValueError, match=r"rank 1's shard is damaged: .*holds 100 bytes, its marker says"):
        ckpt.export_full_state_dict(ckpt.step_dir(root, 6))
    os.unlink(ckpt.marker_file(root, 6, 1))         # no marker to check it against: torch.load's error, named
    with pytest.raises(ValueError, match=r"rank-00001.pt cannot be loaded: RuntimeError"):
        ckpt.export_full_state_dict(ckpt.step_dir(root, 6))


def test_saves_and_removals_never_pass_through_a_link_below_the_base(tmp_path) -> None:
    """``base`` (a worker root) is trusted; a link at the job's root, a step directory or a file below it is
    refused (saves) or never followed (removals), and nothing outside changes."""
    from rankctl.contract.safepath import UnsafePath

    base, outside = tmp_path / "data", tmp_path / "outside"
    (outside / "step-00000001").mkdir(parents=True)
    (outside / "step-00000001" / "rank-00000.pt").write_bytes(b"theirs")
    (base / "ck").mkdir(parents=True)
    (base / "ck" / "linked").symlink_to(outside)
    with pytest.raises(UnsafePath, match="symbolic link"):
        ckpt.save_rank(str(base / "ck" / "linked"), 2, 0, {"w": torch.ones(1)}, "fp", base=str(base))
    with pytest.raises(UnsafePath, match="symbolic link"):
        ckpt.remove_rank_files(str(base / "ck" / "linked"), 0, base=str(base))
    own = base / "ck" / "own"
    ckpt.save_rank(str(own), 2, 0, {"w": torch.ones(1)}, "fp", base=str(base))
    (own / "step-00000001").symlink_to(outside / "step-00000001")
    with pytest.raises(UnsafePath, match="symbolic link"):
        ckpt.remove_rank_files(str(own), 0, base=str(base))
    assert sorted(p.name for p in outside.rglob("*")) == ["rank-00000.pt", "step-00000001"]
    os.unlink(own / "step-00000001")
    assert ckpt.remove_rank_files(str(own), 0, base=str(base)) == 2   # its own .pt and .done
