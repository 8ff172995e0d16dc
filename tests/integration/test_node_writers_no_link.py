"""Every writer of a node under a worker root refuses a symbolic link planted where it writes (issue 43 item 1):
the peer replicas of checkpoints and snapshots, the daemon's control files, a shipped workdir's extraction and the
rank's own run-dir files. Each test plants a link to a directory outside the root at the place the writer uses,
and checks that nothing outside changes and that the refusal names the path and the rule."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from rankctl.contract.files import checkpoints as layout
from rankctl.contract.files import safepath
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.worker.replication.replicas import SNAPSHOTS, PeerServicer, ShardStore, restore


@pytest.fixture()
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /dev/shm."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setattr(layout, "SHM", str(d))
    return d


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    """A directory outside every root, holding one step of rank 2 that nothing may touch."""
    d = tmp_path / "outside"
    step = Path(layout.step_dir(str(d), 2))
    step.mkdir(parents=True)
    for name in ("rank-00002.pt", "rank-00002.done"):
        (step / name).write_text("keep")
    return d


def snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def plant(link: str, target: Path) -> None:
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(str(target), link)


def step_chunks(name: str, step: int, rank: int, area: str) -> list[pb.ShardChunk]:
    return [pb.ShardChunk(job_name=name, step=step, rank=rank, file=f, root=area, data=b"{}", last=True)
            for f in ("pt", "done")]


async def _serve(store: ShardStore):  # noqa: ANN202 - (server, address)
    server = grpc.aio.server()
    pb_grpc.add_PeerServiceServicer_to_server(PeerServicer(store), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.grpc_in_process
@pytest.mark.parametrize("area", [SNAPSHOTS, ""])
def test_a_push_to_a_linked_replica_root_is_refused_naming_it(tmp_path: Path, shm: Path, outside: Path,
                                                              area: str) -> None:
    """The peer keeps a job's copies under ``{state}/replicas/{job name}`` or its snapshot memory: a link planted
    there is refused (FAILED_PRECONDITION naming the path and the rule), nothing is written through it."""
    peer = ShardStore(tmp_path / "peer")
    link = peer.replica_root("gpt", area)
    plant(link, outside)
    before = snapshot(outside)

    async def scenario() -> grpc.aio.AioRpcError:
        server, address = await _serve(peer)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.PeerServiceStub(channel).PutShards(iter(step_chunks("gpt", 4, 2, area)))
            return info.value
        finally:
            await server.stop(None)

    err = asyncio.run(scenario())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert link in err.details() and safepath.RULE in err.details()
    assert snapshot(outside) == before and os.path.islink(link)


def test_pruning_and_dropping_never_delete_through_a_linked_root(tmp_path: Path, shm: Path, outside: Path) -> None:
    """A finished run's snapshots are dropped and a peer's copies pruned by deleting files under the job name's
    roots: a link there is refused, the files it points at stay."""
    store = ShardStore(tmp_path / "node")
    for area in (SNAPSHOTS, ""):
        plant(store.replica_root("gpt", area), outside)
    plant(store.own_root("gpt", SNAPSHOTS), outside)
    before = snapshot(outside)
    with pytest.raises(safepath.UnsafePath, match="symbolic link"):
        store.prune("gpt", "", {2: 1})          # a step 1 arrived: the newer step 2 would go
    with pytest.raises(safepath.UnsafePath, match="symbolic link"):
        store.drop_snapshots("gpt", [2])
    assert snapshot(outside) == before


@pytest.mark.grpc_in_process
def test_a_restore_into_a_linked_checkpoint_root_writes_nothing_there(tmp_path: Path, shm: Path,
                                                                      outside: Path) -> None:
    """A replacement node fetches a lost node's steps into ``{state}/checkpoints/{job name}``: a link planted
    there is refused before any byte lands, the refusal names it."""
    peer, node = ShardStore(tmp_path / "peer"), ShardStore(tmp_path / "node")
    for c in step_chunks("gpt", 6, 2, ""):   # the peer holds rank 2's step 6
        path = (layout.rank_file if c.file == "pt" else layout.marker_file)(peer.replica_root("gpt"), 6, 2)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Path(path).write_text('{"job_id": "j-1"}')
    link = node.own_root("gpt")
    plant(link, outside)
    before = snapshot(outside)

    async def scenario() -> None:
        server, address = await _serve(peer)
        try:
            await restore(node, address, "gpt", [2])
        finally:
            await server.stop(None)

    with pytest.raises(safepath.UnsafePath) as info:
        asyncio.run(scenario())
    assert link in str(info.value) and safepath.RULE in str(info.value)
    assert snapshot(outside) == before


# -- the run dir's files: the daemon's and the rank's -----------------------------------------------------------
@pytest.fixture()
def victim(tmp_path: Path) -> Path:
    """A file outside the run dir that a planted link or hard link points at."""
    f = tmp_path / "outside-file"
    f.write_text("keep")
    return f


def _planted(run_dir: Path, name: str, victim: Path, how: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    at = run_dir / name
    os.symlink(victim, at) if how == "symlink" else os.link(victim, at)
    return at


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_the_run_dirs_files_replace_what_a_rank_planted_and_never_write_through_it(tmp_path: Path, victim: Path,
                                                                                  how: str) -> None:
    """The daemon's control file (its temporary name), a rank's status file, its collective counters and their
    labels, its log and the save wake: each replaces a link or hard link planted at its name."""
    from rankctl.contract.files import rankfiles
    from rankctl.runtime.collectives import CollectiveCounters
    from rankctl.runtime.status import StatusWriter
    from rankctl.worker.runs.rankio import RankLog

    run_dir = tmp_path / "state" / "jobs" / "j-1" / "0"
    for name in ("rank-0.control.json.tmp", "rank-0.status.jsonl", "rank-0.coll", "rank-0.coll.json.tmp",
                 "rank-0.log", "saved.fifo"):
        _planted(run_dir, name, victim, how)
    rankfiles.write_control(str(run_dir), 0, {"checkpoint_at": 17})
    StatusWriter(str(run_dir), 0).write("running", step=1)
    CollectiveCounters(str(run_dir), 0, 1, {}).slot(None)
    r, w = os.pipe()
    log = RankLog(str(run_dir / "rank-0.log"), r)
    os.write(w, b"printed\n")
    os.close(w)
    log.close()   # copies what the pipe holds
    rankfiles.notify_saved(str(run_dir))
    assert victim.read_text() == "keep"
    assert rankfiles.read_control(rankfiles.control_path(str(run_dir), 0)) == {"checkpoint_at": 17}
    assert '"running"' in (run_dir / "rank-0.status.jsonl").read_text()
    assert (run_dir / "rank-0.log").read_bytes() == b"printed\n"
    assert not any(p.is_symlink() for p in run_dir.iterdir() if p.name != "saved.fifo")
