"""A leader's writes to the replicated store, off the event loop.

The loop commits each transaction to the store's local copy (an in-memory SQLite) and hands its row changes
here (``submit``, constant time): the replicator's own thread writes them to the journal in order (what is queued
when it comes round goes as one entry: change sets apply in order either way) and applies them to a second
copy, the *stored* one, which is what etcd holds (snapshots are taken of it). An etcd stall thus delays writes,
never the loop: heartbeats, reads and the node streams go on.

What depends on a write waits for it ("persist, then send"): an RPC answers once everything it submitted is
stored (``stored``), a message to a node goes once everything submitted before it is stored (``after``, in
order). Meanwhile the local copy is ahead of etcd by what is pending: a read may show a change not yet stored,
as a read beside a commit in flight would.

A write the store refuses (unreachable past the deadline, fenced out) is no write: the replicator turns
*refusing*: whatever was pending is dropped (its waiters get the ``StoreError``, its messages are never sent),
new transactions are refused at once, naming the store's problem (``refusal``: the loop never waits for a
dead store), and the loop is called back (``on_refused``) to put the local copy back to the stored one and
memory with it. The thread then probes the store every ``RETRY_S``; once it answers, still under this
leader's fence and holding no entry past the stored one (a write whose answer was lost), writes are taken
again. Tickets count submitted transactions; the loop-side ones are read and written on the loop only.
"""

from __future__ import annotations

import asyncio
import heapq
import sqlite3
import threading
from collections import deque
from typing import Callable

import structlog

from rankctl.coordinator.store import mirror
from rankctl.coordinator.store.database import StoreError
from rankctl.coordinator.store.durability import WRITTEN, Durability

log = structlog.get_logger("rankctl.coordinator")
RETRY_S = 0.5            # between probes of a store that refused a write
ENTRY_ROWS = 16384       # queued change sets joined into one journal entry up to about this many row changes (~4 MiB)


class Replicator(Durability):
    """Writes ``journal`` entries behind the loop (``journal``: ``commit(changes, what)``, ``probe()``, ``seq``)."""

    def __init__(self, journal, image: bytes, loop: asyncio.AbstractEventLoop,  # noqa: ANN001 - ha.journal.Journal
                 on_refused: Callable[[StoreError], None]) -> None:
        self.journal, self._loop, self.on_refused = journal, loop, on_refused
        self._stored_copy = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        self._stored_copy.deserialize(image)
        mirror.install(self._stored_copy)
        self._copy_lock = threading.Lock()        # the stored copy and journal.seq, for a snapshot
        self._cv = threading.Condition()
        self._queue: deque[tuple[int, list, str]] = deque()   # (ticket, changes, what), in order
        self._refusing: str | None = None          # why new writes are refused (thread-set, loop-cleared)
        self._closed = False
        # the loop's side
        self.submitted = 0                          # tickets handed out
        self.stored_ticket = 0                      # every ticket up to this one is stored
        self._waiters: list[tuple[int, int, asyncio.Future]] = []   # a heap: (ticket, serial, future)
        self._deferred: deque[tuple[int, Callable[[], None]]] = deque()
        self._lost: deque[tuple[int, int, str]] = deque(maxlen=16)   # (first, last) tickets refused, and why
        self._thread = threading.Thread(target=self._run, name="rankctl-store-writer", daemon=True)
        self._thread.start()

    # -- the loop's side ---------------------------------------------------------------------------
    def submit(self, changes: list, what: str) -> None:
        """One committed transaction's changes (the ``Store``'s replica); ``StoreError`` while refusing."""
        with self._cv:
            if self._refusing is not None or self._closed:
                raise StoreError(f"the coordinator could not store {what}: "
                                 f"{self._refusing or 'it stopped leading'}; nothing was changed")
            self.submitted += 1
            self._queue.append((self.submitted, changes, what))
            self._cv.notify()
        WRITTEN.set(self.submitted)   # this task's newest write (an RPC answers once it is stored)

    def pending(self) -> bool:
        return self.stored_ticket < self.submitted

    def after(self, send: Callable[[], None]) -> None:
        """Run ``send`` once everything submitted so far is stored (now, when nothing is pending); never, if
        that is refused. Calls keep their order."""
        if self.stored_ticket >= self.submitted and not self._deferred:
            send()
        else:
            self._deferred.append((self.submitted, send))

    async def stored(self, ticket: int) -> None:
        """Return once ``ticket`` (and every one before it) is stored; StoreError when it was refused."""
        for first, last, why in self._lost:
            if first <= ticket <= last:
                raise StoreError(why)
        if self.stored_ticket >= ticket:
            return
        future = self._loop.create_future()
        heapq.heappush(self._waiters, (ticket, id(future), future))
        await future

    def _advanced(self, ticket: int) -> None:
        self.stored_ticket = max(self.stored_ticket, ticket)
        while self._deferred and self._deferred[0][0] <= self.stored_ticket:
            self._deferred.popleft()[1]()
        while self._waiters and self._waiters[0][0] <= self.stored_ticket:
            future = heapq.heappop(self._waiters)[2]
            if not future.done():
                future.set_result(None)

    def _drop_pending(self, why: str) -> int:
        """Every ticket not stored is lost: its waiters get a StoreError, its messages are never sent."""
        first, last = self.stored_ticket + 1, self.submitted
        if last >= first:
            self._lost.append((first, last, why))
        self.stored_ticket = self.submitted
        self._deferred.clear()
        while self._waiters:
            future = heapq.heappop(self._waiters)[2]
            if not future.done():
                future.set_exception(StoreError(why))
        return max(0, last - first + 1)

    def _refused(self, exc: StoreError) -> None:
        """On the loop: drop what was pending, then let the owner put its copy and memory back."""
        dropped = self._drop_pending(f"the coordinator could not store the change: {_problem(exc)}; "
                                     "nothing was changed")
        log.warning("store.refused_pending", dropped=dropped, error=str(exc))
        self.on_refused(exc)

    def _reopen(self) -> None:
        """On the loop, after ``_refused`` (the copy is the stored one again): the store answers; writes go on."""
        with self._cv:
            self._refusing = None
        log.info("store.accepting_again", seq=self.journal.seq)

    def stored_image(self) -> tuple[bytes, int]:
        """The stored copy and the journal entry it is current to (a snapshot's), taken between entries."""
        with self._copy_lock:
            return self._stored_copy.serialize(), self.journal.seq

    def close(self) -> None:
        """Stop writing (leadership ended; the thread ends after the write in flight, never joined here): what is
        pending stays unstored, its waiters get a StoreError."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._drop_pending("the coordinator stopped leading before the change was stored")

    # -- the thread's side -------------------------------------------------------------------------
    def _take(self) -> tuple[int, list, str] | None:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            ticket, first, what = self._queue.popleft()
            changes = list(first)   # joined in place: a backlog of thousands is copied once, not once per set
            while self._queue and len(changes) < ENTRY_ROWS:
                ticket, more, _ = self._queue.popleft()
                changes.extend(more)
                what = "changes"
            return ticket, changes, what

    def _run(self) -> None:
        while (item := self._take()) is not None:
            ticket, changes, what = item
            try:
                with self._copy_lock:
                    self.journal.commit(changes, what)
                    self._stored_copy.execute("BEGIN")
                    mirror.apply(self._stored_copy, changes)
                    self._stored_copy.execute("COMMIT")
            except Exception as exc:  # noqa: BLE001 - any failure of the write: nothing of it counts
                error = exc if isinstance(exc, StoreError) else StoreError(
                    f"the coordinator could not store {what}: {exc}; nothing was changed")
                with self._cv:
                    self._refusing = _problem(error)
                    self._queue.clear()
                self._loop.call_soon_threadsafe(self._refused, error)
                if not self._probe():
                    return
                self._loop.call_soon_threadsafe(self._reopen)
                continue
            self._loop.call_soon_threadsafe(self._advanced, ticket)

    def _probe(self) -> bool:
        """Until the store answers under this leader's fence (True), or the replicator is closed (False)."""
        while True:
            with self._cv:
                if self._closed:
                    return False
                self._cv.wait(RETRY_S)
            try:
                self.journal.probe()
                return True
            except Exception as exc:  # noqa: BLE001 - unreachable still (a fenced-out leader has resigned)
                with self._cv:
                    self._refusing = _problem(exc)


async def snapshots(replicator: Replicator, period_s: float = 1.0) -> None:
    """A leader's snapshots: when its log has grown enough, the stored copy (what etcd holds, between two
    entries) is written, all off the loop (``coordinator.ha.journal``)."""
    journal = replicator.journal
    while True:
        await asyncio.sleep(period_s)
        if journal.snapshot_due():
            await asyncio.to_thread(lambda: journal.write_snapshot(*replicator.stored_image()))


def _problem(exc: Exception) -> str:
    """The store's problem from a refusal's text: what follows "could not store X: ", without "nothing was ..."."""
    text = str(exc)
    if text.startswith("the coordinator could not store ") and ": " in text:
        text = text.split(": ", 1)[1]
    return text.removesuffix("; nothing was changed")
