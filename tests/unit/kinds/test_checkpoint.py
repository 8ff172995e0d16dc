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


def reshaped(root: str, step: int, rank: int, name: str) -> None:
    """Rank ``rank``'s shard of ``step`` rewritten with tensor ``name`` one row short, its marker rewritten to
    match (size and SHA-256): damage no checksum can see."""
    import hashlib
    import json

    state = ckpt.load_rank(root, step, rank)
    state["model"][name] = state["model"][name][:-1].clone()
    torch.save(state, ckpt.rank_file(root, step, rank))
    data = open(ckpt.rank_file(root, step, rank), "rb").read()
    marker = ckpt.read_marker(root, step, rank)
    marker.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    open(ckpt.marker_file(root, step, rank), "w").write(json.dumps(marker))


def test_a_shard_rewritten_with_its_marker_but_of_another_shape_is_named_not_loaded(tmp_path) -> None:
    """The SHA-256 matches, a tensor is a row short: the export failed with 'start (0) + length (96) exceeds
    dimension size (95)' naming nothing (an outside probe); now the step's check and the export name the file
    and the tensor, and a resume passes the step over for the one before."""
    from rankctl.contract.files.checkpoints import damage
    from rankctl.kinds.train.intact import file_problem
    from rankctl.kinds.train.resume import agree_resume_step

    root = str(tmp_path)
    for step in (4, 6):
        for r in range(4):
            ckpt.save_rank(root, step, r, _rank_state(2, r % 2, False, r // 2), ckpt.fingerprint({"seed": 1}),
                           {"seed": 1})
    reshaped(root, 6, 1, "wte.weight")
    assert damage(root, 6, 1) == ""
    why = file_problem(root, 6, 1)
    assert why == f"{ckpt.rank_file(root, 6, 1)}: tensor 'wte.weight' has shape (127, 32), its metadata's is (128, 32)"
    assert file_problem(root, 6, 0) == "" and file_problem(root, 4, 1) == ""
    shapes = {n: tuple(t.shape) for n, t in _rank_state(2, 1, False)["model"].items()}
    assert file_problem(root, 6, 1, shapes).endswith("tensor 'wte.weight' has shape (127, 32), this layout's is (128, 32)")
    with pytest.raises(ValueError, match=r"rank-00001.pt: tensor 'wte.weight' has shape \(127, 32\)"):
        ckpt.export_full_state_dict(ckpt.step_dir(root, 6))
    skipped: list[str] = []
    check = lambda rt, s, k: file_problem(rt, s, k, shapes)  # noqa: E731 - what the trainer passes for its rank 1
    assert agree_resume_step([root], 1, 1, {"seed": 1}, skipped=skipped, check=check) == 4
    assert len(skipped) == 1 and skipped[0].startswith("checkpoint step 6 is damaged on rank ") \
        and skipped[0].endswith(f" ({why.replace('its metadata', 'this layout')}); passed over"), skipped


def _export(*args: str, limit: int | None = None) -> tuple[int, str]:
    """``ctl checkpoint export ARGS`` through its click command: (exit code, stderr). ``limit``: the process's
    RLIMIT_FSIZE meanwhile, a file system that fills (a write past it fails with EFBIG)."""
    import resource

    from click.testing import CliRunner
    from rankctl.cli.main import cli

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        res = CliRunner().invoke(cli, ["checkpoint", "export", *args], catch_exceptions=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return res.exit_code, res.stderr


def test_export_writes_atomically_and_never_over_a_device_a_link_or_another_file(tmp_path) -> None:
    """An outside probe: `--out /dev/full` said 'internal error: RuntimeError: [enforce fail ...]'; an existing file
    that was no export, or a link's target, was overwritten without a word. Now: a device is refused, a link or
    another file only replaced with --force (the link itself, never its target), a write that fails names the path
    and the cause and leaves nothing, and an earlier export is replaced."""
    root = str(tmp_path / "ckpt")
    for r in range(4):
        ckpt.save_rank(root, 6, r, _rank_state(2, r % 2, False, r // 2), "fp")
    step = ckpt.step_dir(root, 6)
    code, err = _export(step, "--out", "/dev/full")
    assert code == 2 and "error: --out /dev/full is not a regular file" in err, err
    notes, target = tmp_path / "notes.txt", tmp_path / "target.txt"
    notes.write_text("keep me")
    target.write_text("keep me too")
    (tmp_path / "link.pt").symlink_to(target)
    code, err = _export(step, "--out", str(notes))
    assert code == 2 and f"--out {notes} exists and is not a checkpoint export" in err, err
    code, err = _export(step, "--out", str(tmp_path / "link.pt"))
    assert code == 2 and f"is a symbolic link (to {target})" in err, err
    assert notes.read_text() == "keep me" and target.read_text() == "keep me too"
    code, err = _export(step, "--out", str(tmp_path / "full.pt"), limit=4096)   # the file system fills at 4 KiB
    assert code == 2 and f"cannot write --out {tmp_path / 'full.pt'}: File too large; nothing was written" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "link.pt", "notes.txt", "target.txt"]
    for out in (tmp_path / "full.pt", tmp_path / "full.pt", tmp_path / "link.pt"):   # new, an earlier export, a link
        code, err = _export(step, "--out", str(out), *(["--force"] if out.is_symlink() else []))
        assert code == 0, err
    assert (tmp_path / "link.pt").is_file() and not (tmp_path / "link.pt").is_symlink()
    assert target.read_text() == "keep me too" and torch.load(tmp_path / "full.pt")["wte.weight"].shape == (255, 32)


def test_saves_and_removals_never_pass_through_a_link_below_the_base(tmp_path) -> None:
    """``base`` (a worker root) is trusted; a link at the job's root, a step directory or a file below it is
    refused (saves) or never followed (removals), and nothing outside changes."""
    from rankctl.contract.files.safepath import UnsafePath

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
