"""A coordinator on a replicated store (``--store etcd://...``): standby or leader, and the switch between them.

While it stands by, a coordinator keeps a warm copy of the state: the store's snapshot and log, loaded at
start, then every new log entry applied as the leader writes it (a watch, on its own thread). When it wins
the election (``coordinator.ha.leadership``) it reads the entries it has not applied yet and leads on that copy:
``lead(store)`` assembles the core over it, as a coordinator restart would; daemons reconnect and re-register
with their running ranks. When it loses leadership it stops leading at once (its streams close, so the
daemons go to the new leader), then loads the state afresh and stands by again.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import structlog

from rankctl.coordinator.ha.etcd import Etcd, Unreachable, prefix_end
from rankctl.coordinator.ha.journal import Journal
from rankctl.coordinator.ha.leadership import Leadership, Member, store_problem
from rankctl.coordinator.store.database import Store, replicated

log = structlog.get_logger("rankctl.coordinator")
RETRY_S = 0.5


class HighAvailability:
    """``lead(store)`` / ``follow()`` are the server's; called on the event loop, one at a time."""

    def __init__(self, etcd: Etcd, prefix: str, state_dir: Path, me: Member, ttl: int,
                 lead: Callable[[Store], Awaitable[None]], follow: Callable[[], Awaitable[None]]) -> None:
        self.etcd, self.state_dir, self.prefix = etcd, Path(state_dir), prefix
        self.journal = Journal(etcd, prefix, fence=lambda: self.leadership.fence,
                               on_deposed=lambda why: self.leadership.resign(why))
        self.leadership = Leadership(etcd, prefix, me, ttl, on_change=self._changed, alive=self._loop_alive)
        self._lead, self._follow = lead, follow
        self.copy: Store | None = None       # the warm copy, while standing by
        self.leading = False
        self._revision = 0                   # the etcd revision the copy is current to
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._copy_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._beat = 0.0
        self.task: asyncio.Task | None = None
        self.tasks: list[asyncio.Task] = []     # the server's own, ended with this

    @property
    def store_url(self) -> str:
        return str(self.etcd.url)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._load_copy()
        self.leadership.start()
        self.task = asyncio.create_task(self._reconcile())

    async def stop(self) -> None:
        for task in (self.task, *self.tasks):
            if task is not None:
                task.cancel()
        await self._stop_watch()
        await asyncio.to_thread(self.leadership.stop)
        if self.copy is not None:
            self.copy.close()
            self.copy = None
        self.etcd.close()

    def problem(self) -> str:
        return self.leadership.problem

    # -- switching -------------------------------------------------------------------------------
    def _changed(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _loop_alive(self) -> bool:
        return self._loop is not None and self._loop.time() - self._beat < self.leadership.ttl

    async def _reconcile(self) -> None:
        while True:
            self._beat = self._loop.time()
            try:
                await asyncio.wait_for(self._wake.wait(), 0.5)
            except asyncio.TimeoutError:
                continue
            self._wake.clear()
            try:
                if self.leadership.leading and not self.leading:
                    await self._promote()
                elif not self.leadership.leading and self.leading:
                    await self._demote()
            except Exception:
                log.exception("coordinator.role_change_failed")
                self.leadership.resign("its role change failed")
                await asyncio.sleep(RETRY_S)
                self._wake.set()

    async def _promote(self) -> None:
        await self._stop_watch()
        store = self.copy
        if store is None or not await asyncio.to_thread(self._catch_up, store):
            if store is not None:
                store.close()
            self.copy = None
            store = await self._fresh_store()
        self.copy = None
        self.leading = True
        log.info("coordinator.taking_over", seq=self.journal.seq)
        await self._lead(store)

    async def _demote(self) -> None:
        self.leading = False
        await self._follow()
        await self._load_copy()

    # -- the warm copy ---------------------------------------------------------------------------
    async def _fresh_store(self) -> Store:
        while True:
            try:
                loaded = await asyncio.to_thread(self.journal.load)
                break
            except (Unreachable, grpc.RpcError) as exc:
                log.warning("store.load_failed", error=str(exc))
                self.leadership.problem = store_problem(exc)  # ctl info and the standby's refusals say why
                await asyncio.sleep(RETRY_S)
        self._revision = loaded.revision
        self.journal.seq = loaded.seq
        return replicated(self.state_dir, self.journal, loaded.snapshot, loaded.entries, self.store_url)

    async def _load_copy(self) -> None:
        self.copy = await self._fresh_store()
        self._watch_stop = threading.Event()
        self._watcher = threading.Thread(target=self._follow_log, args=(self.copy, self._watch_stop),
                                         name="rankctl-store-watch", daemon=True)
        self._watcher.start()

    async def _stop_watch(self) -> None:
        """Stop following the log: the watcher applies nothing once its event is set (it checks under the copy's
        lock), so it is waited for off the loop, a little, and never past that."""
        self._watch_stop.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            await asyncio.to_thread(watcher.join, 5)

    def _catch_up(self, store: Store, stop: threading.Event | None = None) -> bool:
        """Apply the entries written after the copy's newest; False when they are gone (a snapshot covers
        them: load afresh). ``stop``: the watcher's; once set, the copy is no longer its to change."""
        key = self.journal.log_key + b"%020d" % (self.journal.seq + 1)
        resp = self.etcd.range(key, prefix_end(self.journal.log_key))
        entries = []
        for kv in resp.kvs:
            seq = self.journal.seq_of(kv.key)
            if seq != self.journal.seq + 1 + len(entries):
                return False
            entries.append((seq, self.journal.changes_of(seq, kv.value)))
        if resp.more:
            return False
        with self._copy_lock:
            if stop is not None and stop.is_set():
                return True
            store.apply_entries(entries)
            if entries:
                self.journal.seq = entries[-1][0]
        return True

    def _follow_log(self, store: Store, stop: threading.Event) -> None:
        """Apply new entries as they are written (the watcher thread), until ``stop``."""
        while not stop.is_set():
            ended = threading.Event()
            try:
                for resp in self.etcd.watch(self.journal.log_key, prefix_end(self.journal.log_key),
                                            self._revision + 1, _either(stop, ended)):
                    if stop.is_set():
                        return
                    if resp.compact_revision or not self._apply_events(store, resp, stop):
                        if not self._catch_up(store, stop):
                            log.warning("store.copy_behind", seq=self.journal.seq)
                            return  # the reconciler loads afresh at promotion
                    self._revision = max(self._revision, resp.header.revision)
            except (grpc.RpcError, Unreachable):
                self.etcd.next_endpoint()
                stop.wait(RETRY_S)
                try:
                    if not self._catch_up(store, stop):
                        return
                except (grpc.RpcError, Unreachable):
                    pass
            finally:
                ended.set()

    def _apply_events(self, store: Store, resp, stop: threading.Event) -> bool:  # noqa: ANN001 - a WatchResponse
        """Apply a watch response's new entries to the copy, unless the watch was stopped (a promotion took the
        copy: a watcher not joined in time must never write to the leader's store)."""
        for ev in resp.events:
            if ev.type != 0:  # DELETE: a snapshot dropped entries it covers
                continue
            seq = self.journal.seq_of(ev.kv.key)
            if seq is None or seq <= self.journal.seq:
                continue
            if seq != self.journal.seq + 1:
                return False
            changes = self.journal.changes_of(seq, ev.kv.value)
            with self._copy_lock:
                if stop.is_set():
                    return True
                store.apply_entries([(seq, changes)])
                self.journal.seq = seq
        return True


def _either(a: threading.Event, b: threading.Event) -> threading.Event:
    """An event set when ``a`` or ``b`` is set."""
    out = threading.Event()

    def wait() -> None:
        while not (a.wait(0.2) or b.is_set()):
            pass
        out.set()
    threading.Thread(target=wait, daemon=True).start()
    return out
