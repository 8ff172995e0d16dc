"""The save wake (``worker.replication.savewake``, ``contract.files.rankfiles.notify_saved``): a rank's completed save reaches the
daemon's loop through the run's FIFO at once, and a push asked for while one to the same peer is in flight runs
right after it. No processes."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
import structlog
from rankctl.contract.files.rankfiles import notify_saved, saved_path
from rankctl.worker.replication.replicas import Replicator, ShardStore
from rankctl.worker.runs.runstate import RunState
from rankctl.worker.replication.savewake import SaveWake

LOG = structlog.get_logger("test")


def run_in(tmp_path, peer: str = "127.0.0.1:1") -> RunState:
    d = tmp_path / "run"
    d.mkdir(exist_ok=True)
    return RunState(job_id="j-1", attempt=1, run_dir=str(d), ranks={0}, alive={0}, job_name="gpt", replica_peer=peer)


def test_a_rank_without_a_listening_daemon_is_never_held_up(tmp_path) -> None:
    run = run_in(tmp_path)
    notify_saved(run.run_dir)                 # no FIFO: an older daemon
    os.mkfifo(saved_path(run.run_dir))
    notify_saved(run.run_dir)                 # a FIFO nobody reads (ENXIO): no wait, no error
    assert stat.S_ISFIFO(os.stat(saved_path(run.run_dir)).st_mode)


@pytest.mark.parametrize("peer", ["127.0.0.1:1", ""])
def test_a_save_wakes_the_loop_of_a_run_with_a_replica_peer(tmp_path, peer: str) -> None:
    run = run_in(tmp_path, peer)
    woken: list[RunState] = []

    async def scenario() -> None:
        wake = SaveWake(woken.append, LOG)
        wake.open(run)
        try:
            for _ in range(3):           # three saves before the loop looks: one wake, the FIFO drained
                notify_saved(run.run_dir)
            await asyncio.sleep(0.05)
            notify_saved(run.run_dir)    # and the next one wakes it again
            await asyncio.sleep(0.05)
        finally:
            wake.close(run)
        notify_saved(run.run_dir)        # closed: nobody reads, the rank goes on
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert woken == ([run, run] if peer else []), woken   # a run with no peer has nothing to push


def test_a_push_asked_for_during_another_runs_right_after_it(tmp_path) -> None:
    """A round to a peer is in flight when another save's wake asks for one: it runs right after, not at the next
    poll turn; asked for twice meanwhile, it runs once; another job's round to the same peer runs too."""
    replicator = Replicator(ShardStore(tmp_path / "a"))
    rounds: list[tuple[str, list[int]]] = []
    release = asyncio.Event()

    async def one_round(peer: str, name: str, ranks: list[int]) -> None:
        rounds.append((name, ranks))
        await release.wait()

    replicator._round = one_round  # the bytes' path is test_snapshots'; this is the order of rounds

    async def scenario() -> None:
        first = asyncio.create_task(replicator.push("p:1", "gpt", [0, 1]))
        await asyncio.sleep(0)
        assert rounds == [("gpt", [0, 1])]
        for name in ("gpt", "gpt", "other"):
            await replicator.push("p:1", name, [1, 0])   # busy: queued, returns at once
        assert len(rounds) == 1
        release.set()
        await first
        await replicator.push("p:1", "gpt", [0, 1])      # idle again: a round of its own

    asyncio.run(scenario())
    assert sorted(rounds[1:3]) == [("gpt", [0, 1]), ("other", [0, 1])] and rounds[3] == ("gpt", [0, 1]), rounds
    assert len(rounds) == 4
