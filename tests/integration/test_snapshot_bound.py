"""rankctl's snapshot memory under its own bound (``ctl worker --snapshot-memory-mb``, ``worker.files.snapmem``):
the option reaches the daemon's config, a rank whose snapshot does not fit makes room once and otherwise
gives up naming the bound, a peer without room answers RESOURCE_EXHAUSTED and keeps nothing partial, and,
where this process may mount, a real tmpfs of a few MiB keeps the bound."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import structlog
import torch
from click.testing import CliRunner
from rankctl.contract.files import checkpoints as layout
from rankctl.kinds.train import checkpoint as ckpt
from rankctl.kinds.train.train_state import Snapshots
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.worker.replication import replicas
from rankctl.worker.files import shm as node_shm
from rankctl.worker.files import snapmem
from rankctl.worker.replication.replicas import SNAPSHOTS, NoRoom, PeerServicer, Replicator, ShardStore, _Writer
from test_snapshots import save, shm  # noqa: F401 - shm: a fixture (a stand-in for /dev/shm)

MiB = 1 << 20


def state_of(mib: float) -> dict:
    return {"step": 0, "x": torch.zeros(int(mib * MiB) // 4)}


def chunks(name: str, step: int, rank: int, size: int, kind: str = SNAPSHOTS) -> list[pb.ShardChunk]:
    """A pushed step: a .pt of ``size`` bytes in 1 MiB chunks, then its marker."""
    parts = [b"x" * min(MiB, size - at) for at in range(0, size, MiB)]
    out = [pb.ShardChunk(job_name=name, step=step, rank=rank, file="pt", root=kind, data=d, last=i == len(parts) - 1)
           for i, d in enumerate(parts)]
    return out + [pb.ShardChunk(job_name=name, step=step, rank=rank, file="done", root=kind, data=b"{}", last=True)]


def files_under(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(top, n), root) for top, _, names in os.walk(root) for n in names)


# -- the option --------------------------------------------------------------------------------
def worker_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *extra: str):  # noqa: ANN201
    from rankctl.cli.main import cli
    from rankctl.worker.daemon import serve

    seen = []

    async def fake_run_worker(cfg) -> None:  # noqa: ANN001
        seen.append(cfg)

    monkeypatch.setattr(serve, "run_worker", fake_run_worker)
    res = CliRunner().invoke(cli, ["worker", "--coordinator", "127.0.0.1:9", "--name", "n1",
                                   "--state-dir", str(tmp_path / "w"), *extra])
    return res, seen


def test_the_worker_option_reaches_the_daemon_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    res, seen = worker_config(monkeypatch, tmp_path, "--snapshot-memory-mb", "64")
    assert res.exit_code == 0, res.output
    assert seen[0].snapshot_memory_mb == 64
    res, seen = worker_config(monkeypatch, tmp_path)
    assert seen[0].snapshot_memory_mb is None       # the default: resolved by worker.snapmem
    res, _ = worker_config(monkeypatch, tmp_path, "--snapshot-memory-mb", "-1")
    assert res.exit_code == 2 and "--snapshot-memory-mb" in res.output


def test_the_default_bound_is_a_quarter_of_the_nodes_memory(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree:         1000 kB\n")
    assert snapmem.default_mb(str(meminfo)) == 16384000 // 1024 // 4
    assert snapmem.default_mb(str(tmp_path / "missing")) == 0


def test_no_bound_and_files_from_before_are_never_mounted_over(tmp_path: Path, shm) -> None:  # noqa: F811
    state = str(tmp_path / "node")
    assert snapmem.apply(state, 0).how == snapmem.NONE
    save(layout.snapshot_root(state, "gpt"), 2, 0)     # snapshots written before the bound came
    bound = snapmem.apply(state, 4)
    assert bound.how == snapmem.ACCOUNTED and "files from before" in bound.why and bound.limit == 4 * MiB
    assert layout.complete_for(layout.snapshot_root(state, "gpt"), [0]) == [2]   # still visible
    assert bound.in_use() == sum(os.path.getsize(os.path.join(layout.memory_base(state), f))
                                 for f in files_under(layout.memory_base(state)))


# -- a rank's own snapshot ---------------------------------------------------------------------
def room_for(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """The snapshot memory holds ``steps`` steps of a rank: a write past it leaves a partial file and fails."""
    real = ckpt.save_rank

    def bounded(root, step, rank, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if len(layout.complete_for(root, [rank])) >= steps:
            os.makedirs(layout.step_dir(root, step), exist_ok=True)
            with open(layout.rank_file(root, step, rank) + ".tmp-1", "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(root, step, rank, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_rank", bounded)


@pytest.fixture()
def two_steps(tmp_path: Path) -> str:
    """A rank's snapshot root holding its steps 2 and 4."""
    root = str(tmp_path / "snapshots" / "gpt")
    for step in (2, 4):
        save(root, step, 0)
    return root


def test_a_snapshot_that_does_not_fit_is_written_after_keeping_only_the_newest_step(
        two_steps: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = two_steps
    room_for(monkeypatch, 2)
    ckpt.save_snapshot(root, 6, 0, {"step": 6}, "fp")
    assert layout.complete_for(root, [0]) == [4, 6]
    assert files_under(root) == [f"step-0000000{s}/rank-00000.{e}" for s in (4, 6) for e in ("done", "pt")]


def test_a_snapshot_that_never_fits_names_the_bound_and_leaves_nothing_partial(
        two_steps: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = two_steps
    room_for(monkeypatch, 0)
    with pytest.raises(OSError, match="--snapshot-memory-mb") as info:
        ckpt.save_snapshot(root, 6, 0, {"step": 6}, "fp")
    assert info.value.errno == errno.ENOSPC
    assert layout.complete_for(root, [0]) == [4]      # its newest complete step stays for a restart
    assert files_under(root) == ["step-00000004/rank-00000.done", "step-00000004/rank-00000.pt"]


def test_a_failed_snapshot_is_logged_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           shm) -> None:  # noqa: F811
    assignment = SimpleNamespace(rank=0, job_id="j-1", run_dir=str(tmp_path / "node" / "jobs" / "j-1" / "1"))
    t = SimpleNamespace(ctx=SimpleNamespace(assignment=assignment, spec=SimpleNamespace(name="gpt"),
                                            log=structlog.get_logger("test")))
    snaps = Snapshots(t, 0)
    room_for(monkeypatch, 0)
    snaps._write(5, {"step": 5})
    with structlog.testing.capture_logs() as logs:
        snaps.wait(t)
    assert [e["event"] for e in logs] == ["snapshot not written"]
    assert "--snapshot-memory-mb" in logs[0]["error"] and logs[0]["step"] == 5


# -- a peer's copies ---------------------------------------------------------------------------
def accounted(state: str, mib: int) -> snapmem.Bound:
    return snapmem.Bound(limit=mib * MiB, how=snapmem.ACCOUNTED, base=layout.memory_base(state))


def test_an_accounted_bound_refuses_a_pushed_step_that_would_pass_it(tmp_path: Path, shm) -> None:  # noqa: F811
    store = ShardStore(tmp_path / "peer")
    bound = accounted(store.state_dir, 4)
    ckpt.save_rank(store.own_root("gpt", SNAPSHOTS), 2, 0, state_of(1.5), "fp")   # the node's own rank
    writer = _Writer(store.replica_root, store.base, store.dropped, bound)
    for c in chunks("gpt", 2, 1, 2 * MiB):          # 1.5 + 2 MiB: fits
        writer.feed(c)
    late = _Writer(store.replica_root, store.base, store.dropped, bound)
    with pytest.raises(NoRoom, match=r"--snapshot-memory-mb 4\)") as info:
        for c in chunks("gpt", 4, 1, 2 * MiB):
            late.feed(c)
    assert f"{bound.in_use()} bytes in use" in str(info.value)
    late.abort()
    assert layout.complete_for(store.replica_root("gpt", SNAPSHOTS), [1]) == [2]
    assert files_under(store.replica_root("gpt", SNAPSHOTS)) == ["step-00000002/rank-00001.done",
                                                                 "step-00000002/rank-00001.pt"]


@contextlib.asynccontextmanager
async def serve_peer(servicer: PeerServicer):  # noqa: ANN201 - the peer's address, while it serves
    server = grpc.aio.server()
    pb_grpc.add_PeerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.mark.grpc_in_process
def test_a_refused_snapshot_push_is_resource_exhausted_and_checkpoints_still_replicate(
        tmp_path: Path, shm) -> None:  # noqa: F811
    a, b = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    ckpt.save_rank(a.own_root("gpt", SNAPSHOTS), 4, 0, state_of(3), "fp")
    save(a.own_root("gpt"), 4, 0)

    async def scenario() -> tuple[grpc.StatusCode, str, list]:
        async with serve_peer(PeerServicer(b, bound=accounted(b.state_dir, 2))) as peer:
            async with grpc.aio.insecure_channel(peer) as channel:
                stub = pb_grpc.PeerServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.PutShards(iter(chunks("gpt", 4, 0, 3 * MiB)))
            replicator = Replicator(a)
            await replicator.push(peer, "gpt", [0])   # refused: the snapshot is not pushed again
            due = replicator.due(peer, "gpt", [0])
            await replicator.push(peer, "gpt", [0])   # the checkpoint alone
            await replicator.channels.close()
            return info.value.code(), info.value.details(), due

    code, details, due = asyncio.run(scenario())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--snapshot-memory-mb 2" in details
    assert due == [("", 0, 4)]
    assert files_under(b.replica_root("gpt", SNAPSHOTS)) == []
    assert layout.complete_for(b.replica_root("gpt"), [0]) == [4]


class FullFile:
    """A file on a full filesystem: the first write lands half, then ENOSPC."""

    def __init__(self, path: str, mode: str) -> None:
        self.f = open(path, mode)  # noqa: SIM115 - closed by close()

    def write(self, data: bytes) -> int:
        self.f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        self.f.close()


@pytest.mark.grpc_in_process
def test_no_space_at_the_peer_is_resource_exhausted_never_internal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   shm) -> None:  # noqa: F811
    b = ShardStore(tmp_path / "b")
    monkeypatch.setattr(replicas, "open", FullFile, raising=False)

    async def scenario() -> grpc.aio.AioRpcError:
        async with serve_peer(PeerServicer(b, bound=snapmem.apply(b.state_dir, 0))) as peer:
            async with grpc.aio.insecure_channel(peer) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.PeerServiceStub(channel).PutShards(iter(chunks("gpt", 4, 0, 2 * MiB)))
        return info.value

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--snapshot-memory-mb" in err.details()
    assert files_under(b.replica_root("gpt", SNAPSHOTS)) == []
    assert not os.path.exists(layout.step_dir(b.replica_root("gpt", SNAPSHOTS), 4))


# -- a real tmpfs --------------------------------------------------------------------------------
@pytest.fixture()
def mounting(tmp_path: Path) -> None:
    if not node_shm.can_mount(str(tmp_path / "probe")):
        reason = "this process may not mount a tmpfs (needs root or CAP_SYS_ADMIN)"
        print(f"skipped: {reason}")
        pytest.skip(reason)


def test_a_tmpfs_of_a_few_mib_keeps_the_bound_and_outlives_a_restart_only_with_snapshots(
        tmp_path: Path, shm, mounting) -> None:  # noqa: F811
    state = str(tmp_path / "node")
    bound = snapmem.apply(state, 4)
    try:
        assert bound.how == snapmem.MOUNTED and os.path.ismount(bound.base)
        assert layout.memory_base(state) == bound.base          # still this user's: the ranks write there
        root = layout.snapshot_root(state, "gpt")
        for step in (2, 4, 6):                                  # 3 x 1.5 MiB: the third makes room first
            ckpt.save_snapshot(root, step, 0, state_of(1.5), "fp")
        assert layout.complete_for(root, [0]) == [4, 6]
        with pytest.raises(OSError, match="4 MiB, bounded by ctl worker --snapshot-memory-mb"):
            ckpt.save_snapshot(root, 8, 0, state_of(5), "fp")   # never fits (torch.save's own error hid ENOSPC)
        assert files_under(root) == ["step-00000006/rank-00000.done", "step-00000006/rank-00000.pt"]
        store = ShardStore(state)
        push = _Writer(store.replica_root, store.base, store.dropped, bound)
        with pytest.raises(NoRoom, match="would pass the bound of 4194304 bytes"):
            for c in chunks("gpt", 6, 1, 3 * MiB):              # the kernel refuses a peer's copy alike
                push.feed(c)
        push.abort()
        assert files_under(store.replica_root("gpt", SNAPSHOTS)) == []
        again = snapmem.apply(state, 8)                        # a restarted daemon: resized, snapshots kept
        assert again.how == snapmem.RESIZED and layout.complete_for(root, [0]) == [6]
        assert not snapmem.release(again) and os.path.ismount(bound.base)
        ckpt.remove_rank_files(root, 0)
        assert snapmem.release(again) and not os.path.exists(bound.base)
    finally:
        if os.path.ismount(bound.base):  # a failed assertion above: never leave the test's mount behind
            node_shm.libc().umount2(bound.base.encode(), node_shm.MNT_DETACH)
