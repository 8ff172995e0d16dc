"""In-memory snapshots (``train.snapshot_every``) without rank processes: where they lie (the node's tmpfs,
never a link or another user's directory), how many steps each root keeps, which step a resume takes from
checkpoints and snapshots together (and only the job's own files on a restart), and how a peer keeps a
node's snapshots in its memory and hands them to a replacement node over the real PeerService."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import torch
from rankctl.contract.files import checkpoints as layout
from rankctl.kinds.train import checkpoint as ckpt
from rankctl.kinds.train.resume import agree_resume_step, holding_root, holdings, intact_root
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.worker.replication.replicas import SNAPSHOTS, PeerServicer, Replicator, ShardStore, restore


@pytest.fixture()
def shm(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A stand-in for /dev/shm."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setattr(layout, "SHM", str(d))
    return d


def save(root: str, step: int, rank: int, fp: str = "fp", job_id: str | None = "j-1") -> None:
    ckpt.save_rank(root, step, rank, {"step": step, "rank": rank, "x": torch.full((4,), float(step))}, fp,
                   {"seed": 1}, job_id)


def test_snapshots_live_in_the_nodes_memory_one_directory_per_state_dir(tmp_path, shm) -> None:
    a, b = str(tmp_path / "node-a"), str(tmp_path / "node-b")
    root_a = layout.snapshot_root(a, "gpt")
    assert root_a.startswith(str(shm) + os.sep) and root_a.endswith(os.path.join("snapshots", "gpt"))
    assert layout.snapshot_root(b, "gpt") != root_a        # two daemons on one machine do not mix
    assert layout.snapshot_replica_root(a, "gpt") == os.path.join(os.path.dirname(os.path.dirname(root_a)),
                                                                  "snapshot-replicas", "gpt")


def test_a_link_planted_where_the_memory_directory_goes_is_never_followed(tmp_path, shm) -> None:
    state = str(tmp_path / "node-a")
    base = layout.memory_base(state)
    os.symlink(str(tmp_path / "elsewhere"), base)
    assert layout.memory_base(state) == os.path.realpath(state)   # the state dir itself, not the link
    assert layout.snapshot_root(state, "gpt") == os.path.join(os.path.realpath(state), "snapshots", "gpt")


def test_without_a_writable_tmpfs_snapshots_go_to_the_state_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "SHM", str(tmp_path / "no-shm"))
    state = str(tmp_path / "node-a")
    assert layout.memory_base(state) == os.path.realpath(state)


def test_prune_keeps_each_ranks_newest_marked_steps_and_a_write_in_progress(tmp_path) -> None:
    root = str(tmp_path)
    for step in (2, 4, 6, 8):
        save(root, step, 0)
    for step in (2, 4):
        save(root, step, 1)
    os.makedirs(layout.step_dir(root, 10), exist_ok=True)
    open(layout.rank_file(root, 10, 0), "wb").close()         # rank 0 writing step 10: no marker yet
    layout.prune(root)
    assert layout.complete_for(root, [0]) == [6, 8] and layout.complete_for(root, [1]) == [2, 4]
    assert os.path.exists(layout.rank_file(root, 10, 0))
    assert not os.path.exists(layout.rank_file(root, 2, 0)) and os.path.exists(layout.rank_file(root, 2, 1))
    assert layout.ranks_in(root) == {0, 1}


def test_a_resume_takes_the_newest_step_of_checkpoints_and_snapshots_together(tmp_path) -> None:
    ckpts, snaps = str(tmp_path / "c"), str(tmp_path / "s")
    save(ckpts, 10, 0)
    save(snaps, 12, 0)
    save(snaps, 14, 0)
    identity = {"seed": 1}
    fp = ckpt.fingerprint(identity)
    for root in (ckpts, snaps):   # the fingerprint is of the identity: rewrite the markers with it
        for step in layout.list_steps(root):
            save(root, step, 0, fp)
    assert agree_resume_step([ckpts, snaps], 0, 1, identity) == 14
    assert holding_root([ckpts, snaps], 14, 0, fp) == snaps
    save(ckpts, 14, 0, fp)        # both hold it: the checkpoint is preferred
    assert holding_root([ckpts, snaps], 14, 0, fp) == ckpts


def test_a_restart_takes_only_its_own_jobs_files(tmp_path) -> None:
    identity = {"seed": 1}
    fp = ckpt.fingerprint(identity)
    ckpts, snaps = str(tmp_path / "c"), str(tmp_path / "s")
    save(ckpts, 4, 0, fp, "j-mine")
    save(snaps, 6, 0, fp, "j-earlier-run")    # same name and identity, another job: never mixed in
    assert agree_resume_step([ckpts, snaps], 0, 1, identity, restart=True, job_id="j-mine") == 4
    assert agree_resume_step([ckpts, snaps], 0, 1, identity, restart=True, job_id="j-other") is None
    assert agree_resume_step([ckpts, snaps], 0, 1, identity) == 6    # train.resume: any run of this identity
    why: list[str] = []
    assert agree_resume_step([ckpts, snaps], 0, 1, identity, restart=True, job_id="j-other", held_by=why) is None
    assert why == ["rank 0 holds no step of this run (and markers of another run or layout at 4, 6)"], why


def test_what_each_group_of_ranks_holds_is_one_bounded_line() -> None:
    # views as agree_resume_step all-gathers them: (held, marked, identity, root, other markers)
    views = [([4, 6], True, None, "", [])] * 2 + [([], False, None, "", [])] * 2 + [([2], True, None, "", [8])]
    assert holdings(views) == ("ranks 0, 1 hold steps 4, 6; ranks 2, 3 hold no step of this run; "
                               "rank 4 holds step 2 (and markers of another run or layout at 8)")
    many = [([s], True, None, "", []) for s in range(10)]
    assert holdings(many).endswith("; 6 more group(s)") and holdings(many).count("holds") == 4


def test_a_damaged_step_is_passed_over_for_the_newest_intact_one(tmp_path) -> None:
    """Every shard's SHA-256 and size are in its marker; a resume checks the step it would take and passes over
    a truncated, overwritten or missing shard (every rank does, naming the step), taking the next older one;
    a snapshot copy of a step whose checkpoint copy is damaged still serves."""
    identity = {"seed": 1}
    fp = ckpt.fingerprint(identity)
    ckpts, snaps = str(tmp_path / "c"), str(tmp_path / "s")
    for step in (5, 10, 15):
        save(ckpts, step, 0, fp)
    marker = layout.read_marker(ckpts, 15, 0)
    assert len(marker["sha256"]) == 64 and marker["bytes"] == os.path.getsize(layout.rank_file(ckpts, 15, 0))
    assert layout.damage(ckpts, 15, 0) == ""
    with open(layout.rank_file(ckpts, 15, 0), "r+b") as f:   # overwritten with garbage, same size
        f.write(b"\x00garbage" * 8)
    with open(layout.rank_file(ckpts, 10, 0), "r+b") as f:   # truncated
        f.truncate(100)
    skipped: list[str] = []
    assert agree_resume_step([ckpts, snaps], 0, 1, identity, skipped=skipped) == 5
    assert skipped[0].startswith("checkpoint step 15 is damaged on rank 0 (") and "SHA-256" in skipped[0]
    assert skipped[1].startswith("checkpoint step 10 is damaged on rank 0 (") and "holds 100 bytes" in skipped[1]
    assert ckpt.load_rank(ckpts, 5, 0)["x"].tolist() == [5.0] * 4
    save(snaps, 15, 0, fp)                                    # the same step intact in the other root
    assert agree_resume_step([ckpts, snaps], 0, 1, identity, skipped=(skipped := [])) == 15 and not skipped
    assert intact_root([ckpts, snaps], 15, 0, fp) == snaps
    os.remove(layout.rank_file(ckpts, 5, 0))
    os.remove(layout.rank_file(snaps, 15, 0))
    with pytest.raises(RuntimeError, match="no intact checkpoint step to resume from: checkpoint step 15"):
        agree_resume_step([ckpts, snaps], 0, 1, identity)
    assert agree_resume_step([ckpts, snaps], 0, 1, identity, restart=True, job_id="j-1") is None  # starts over


def test_steps_of_the_runs_own_layout_are_never_taken_for_another_layouts(tmp_path) -> None:
    """A restart whose own steps no rank set holds intact starts over (``agree_resume_step`` -> None); the
    resume under another layout must not then see those same-layout steps and refuse them as another layout's."""
    from rankctl.kinds.train.reshard import complete_elsewhere

    def ident(world: int, tp: int) -> dict:
        return {"seed": 1, "world_size": world, "parallel": {"tp": tp, "pp": 1}}
    root = str(tmp_path)
    mine, other = ident(2, 2), ident(1, 1)
    ckpt.save_rank(root, 4, 0, {"step": 4}, ckpt.fingerprint(mine), mine, "j-1")   # rank 1's copy is gone
    assert complete_elsewhere(root, mine) == ([], [])
    ckpt.save_rank(root, 6, 0, {"step": 6}, ckpt.fingerprint(other), other, "j-1")  # a 1-rank attempt's step
    assert complete_elsewhere(root, mine) == ([(6, ckpt.fingerprint(other))], [])
    assert complete_elsewhere(root, other) == ([], [4])   # seen from that layout, ours is another's (partial)


def test_snapshots_reach_the_peers_memory_and_a_replacement_node_fetches_them(tmp_path, shm) -> None:
    """Node a pushes its ranks' newest snapshot and checkpoint to peer b (a real PeerService on loopback);
    b keeps the snapshot in its memory root and the checkpoint on disk; node c, replacing a, fetches both."""
    a, b, c = (ShardStore(tmp_path / n) for n in ("a", "b", "c"))
    for step in (2, 4):
        for rank in (2, 3):
            save(a.own_root("gpt", SNAPSHOTS), step, rank)
    for rank in (2, 3):
        save(a.own_root("gpt"), 3, rank)

    async def scenario() -> int | None:
        server = grpc.aio.server()
        pb_grpc.add_PeerServiceServicer_to_server(PeerServicer(b), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            peer = f"127.0.0.1:{port}"
            replicator = Replicator(a)
            await replicator.push(peer, "gpt", [2, 3])
            assert replicator.due(peer, "gpt", [2, 3]) == []   # nothing new: nothing pushed again
            await replicator.channels.close()
            return await restore(c, peer, "gpt", [2, 3])
        finally:
            await server.stop(None)

    assert asyncio.run(scenario()) == 4
    kept = b.replica_root("gpt", SNAPSHOTS)
    assert kept.startswith(str(shm)) and layout.complete_for(kept, [2, 3]) == [4]
    assert layout.complete_for(b.replica_root("gpt"), [2, 3]) == [3]
    assert layout.complete_for(c.own_root("gpt", SNAPSHOTS), [2, 3]) == [4]
    assert layout.complete_for(c.own_root("gpt"), [2, 3]) == [3]
    assert torch.equal(ckpt.load_rank(c.own_root("gpt", SNAPSHOTS), 4, 3)["x"], torch.full((4,), 4.0))


def test_pushes_to_a_peer_share_one_channel_and_one_that_failed_is_dialled_afresh(tmp_path, shm) -> None:
    """Push rounds reuse the channel to their peer; a round that fails (the peer went away) closes it, and the
    next round, the peer back on its port, dials a new one and delivers."""
    a, b = ShardStore(tmp_path / "a"), ShardStore(tmp_path / "b")
    own = a.own_root("gpt", SNAPSHOTS)

    async def serve(address: str) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        pb_grpc.add_PeerServiceServicer_to_server(PeerServicer(b), server)
        port = server.add_insecure_port(address)
        await server.start()
        return server, port

    async def scenario() -> list[int]:
        server, port = await serve("127.0.0.1:0")
        peer, replicator = f"127.0.0.1:{port}", Replicator(a)
        save(own, 2, 0)
        await replicator.push(peer, "gpt", [0])
        first = replicator.channels.get(peer)
        save(own, 4, 0)
        await replicator.push(peer, "gpt", [0])
        assert replicator.channels.get(peer) is first and len(replicator.channels) == 1
        await server.stop(None)
        save(own, 6, 0)
        await replicator.push(peer, "gpt", [0])      # refused by nobody: logged, the channel closed
        assert len(replicator.channels) == 0
        server, _ = await serve(peer)
        try:
            for _ in range(5):   # step 6 again, on a new channel (a loaded machine's first dial may fail: the next
                await replicator.push(peer, "gpt", [0])   # save's round dials again, as here)
                if layout.complete_for(b.replica_root("gpt", SNAPSHOTS), [0])[-1:] == [6]:
                    break
                await asyncio.sleep(0.2)
            assert replicator.channels.get(peer) is not first
        finally:
            await replicator.channels.close()
            await server.stop(None)
        return layout.complete_for(b.replica_root("gpt", SNAPSHOTS), [0])

    assert asyncio.run(scenario())[-1] == 6


def test_a_step_arriving_at_the_peer_drops_that_ranks_newer_steps_of_an_earlier_run(tmp_path, shm) -> None:
    b = ShardStore(tmp_path / "b")
    kept = b.replica_root("gpt", SNAPSHOTS)
    for step in (8, 10):
        save(kept, step, 0)
    save(kept, 2, 0)     # a new run under the same name reached step 2
    b.prune("gpt", SNAPSHOTS, {0: 2})
    assert layout.complete_for(kept, [0]) == [2]


def test_a_finished_run_frees_its_snapshots_and_the_copies_kept_for_its_peer(tmp_path, shm) -> None:
    a = ShardStore(tmp_path / "a")
    own, kept = a.own_root("gpt", SNAPSHOTS), a.replica_root("gpt", SNAPSHOTS)
    for step in (2, 4):
        for rank in (0, 1):
            save(own, step, rank)
        save(kept, step, 2)
    save(a.own_root("gpt"), 4, 0)                       # a checkpoint: never touched
    save(a.own_root("other", SNAPSHOTS), 4, 0)          # another job's snapshots: never touched
    assert a.drop_snapshots("gpt", [0, 1]) == 12        # (.pt + .done) x 2 steps x 3 rank-copies
    assert not os.path.exists(own) and not os.path.exists(kept)
    assert layout.complete_for(a.own_root("gpt"), [0]) == [4]
    assert layout.complete_for(a.own_root("other", SNAPSHOTS), [0]) == [4]


def test_a_push_that_stops_before_its_marker_leaves_nothing_at_the_peer(tmp_path, shm) -> None:
    """CI: a run's last snapshot push was cut off when the sender dropped its snapshots at the run's end; the
    peer kept rank-00000.pt of step 40 without its marker in memory. A stream's unmarked files now go."""
    from rankctl.proto import rankctl_pb2 as pb
    from rankctl.worker.replication.replicas import _Writer

    store = ShardStore(tmp_path / "peer")
    root = store.replica_root("j", SNAPSHOTS)
    cut = _Writer(store.replica_root, store.base)
    cut.feed(pb.ShardChunk(job_name="j", step=40, rank=0, file="pt", root=SNAPSHOTS, data=b"x" * 10, last=True))
    assert os.path.exists(os.path.join(layout.step_dir(root, 40), "rank-00000.pt"))
    cut.abort()   # the stream broke before the marker
    assert not os.path.exists(layout.step_dir(root, 40))
    whole = _Writer(store.replica_root, store.base)
    for file in ("pt", "done"):
        whole.feed(pb.ShardChunk(job_name="j", step=42, rank=0, file=file, root=SNAPSHOTS, data=b"{}", last=True))
    whole.drop_incomplete()   # a complete step stays
    assert layout.read_marker(root, 42, 0) is not None


def test_a_push_after_the_run_ended_here_is_refused_until_the_name_runs_again(tmp_path, shm) -> None:
    """CI: the job's other node pushed its last snapshot step after this node's ranks had exited and dropped
    the job's snapshots; the copy stayed in memory. Dropping leaves a tombstone that refuses such pushes."""
    from rankctl.proto import rankctl_pb2 as pb
    from rankctl.worker.replication.replicas import BadShard, _Writer

    store = ShardStore(tmp_path / "peer")
    store.drop_snapshots("j", [0, 1])
    late = _Writer(store.replica_root, store.base, store.dropped)
    with pytest.raises(BadShard, match="dropped"):
        late.feed(pb.ShardChunk(job_name="j", step=40, rank=2, file="pt", root=SNAPSHOTS, data=b"x", last=True))
    assert not os.path.exists(store.replica_root("j", SNAPSHOTS))
    store.revive("j")   # the name runs here again
    again = _Writer(store.replica_root, store.base, store.dropped)
    for file in ("pt", "done"):
        again.feed(pb.ShardChunk(job_name="j", step=2, rank=2, file=file, root=SNAPSHOTS, data=b"{}", last=True))
    assert layout.read_marker(store.replica_root("j", SNAPSHOTS), 2, 2) is not None


def test_a_restore_takes_the_restarting_jobs_steps_not_an_earlier_jobs_newer_ones(tmp_path, shm) -> None:
    """Peer b holds ranks 2-3 of job j-2 at step 8 and, from an earlier job j-1 of the same name, step 48 (CI: a
    spare restored step 48 of another job, and the restart found no step every rank holds). A restore for j-2 takes
    step 8; one for a job that wrote nothing there (a job resuming j-1's steps) takes the newest of any job."""
    b = ShardStore(tmp_path / "b")
    for rank in (2, 3):
        save(b.own_root("gpt"), 48, rank, job_id="j-1")
        save(b.replica_root("gpt"), 8, rank, job_id="j-2")

    async def scenario(job_id: str, into: ShardStore) -> int | None:
        server = grpc.aio.server()
        pb_grpc.add_PeerServiceServicer_to_server(PeerServicer(b), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await restore(into, f"127.0.0.1:{port}", "gpt", [2, 3], job_id=job_id)
        finally:
            await server.stop(None)

    mine, other = ShardStore(tmp_path / "c"), ShardStore(tmp_path / "d")
    assert asyncio.run(scenario("j-2", mine)) == 8
    assert layout.complete_for(mine.own_root("gpt"), [2, 3]) == [8]
    assert asyncio.run(scenario("j-3", other)) == 48


def test_a_damaged_step_the_peer_passes_over_is_named_to_the_node_that_restores(tmp_path, shm) -> None:
    """Peer b holds ranks 2-3 at steps 8 and 12, rank 3's shard of step 12 overwritten (its marker kept): the
    restore takes step 8 and the step passed over comes back to the fetching node naming the step, the rank and
    the damage (it passed over without a word: an outside probe)."""
    b = ShardStore(tmp_path / "b")
    for step in (8, 12):
        for rank in (2, 3):
            save(b.replica_root("gpt"), step, rank, job_id="j-2")
    with open(layout.rank_file(b.replica_root("gpt"), 12, 3), "r+b") as f:
        f.write(b"\x00garbage" * 8)

    async def scenario(into: ShardStore, passed: list[str]) -> int | None:
        server = grpc.aio.server()
        pb_grpc.add_PeerServiceServicer_to_server(PeerServicer(b), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await restore(into, f"127.0.0.1:{port}", "gpt", [2, 3], job_id="j-2", passed=passed)
        finally:
            await server.stop(None)

    passed: list[str] = []
    assert asyncio.run(scenario(ShardStore(tmp_path / "c"), passed)) == 8
    assert len(passed) == 1 and passed[0].startswith("checkpoint step 12 of rank 3 is damaged (") \
        and "rank-00003.pt does not match the SHA-256" in passed[0] and passed[0].endswith("; passed over"), passed
