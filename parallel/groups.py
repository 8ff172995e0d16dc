"""One rank's communication groups, built once from its assignment and passed down explicitly.

``ProcessGroups.build`` creates a communicator only for the distinct member lists this rank
belongs to (``use_local_synchronization=True``: non-members never take part):

* names with identical member lists share one communicator (``tp_cp`` == ``tp`` when cp=1);
* a member list equal to the whole world reuses the default group;
* size-1 groups get no communicator: ``pgs.size(name) == 1`` and ``pgs[name]`` raises
  ``SingletonGroupError``; code asks ``pgs.size(name) > 1`` (or ``pgs.get(name)``) first.

Creation order is global: distinct member lists sorted as tuples. With local
synchronization each creation blocks until every member has made the same call, so two
ranks creating overlapping groups in different orders would deadlock; a total order that
every rank agrees on cannot (the classic lock-ordering argument).

Communicators are never split from the default one: with a device bound to the default
group (``init_process_group(device_id=...)``) NCCL creates subgroups by ``ncclCommSplit``,
which needs every rank of the parent, and that contradicts local synchronization. The
rank runtime therefore sets the CUDA device but does not bind it.

Group names. With local synchronization torch (2.13) names a group
``sha1(ranks + "_" + len(_world.pg_names))``: the number of groups *this process* has
made so far. Ranks that belong to different earlier groups compute different names for
the same group, and gloo (whose full-mesh connect keys off the name) waits forever
(pytorch PR #189073 changes the salt but still assumes every rank calls ``new_group``).
While building, ``_rank_only_names`` swaps in a name that depends on the member list
alone; this is safe because the member lists are distinct.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterable, Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from rankctl.parallel.layout import GroupName

WORLD = GroupName.WORLD

NewGroup = Callable[..., "dist.ProcessGroup | None"]


class SingletonGroupError(KeyError):
    """The group of this name has one member, so it has no communicator."""


def creation_order(rank: int, groups: dict[str, list[int]]) -> list[tuple[int, ...]]:
    """Distinct member lists (size > 1) this rank must create, in the global order."""
    distinct: set[tuple[int, ...]] = set()
    for name, members in groups.items():
        members_t = tuple(sorted(members))
        if rank not in members_t:
            raise ValueError(f"rank {rank} is not a member of its {name} group {list(members_t)}")
        if len(set(members_t)) != len(members_t):
            raise ValueError(f"{name} group {list(members)} repeats a rank")
        if len(members_t) > 1:
            distinct.add(members_t)
    return sorted(distinct)


def group_name(ranks: Iterable[int]) -> str:
    """The name every member computes for the group of ``ranks`` (sorted)."""
    return hashlib.sha1(("rankctl_" + "_".join(map(str, ranks))).encode(), usedforsecurity=False).hexdigest()


@contextmanager
def _rank_only_names() -> Iterator[None]:
    """Make torch name local-synchronization groups by member list alone (see module doc)."""
    original = getattr(c10d, "_hash_ranks_to_str", None)
    if original is None:  # a torch without the helper: nothing to patch
        yield
        return
    c10d._hash_ranks_to_str = group_name
    try:
        yield
    finally:
        c10d._hash_ranks_to_str = original


class ProcessGroups:
    """This rank's groups by name: ``pgs["tp"]``, ``pgs.ranks("tp")``, ``pgs.size("tp")``.

    The name ``world`` is always present (the default group).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        groups: dict[str, list[int]],
        handles: dict[tuple[int, ...], "dist.ProcessGroup"],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self._members = {k: tuple(sorted(v)) for k, v in groups.items()}
        self._members.setdefault(WORLD, tuple(range(world_size)))
        self._handles = dict(handles)

    @classmethod
    def build(
        cls,
        rank: int,
        world_size: int,
        groups: dict[str, list[int]],
        *,
        timeout: timedelta | None = None,
        backend: str | None = None,
        new_group: NewGroup | None = None,
    ) -> "ProcessGroups":
        """Create this rank's communicators; every member must call this with the same groups."""
        make = new_group or dist.new_group
        world = tuple(range(world_size))
        handles: dict[tuple[int, ...], dist.ProcessGroup] = {}
        with _rank_only_names():
            for members in creation_order(rank, groups):
                if members == world:
                    handles[members] = dist.group.WORLD
                    continue
                pg = make(list(members), timeout=timeout, backend=backend, use_local_synchronization=True)
                if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
                    raise RuntimeError(f"rank {rank} got no communicator for its group {list(members)}")
                handles[members] = pg
        if world_size > 1:
            handles.setdefault(world, dist.group.WORLD)
        return cls(rank, world_size, groups, handles)

    # -- access ---------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._members)

    def __contains__(self, name: str) -> bool:
        return name in self._members

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's ``name`` group, ascending."""
        return list(self._lookup(name))

    def size(self, name: str) -> int:
        return len(self._lookup(name))

    def local_rank(self, name: str) -> int:
        """This rank's index inside its ``name`` group."""
        return self._lookup(name).index(self.rank)

    def get(self, name: str) -> "dist.ProcessGroup | None":
        """The communicator, or None for a size-1 group (never the world by accident)."""
        return self._handles.get(self._lookup(name))

    def __getitem__(self, name: str) -> "dist.ProcessGroup":
        members = self._lookup(name)
        if len(members) == 1:
            raise SingletonGroupError(
                f"the {name} group of rank {self.rank} has one member, so it has no communicator; "
                f"check pgs.size({name!r}) > 1 before communicating"
            )
        return self._handles[members]

    def distinct(self, names: Iterable[str] | None = None) -> list[tuple[tuple[int, ...], list[str]]]:
        """(members, names sharing them) for each distinct group of size > 1, in creation order."""
        by_members: dict[tuple[int, ...], list[str]] = {}
        for name in names if names is not None else self.names:
            members = self._lookup(name)
            if len(members) > 1:
                by_members.setdefault(members, []).append(name)
        return sorted(by_members.items())

    def _lookup(self, name: str) -> tuple[int, ...]:
        try:
            return self._members[name]
        except KeyError:
            raise KeyError(
                f"rank {self.rank} has no {name!r} group; its names are {', '.join(self.names)}"
            ) from None

    def destroy(self) -> None:
        """Destroy the subgroups (not the default group)."""
        for pg in self._handles.values():
            if pg is not dist.group.WORLD:
                dist.destroy_process_group(pg)
        self._handles.clear()

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={list(v)}" for k, v in self._members.items())
        return f"ProcessGroups(rank={self.rank}, {shown})"
