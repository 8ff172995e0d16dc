"""Per-group collective counters in a rank: which collective it is in, and how long it waited.

Each rank counts, per process group, the collectives and point-to-point batches it has entered
and completed, the operation it is in and since when, and the seconds spent waiting in them. The
counters live in a small memory-mapped file the node's daemon reads (``contract.files.collfiles``):
no collective, message or syscall is added; a call costs two ``struct.pack_into``. Groups are
named by the layout kinds that have the same members (``tp``, ``dp,tp-dp`` ...), so a hang can be
told as "the tp group [2, 3] is in all_reduce #41 and rank 3 never entered it".

``install(counters)`` wraps the ``torch.distributed`` functions a rank or a user's script calls
(``dist.all_reduce`` ...), so the ``train`` kind and ``python`` scripts are counted alike. An
``async_op=True`` call is entered when it is launched and completed when its ``wait()`` returns
(only the time inside ``wait()`` counts as waiting); a ``batch_isend_irecv`` is one operation,
completed when every request of it was waited on. Nested calls (torch's own helpers calling
other collectives) count once, as the outer operation.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import torch.distributed as dist

from rankctl.contract.files import collfiles as C
from rankctl.contract.files.rankfiles import open_own

# The wrapped functions (module attributes of torch.distributed); a missing one is skipped.
WRAPPED = C.OPS


class CollectiveCounters:
    """The counters of one rank, in ``{run_dir}/rank-{rank}.coll`` (layout: ``contract.files.collfiles``)."""

    def __init__(self, run_dir: str, rank: int, world_size: int, groups: dict[str, list[int]], *,
                 clock: Callable[[], float] = time.time) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.rank, self.world_size = rank, world_size
        self._clock = clock
        self._names: dict[tuple[int, ...], str] = {}
        for kind, members in groups.items():
            key = tuple(sorted(members))
            self._names[key] = f"{self._names[key]},{kind}" if key in self._names else kind
        self._names.setdefault(tuple(range(world_size)), "world")
        self._slots: dict[Any, int] = {}
        self._labels: list[dict[str, Any]] = []
        self.path = C.counters_path(run_dir, rank)
        self._meta_path = C.meta_path(run_dir, rank)
        with open(open_own(self.path, os.O_RDWR), "w+b") as f:   # never through a link planted there
            f.truncate(C.FILE_BYTES)
            self._buf = mmap.mmap(f.fileno(), C.FILE_BYTES)
        C.HEADER.pack_into(self._buf, 0, C.MAGIC, C.VERSION, 0, -1, 0.0)
        self._wait_total = 0.0
        self._local = threading.local()

    # -- slots --------------------------------------------------------------------------------
    def slot(self, group: Any) -> int:
        """The counter slot of ``group`` (None: the default group), allocated on first use."""
        key = group if group is not None else "world"
        found = self._slots.get(key)
        if found is not None:
            return found
        members = self._members(group)
        if len(self._labels) >= C.MAX_SLOTS - 1:
            index = C.MAX_SLOTS - 1  # the last slot is shared by whatever does not fit
            if len(self._labels) == C.MAX_SLOTS - 1:
                self._labels.append({"kind": "other", "members": []})
        else:
            index = len(self._labels)
            name = self._names.get(tuple(members), "group")
            self._labels.append({"kind": name, "members": members[: C.MAX_MEMBERS_SHOWN],
                                 "size": len(members)})
        self._slots[key] = index
        self._write_meta()
        return index

    def _members(self, group: Any) -> list[int]:
        if group is None or group is dist.GroupMember.WORLD:
            return list(range(self.world_size))
        try:
            return sorted(dist.get_process_group_ranks(group))
        except (RuntimeError, ValueError):
            return []

    def _write_meta(self) -> None:
        C.write_meta(self._meta_path, self._labels)
        C.HEADER.pack_into(self._buf, 0, C.MAGIC, C.VERSION, len(self._labels), -1, self._wait_total)

    # -- counting -----------------------------------------------------------------------------
    def enter(self, slot: int, op: str, *, blocking: bool) -> float:
        """Count an operation entered; ``blocking``: the rank waits in it now (not an async launch)."""
        entered, completed, _, _, wait = C.SLOT.unpack_from(self._buf, C.slot_offset(slot))
        now = self._clock()
        C.SLOT.pack_into(self._buf, C.slot_offset(slot), entered + 1, completed, C.OP_INDEX.get(op, 0), now, wait)
        if blocking:
            self.block(slot)
        return now

    def block(self, slot: int) -> None:
        """The rank waits in ``slot``'s operation now (-1: in none)."""
        C.HEADER.pack_into(self._buf, 0, C.MAGIC, C.VERSION, len(self._labels), slot, self._wait_total)

    def leave(self, slot: int, waited_since: float) -> None:
        entered, completed, op, since, wait = C.SLOT.unpack_from(self._buf, C.slot_offset(slot))
        waited = max(0.0, self._clock() - waited_since)
        self._wait_total += waited
        C.SLOT.pack_into(self._buf, C.slot_offset(slot), entered, completed + 1, op, since, wait + waited)
        C.HEADER.pack_into(self._buf, 0, C.MAGIC, C.VERSION, len(self._labels), -1, self._wait_total)

    def waited(self, slot: int, seconds: float) -> None:
        """Add wait time without completing (an async request waited on, not yet the last)."""
        entered, completed, op, since, wait = C.SLOT.unpack_from(self._buf, C.slot_offset(slot))
        self._wait_total += seconds
        C.SLOT.pack_into(self._buf, C.slot_offset(slot), entered, completed, op, since, wait + seconds)

    def now(self) -> float:
        return self._clock()

    @property
    def wait_total(self) -> float:
        """Seconds this rank has spent waiting in collectives so far."""
        return self._wait_total

    @property
    def depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @depth.setter
    def depth(self, value: int) -> None:
        self._local.depth = value

    @contextlib.contextmanager
    def busy(self, activity: str) -> Iterator[None]:
        """The rank is busy with ``activity`` (``contract.files.collfiles.ACTIVITIES``: a checkpoint, a restore ...)
        until the block ends: a peer waiting for it meanwhile is no hang until ``restart.hang_timeout``."""
        index = C.ACTIVITIES.index(activity) if activity in C.ACTIVITIES else C.ACTIVITIES.index("busy")
        (before,) = C.ACTIVITY.unpack_from(self._buf, C.HEADER.size)
        C.ACTIVITY.pack_into(self._buf, C.HEADER.size, index)
        try:
            yield
        finally:
            C.ACTIVITY.pack_into(self._buf, C.HEADER.size, before)

    def close(self) -> None:
        self._buf.close()


class _Request:
    """An async request (``Work``) that counts its operation completed once every request of it waited."""

    __slots__ = ("_work", "_batch", "_waited")

    def __init__(self, work: Any, batch: list) -> None:
        self._work, self._batch, self._waited = work, batch, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self._waited:  # waited on before: counted then
            return self._work.wait(*args, **kwargs)
        self._waited = True
        batch = self._batch
        counters, slot = batch[0], batch[1]
        t0 = counters.now()
        counters.block(slot)
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            if batch[3] == 1:
                batch[3] = 0
                counters.leave(slot, t0)  # the operation's last request: completed, blocked in none
            else:
                batch[3] -= 1
                counters.waited(slot, counters.now() - t0)
                counters.block(-1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _group_of(name: str, args: tuple, kwargs: dict) -> Any:
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list")
        return ops[0].group if ops else None
    group = kwargs.get("group")
    if group is None and name in C.GROUP_ARG:
        index = C.GROUP_ARG[name]
        if len(args) > index:
            group = args[index]
    return group


def _wrap(counters: CollectiveCounters, name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if counters.depth:
            return fn(*args, **kwargs)
        slot = counters.slot(_group_of(name, args, kwargs))
        asynchronous = name in C.ASYNC_ALWAYS or bool(kwargs.get("async_op"))
        t0 = counters.enter(slot, name, blocking=not asynchronous)
        counters.depth += 1
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            counters.leave(slot, t0)
            raise
        finally:
            counters.depth -= 1
        works = result if isinstance(result, list) else [result] if hasattr(result, "wait") else []
        if not works:
            counters.leave(slot, t0)
            return result
        if not asynchronous:  # async_op passed by position
            counters.block(-1)
        batch = [counters, slot, t0, len(works)]
        wrapped = [_Request(w, batch) for w in works]
        return wrapped if isinstance(result, list) else wrapped[0]

    counted.__rankctl_counted__ = True  # type: ignore[attr-defined]
    return counted


def install(counters: CollectiveCounters, names: Iterable[str] = WRAPPED) -> Callable[[], None]:
    """Count every call of ``torch.distributed.<name>`` in this process; returns the undo."""
    originals: dict[Any, Any] = {}
    saved: dict[str, Any] = {}
    for name in names:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "__rankctl_counted__", False):
            continue
        saved[name] = fn
    for name, fn in saved.items():
        wrapper = _wrap(counters, name, fn)
        originals[wrapper] = fn
        setattr(dist, name, wrapper)
    base = dist.P2POp
    if "isend" in saved or "irecv" in saved:
        # torch checks ``op is isend`` (P2POp and batch_isend_irecv): a P2POp built from a counted
        # isend/irecv holds the original; the batch is counted as one operation by its own wrapper
        class P2POp(base):  # type: ignore[misc, valid-type]
            def __new__(cls, op: Callable, *args: Any, **kwargs: Any) -> Any:
                return super().__new__(cls, originals.get(op, op), *args, **kwargs)

            def __init__(self, op: Callable, *args: Any, **kwargs: Any) -> None:
                super().__init__(originals.get(op, op), *args, **kwargs)

        dist.P2POp = P2POp

    def undo() -> None:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        dist.P2POp = base

    return undo
