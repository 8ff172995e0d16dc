"""A replicated store's leader writes behind the event loop (``coordinator.ha.replicator``): a journal write that
does not return blocks no loop call; what depends on a write (a node message, an RPC's answer) waits for it, in
order; a refused write drops what was pending, refuses new writes at once naming the store's problem, gives the
stored copy back, and writes are taken again once the store answers. No etcd: a journal that keeps its entries."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from rankctl.coordinator.ha.replicator import Replicator
from rankctl.coordinator.store import mirror
from rankctl.coordinator.store.database import Store, StoreError, durability, replicated, restore
from test_replicated_store import dump
from test_store import _job


class Journal:
    """Keeps entries; ``gate`` holds each write until set; ``refuse`` fails writes, ``down`` fails probes."""

    def __init__(self) -> None:
        self.entries: list[list] = []
        self.seq = 0
        self.gate = threading.Event()
        self.gate.set()
        self.refuse = ""
        self.down = False
        self.probes = 0

    def commit(self, changes: list, what: str) -> None:
        self.gate.wait()
        if self.refuse:
            raise StoreError(f"the coordinator could not store {what}: {self.refuse}; nothing was changed")
        self.entries.append(mirror.decode(mirror.encode({"changes": changes}))["changes"])
        self.seq += 1

    submit = commit

    def probe(self) -> None:
        self.probes += 1
        if self.down:
            raise ConnectionError("the store etcd://127.0.0.1:1/rankctl committed nothing in time")


async def _until(check, what: str) -> None:  # noqa: ANN001
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def _leader(tmp_path: Path, journal: Journal, refused: list) -> Store:
    store = replicated(tmp_path, journal, None, [], "leader")
    store.replica = Replicator(journal, store.serialize(), asyncio.get_running_loop(),
                               on_refused=lambda exc: (refused.append(str(exc)),
                                                       restore(store, store.replica.stored_image()[0])))
    return store


def test_a_write_etcd_holds_blocks_no_loop_call_and_what_depends_on_it_waits_in_order(tmp_path: Path) -> None:
    async def main() -> None:
        journal, refused = Journal(), []
        store = _leader(tmp_path, journal, refused)
        stored, sent = durability(store), []
        stored.after(lambda: sent.append("at once"))           # nothing pending: at once
        journal.gate.clear()                                     # etcd stalls
        store.insert_job(_job())                                 # returns: committed to the copy, not stored
        stored.after(lambda: sent.append("assign"))
        store.insert_job(_job("b-000002", name="b"))
        stored.after(lambda: sent.append("ack"))
        answer = asyncio.ensure_future(stored.stored(stored.submitted))
        await asyncio.sleep(0.05)
        assert stored.pending() and sent == ["at once"] and not answer.done()
        assert [j.id for j in store.load_jobs()] == ["a-000001", "b-000002"]   # a read sees the copy
        journal.gate.set()
        await answer
        assert sent == ["at once", "assign", "ack"] and not stored.pending() and not refused
        assert sum(len(e) for e in journal.entries) == 2           # one row each, in one entry or two
        image, seq = store.replica.stored_image()
        copy = replicated(tmp_path / "copy", Journal(), image, [], "copy")
        assert seq == journal.seq and dump(copy) == dump(store)     # the stored copy is the leader's
        copy.close()
        store.replica.close()
        store.close()
    asyncio.run(main())


def test_a_refused_write_drops_what_was_pending_refuses_at_once_and_accepts_again_once_the_store_answers(
        tmp_path: Path) -> None:
    async def main() -> None:
        journal, refused = Journal(), []
        store = _leader(tmp_path, journal, refused)
        stored, sent = durability(store), []
        store.insert_job(_job())
        await stored.stored(stored.submitted)
        before = dump(store)
        journal.gate.clear()
        journal.refuse, journal.down = "the store etcd://127.0.0.1:1/rankctl committed nothing in time", True
        store.insert_job(_job("b-000002", name="b"))             # pending, then refused
        lost = stored.submitted
        stored.after(lambda: sent.append("assign of b"))
        answer = asyncio.ensure_future(stored.stored(lost))
        journal.gate.set()
        with pytest.raises(StoreError, match="committed nothing in time"):
            await answer
        await _until(lambda: refused, "the owner called back")
        assert sent == [] and dump(store) == before               # never sent; the copy is the stored one again
        with pytest.raises(StoreError, match="could not store .*committed nothing in time"):
            store.insert_job(_job("c-000003", name="c"))          # refused at once, nothing kept
        assert dump(store) == before
        with pytest.raises(StoreError):
            await stored.stored(lost)                              # an answer for the lost write: never "stored"
        journal.refuse, journal.down = "", False
        await _until(lambda: not _refusing(store), "writes taken again")
        store.insert_job(_job("d-000004", name="d"))
        await stored.stored(stored.submitted)
        assert [j.id for j in store.load_jobs()] == ["a-000001", "d-000004"] and journal.probes >= 1
        assert [r["id"] for e in journal.entries for t, _, r in e if t == "jobs"] == ["a-000001", "d-000004"]
        store.replica.close()
        store.close()
    asyncio.run(main())


def _refusing(store: Store) -> bool:
    try:
        with store.transaction("a probe"):
            store.set_drain("probe", "x", 1.0)
    except StoreError:
        return True
    store.clear_drain("probe")
    return False


def test_a_closed_replicator_fails_its_waiters_and_sends_nothing_pending(tmp_path: Path) -> None:
    async def main() -> None:
        journal, refused = Journal(), []
        store = _leader(tmp_path, journal, refused)
        stored, sent = durability(store), []
        journal.gate.clear()
        store.insert_job(_job())
        stored.after(lambda: sent.append("assign"))
        answer = asyncio.ensure_future(stored.stored(stored.submitted))
        await asyncio.sleep(0)
        store.replica.close()                                     # leadership ended
        with pytest.raises(StoreError, match="stopped leading"):
            await answer
        journal.gate.set()
        await asyncio.sleep(0.05)
        assert sent == [] and not refused
        store.close()
    asyncio.run(main())


def test_a_task_waits_for_its_own_writes_only(tmp_path: Path) -> None:
    """An RPC answers once its own writes are stored (``durability.WRITTEN``, per asyncio task): a read that
    awaited while another task wrote neither waits for that write nor hears of its refusal."""
    from rankctl.coordinator.store.durability import WRITTEN

    async def main() -> None:
        journal, refused = Journal(), []
        store = _leader(tmp_path, journal, refused)

        async def writer() -> int:
            store.insert_job(_job())
            return WRITTEN.get()

        async def reader() -> int:
            await asyncio.sleep(0.01)
            return WRITTEN.get()

        journal.gate.clear()
        wrote, read = await asyncio.gather(writer(), reader())
        assert wrote == store.replica.submitted and read == 0
        journal.gate.set()
        await store.replica.stored(wrote)
        store.replica.close()
        store.close()
    asyncio.run(main())
