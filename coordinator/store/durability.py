"""When a committed transaction is stored, and where a replicated store's transactions go.

The embedded store's commit is its storage: ``AT_ONCE``. A replicated store's leader commits to its local copy
and stores behind the event loop (``coordinator.ha.replicator.Replicator``, a ``Durability``): what depends on a
write waits for it ("persist, then send"): a node message (``coordinator.fleet.nodes.NodeTable.send``) and an
RPC's answer (``coordinator.api.servicer``).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Callable, Protocol

# the newest ticket a task's own writes got (each asyncio task has its own: an RPC's answer waits for its writes,
# never for those other tasks made meanwhile)
WRITTEN: ContextVar[int] = ContextVar("rankctl_written", default=0)


class Replica(Protocol):
    """Where a replicated store's transactions go: a leader's ``Replicator`` (which stores them off the loop), a
    standby's ``coordinator.ha.journal.Journal`` (at once). ``submit`` raises StoreError when it refuses, and
    then nothing of the transaction is kept."""

    def submit(self, changes: list, what: str) -> None: ...


class Durability:
    """Tickets of committed transactions, and waiting for them to be stored: here, each is stored at once."""

    submitted = 0   # the newest ticket (a count of committed transactions)

    def pending(self) -> bool:
        """Whether some committed transaction is not stored yet."""
        return False

    def after(self, send: Callable[[], None]) -> None:
        """Run ``send`` once everything committed so far is stored (at once when nothing is pending); never, if
        that is refused. Calls keep their order."""
        send()

    async def stored(self, ticket: int) -> None:
        """Return once ``ticket`` (and every one before it) is stored; StoreError when it was refused instead."""


AT_ONCE = Durability()
