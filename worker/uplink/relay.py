"""A relay tree on the daemon side (``coordinator.scheduling.relay``): a head forwards, every node checks what it is handed.

``RelayInbox`` (every daemon): a Relayed item is taken only if it names this node, its MAC holds under this
session's key (``Registered.relay_key``, ``contract.relaymac``) and its number is above the last one taken; it must
hold an Assign, which then goes where the coordinator stream's Assigns go (``dispatch``, started beside the
caller: a PeerService call is answered at once). A relayed Assign can reach the node after a direct message that
followed it (a Cancel, or the coordinator's own copy when the relay looked failed), every Assign, whichever way it
came, is taken once (``fresh``) and none after a Cancel of its attempt (``worker.runs.inplace.InPlace.cancelled``).

``forward`` (a head): one Relay's items, each to its node's ``PeerService.Deliver`` (this node's own taken here),
``PARALLEL`` at once, each within ``DELIVER_S``; the ``RelayDone`` names the nodes that failed, and the coordinator
sends them theirs itself. A relayed Assign names where the node sends its report batches (``report_via``: its
head's PeerService; ``Uplink.via``); ``serve_forward`` is the head's side of that (``Uplink.carry``: onto its own
stream). The session's key is held once, by its ``Uplink``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from rankctl.contract.relaymac import DOWN, UP, relay_mac, relay_mac_ok
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from rankctl.worker.replication.peerchannels import peer_channel

PARALLEL = 64       # deliveries a head has under way at once
DELIVER_S = 3.0     # one delivery's deadline
MAX_ITEMS = 1024    # items of one Relay forwarded at most (the coordinator's --relay-width is at most 1,024)
FORWARD_S = 3.0     # a batch handed to a relay head is on its coordinator stream within this, or goes direct
CARRIED = 256       # group nodes' batches in one RelayedBatches at most
REMEMBERED = 1024   # Assigns taken that a node remembers (to know a copy)


class RelayRefused(Exception):
    """A relayed item this node does not take; the words say why."""


class RelayInbox:
    def __init__(self) -> None:
        self.node, self._log = "", None   # set by ``bind``, as the rest of what the daemon gives it
        self._keyed, self._last_seq = b"", 0   # the session key the last item taken was checked under, its number
        self._dispatch: Callable[[pb.Assign], Awaitable[None]] | None = None
        self.uplink: Uplink | None = None
        self._taken: OrderedDict[tuple[str, int, bytes], None] = OrderedDict()   # (job, attempt, digest)
        self._tasks: set[asyncio.Future] = set()

    def bind(self, node: str, dispatch: Callable[[pb.Assign], Awaitable[None]], log: Any,
             uplink: Uplink | None = None) -> None:
        """``dispatch``: where a taken Assign goes; ``uplink``: the session's relay parts (its key, where reports
        go, the batches a head carries)."""
        self.node, self._dispatch, self._log, self.uplink = node, dispatch, log, uplink

    def check(self, item: pb.Relayed) -> pb.Assign:
        if item.node != self.node:
            raise RelayRefused(f"item for node {item.node[:64]!r} handed to node {self.node!r}")
        key = self.uplink.key if self.uplink is not None else b""
        if key != self._keyed:   # a new session: items signed for an older one are refused, numbers start again
            self._keyed, self._last_seq = key, 0
        if not relay_mac_ok(key, DOWN, item.node, item.seq, item.mac, item.message, item.report_via.encode()):
            raise RelayRefused(f"item {item.seq} is not signed with this session's key (a forgery, or a session "
                               "that ended)")
        if item.seq <= self._last_seq:
            raise RelayRefused(f"item {item.seq} is a replay (item {self._last_seq} was taken)")
        try:
            msg = pb.CoordinatorMessage.FromString(item.message)
        except DecodeError as exc:
            raise RelayRefused(f"item {item.seq} holds no CoordinatorMessage: {exc}") from None
        if msg.WhichOneof("body") != "assign":
            raise RelayRefused(f"item {item.seq} holds a {msg.WhichOneof('body')}, not an Assign")
        self._last_seq = item.seq
        return msg.assign

    def deliver(self, item: pb.Relayed) -> None:
        """Check ``item`` (``RelayRefused``) and start its Assign's handling beside the caller."""
        assign = self.check(item)
        if self._dispatch is None:
            raise RelayRefused("this daemon takes no work yet")
        if self.uplink is not None:
            self.uplink.via = item.report_via
        task = asyncio.ensure_future(self._dispatch(assign))
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Future) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._log is not None:
            self._log.error("relayed assign failed", error=repr(task.exception())[:300])

    def fresh(self, assign: pb.Assign) -> bool:
        """False for a copy of an Assign taken before (the same job, attempt and bytes: a relayed one and the
        coordinator's own); else it is remembered as taken."""
        key = (assign.job_id, assign.attempt, hashlib.blake2b(assign.SerializeToString(), digest_size=16).digest())
        if key in self._taken:
            return False
        self._taken[key] = None
        while len(self._taken) > REMEMBERED:
            self._taken.popitem(last=False)
        return True

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Uplink:
    """The session's relay parts (``worker.uplink.session``): a node's report batches through its head (``via``: the head's
    PeerService, from a relayed Assign; "": the node's own stream), and a head's batches of its group to carry."""

    def __init__(self, node: str, credentials: grpc.ChannelCredentials | None, log: Any) -> None:
        self.node, self._credentials, self._log = node, credentials, log
        self.via = ""
        self.key, self._seq = b"", 0                         # this session's key (Registered), the last batch's number
        self._channel: tuple[str, grpc.aio.Channel] | None = None   # to ``via``
        self.carried: list[tuple[pb.NodeBatch, asyncio.Future]] = []
        self.wake: Callable[[], None] = lambda: None          # the session's writer: something to send
        self.online: Callable[[], bool] = lambda: False

    def keyed(self, key: bytes) -> None:
        """A new session: its key; batches go on its own stream until a relayed Assign names a head."""
        self.key, self._seq, self.via = key, 0, ""

    async def forward(self, body: pb.ReportBatch) -> bool:
        """Hand one batch to the head, signed; False (and report on the own stream from now on) when it fails."""
        via = self.via
        self._seq += 1
        data = body.SerializeToString()
        nb = pb.NodeBatch(node=self.node, seq=self._seq, batch=data,
                          mac=relay_mac(self.key, UP, self.node, self._seq, data))
        if self._channel is None or self._channel[0] != via:
            if self._channel is not None:
                asyncio.get_running_loop().create_task(self._channel[1].close())
            self._channel = (via, peer_channel(via, self._credentials))
        try:
            await pb_grpc.PeerServiceStub(self._channel[1]).Forward(pb.ForwardRequest(batch=nb), timeout=FORWARD_S)
            return True
        except grpc.aio.AioRpcError as exc:
            self._log.warning("relay head unreachable: reporting on the coordinator stream", head=via,
                              error=f"{exc.code().name}: {exc.details()}")
            if self.via == via:
                self.via = ""
            return False

    async def carry(self, nb: pb.NodeBatch) -> bool:
        """As a head: put a group node's batch on the session's stream; True once written, False when there is no
        session or it is not written within ``FORWARD_S``."""
        if not self.online():
            return False
        fut = asyncio.get_running_loop().create_future()
        self.carried.append((nb, fut))
        self.wake()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), FORWARD_S)
        except asyncio.TimeoutError:
            return False

    def take_carried(self) -> tuple[pb.NodeMessage, Callable[[], None]]:
        """The next message of carried batches, and what to call once it is written."""
        out, self.carried = self.carried[:CARRIED], self.carried[CARRIED:]

        def written() -> None:
            for _, fut in out:
                if not fut.done():
                    fut.set_result(True)
        return pb.NodeMessage(relayed=pb.RelayedBatches(batches=[nb for nb, _ in out])), written

    def ended(self) -> None:
        """The session ended: what was to be carried is not (its nodes send it on their own streams)."""
        for _, fut in self.carried:
            if not fut.done():
                fut.set_result(False)
        self.carried.clear()


async def forward(relay: pb.Relay, inbox: RelayInbox, credentials: grpc.ChannelCredentials | None) -> pb.RelayDone:
    """Hand each item to its node; what failed, for the coordinator."""
    failed: list[str] = []
    errors: list[str] = []
    gate = asyncio.Semaphore(PARALLEL)
    channels: dict[str, grpc.aio.Channel] = {}

    async def one(item: pb.Relayed) -> None:
        try:
            if item.node == inbox.node:
                inbox.deliver(item)
                return
            async with gate:
                channel = channels.get(item.peer)
                if channel is None:
                    channel = channels[item.peer] = peer_channel(item.peer, credentials)
                await pb_grpc.PeerServiceStub(channel).Deliver(pb.DeliverRequest(item=item), timeout=DELIVER_S)
        except RelayRefused as exc:
            failed.append(item.node)
            errors.append(f"{item.node}: {exc}")
        except grpc.aio.AioRpcError as exc:
            failed.append(item.node)
            errors.append(f"{item.node} ({item.peer}): {exc.code().name}: {exc.details()}")
        except Exception as exc:  # noqa: BLE001 - a bad peer address and the like: that node goes direct
            failed.append(item.node)
            errors.append(f"{item.node} ({item.peer[:64]}): {type(exc).__name__}: {exc}")

    try:
        await asyncio.gather(*(one(item) for item in relay.items[:MAX_ITEMS]))
    finally:
        await asyncio.gather(*(c.close() for c in channels.values()), return_exceptions=True)
    failed.extend(item.node for item in relay.items[MAX_ITEMS:])
    return pb.RelayDone(bundle=relay.bundle, failed=failed, error=errors[0][:300] if errors else "")


async def serve_forward(inbox: RelayInbox, request: pb.ForwardRequest, context: Any) -> pb.ForwardResponse:
    """``PeerService.Forward``: a node of this head's group hands it a report batch for the coordinator."""
    if inbox.uplink is None or not await inbox.uplink.carry(request.batch):
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"relay head {inbox.node} has no session with the "
                            "coordinator: send it on your own stream")
    return pb.ForwardResponse()


async def serve_deliver(inbox: RelayInbox, request: pb.DeliverRequest, context: Any) -> pb.DeliverResponse:
    """``PeerService.Deliver``: a head hands this node one item."""
    try:
        inbox.deliver(request.item)
    except RelayRefused as exc:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
    return pb.DeliverResponse()
