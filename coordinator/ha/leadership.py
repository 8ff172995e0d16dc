"""Leader election among the coordinators of one store prefix: an etcd lease and an election key.

Each coordinator holds a lease (``ttl`` seconds, renewed every ``ttl/3``) and registers itself under
``PREFIX/members/<id>`` with it (``ctl info`` lists them). It campaigns by creating ``PREFIX/leader`` with
its lease, only if the key does not exist (one transaction); the create revision it wins at is its
``Fence``, compared by every write it makes (``coordinator.ha.journal``). The key vanishes with the lease, so a
leader that dies, or stops renewing, is replaced within ``ttl`` seconds; standbys look every ``POLL_S``.

A leader steps down by itself when it has not renewed its lease for ``ttl`` less a margin (it may already
be replaced: a SIGSTOP, a partition from etcd, an etcd outage), when etcd says the lease is gone, or when
a fenced write fails (``resign``). Renewal also needs the event loop to be alive (``alive()``): a wedged
loop lets its lease run out. All of this runs on one thread; ``on_change`` is called from it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import structlog
from aetcd.rpc import rpc_pb2 as rpc

from rankctl.coordinator.ha.etcd import Etcd, Unreachable, prefix_end
from rankctl.coordinator.ha.journal import Fence

log = structlog.get_logger("rankctl.coordinator")
POLL_S = 0.25
MARGIN_S = 0.5


def store_problem(exc: Exception) -> str:
    """What ``ctl info`` and a standby's refusals say when etcd failed a call: one line, never a Python repr."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"etcd answered {exc.code().name}: {exc.details()}"
    return str(exc)


@dataclass(frozen=True)
class Member:
    id: str
    address: str
    version: str
    started_at: float

    def to_json(self) -> bytes:
        return json.dumps({"id": self.id, "address": self.address, "version": self.version,
                           "started_at": self.started_at}).encode()


class Leadership:
    def __init__(self, etcd: Etcd, prefix: str, me: Member, ttl: int, on_change: Callable[[], None],
                 alive: Callable[[], bool] = lambda: True) -> None:
        self.etcd, self.me, self.ttl = etcd, me, ttl
        self.key, self.members_key = (prefix + "/leader").encode(), (prefix + "/members/").encode()
        self._on_change, self._alive = on_change, alive
        self.fence: Fence | None = None     # set while this coordinator leads
        self.leader: dict | None = None     # the leader's record as last read (ours while leading)
        self.problem = ""                   # why etcd could not be reached, "" when it can
        self.lease = 0
        self._renewed = 0.0                 # monotonic time of the last renewal
        self._next_renewal = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankctl-leadership", daemon=True)

    @property
    def leading(self) -> bool:
        return self.fence is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread and hand leadership over at once (the lease is revoked)."""
        self._stop.set()
        self._thread.join(5)
        if self.lease:
            try:
                self.etcd.revoke(self.lease, timeout=1.0)
            except (Unreachable, grpc.RpcError):
                pass

    def resign(self, why: str) -> None:
        """Step down now (a fenced write failed): from any thread."""
        if self.fence is not None:
            self._lose(why)

    def members(self) -> list[dict]:
        return [json.loads(kv.value) for kv in self.etcd.scan(self.members_key, prefix_end(self.members_key))]

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
                if self.problem:
                    log.info("store.reachable_again", store=str(self.etcd.url))
                    self.problem = ""
                    self._on_change()
            except (Unreachable, grpc.RpcError) as exc:
                problem = store_problem(exc)
                if problem != self.problem:
                    log.warning("store.unreachable", error=problem)
                    self.problem = problem
                    if self.fence is None:
                        self.leader = None  # what was read before may be stale: no leader is known now
                    self._on_change()
            if self.fence is not None and time.monotonic() - self._renewed > self.ttl - MARGIN_S:
                self._lose(f"its lease was not renewed for {self.ttl - MARGIN_S:.1f} s"
                           + (f" ({self.problem})" if self.problem else ""))
            self._stop.wait(POLL_S)

    def _round(self) -> None:
        now = time.monotonic()
        if not self.lease:
            self.lease = self.etcd.grant(self.ttl)
            self.etcd.txn(rpc.TxnRequest(success=[rpc.RequestOp(request_put=rpc.PutRequest(
                key=self.members_key + self.me.id.encode(), value=self.me.to_json(), lease=self.lease))]))
            self._renewed, self._next_renewal = now, now + self.ttl / 3
        elif now >= self._next_renewal and self._alive():
            if self.etcd.keepalive(self.lease) <= 0:
                self.lease = 0
                if self.fence is not None:
                    self._lose("its lease expired")
                return
            self._renewed, self._next_renewal = time.monotonic(), time.monotonic() + self.ttl / 3
        if self.fence is None:
            self._campaign()

    def _campaign(self) -> None:
        record = json.dumps({"id": self.me.id, "address": self.me.address, "since": time.time()}).encode()
        resp = self.etcd.txn(rpc.TxnRequest(
            compare=[rpc.Compare(key=self.key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                                 create_revision=0)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=self.key, value=record, lease=self.lease))],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=self.key))]))
        if resp.succeeded:
            self.fence = Fence(self.key, resp.header.revision, self.me.id)
            self.leader = json.loads(record)
            log.info("coordinator.leading", id=self.me.id, revision=resp.header.revision)
            self._on_change()
            return
        kvs = resp.responses[0].response_range.kvs
        leader = json.loads(kvs[0].value) if kvs else None
        if leader != self.leader:
            self.leader = leader
            self._on_change()

    def _lose(self, why: str) -> None:
        log.warning("coordinator.stepping_down", id=self.me.id, why=why)
        self.fence, self.leader = None, None
        old, self.lease = self.lease, 0
        if old:  # let the others take over at once rather than after the lease (when etcd answers)
            threading.Thread(target=self._revoke_quietly, args=(old,), daemon=True).start()
        self._on_change()

    def _revoke_quietly(self, lease: int) -> None:
        for _ in range(30):
            try:
                self.etcd.revoke(lease, timeout=1.0)
                return
            except (Unreachable, grpc.RpcError):
                time.sleep(1.0)
