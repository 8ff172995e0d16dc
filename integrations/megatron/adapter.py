"""A ``ParallelContext`` over ``parallel.groups.ProcessGroups``: the groups a rank already built.

``ProcessGroups`` gives one-member groups no communicator; Megatron asks every group its
size and rank, so the first one-member kind asked for gets one local group (this rank
alone, no peers to wait for), shared by every one-member kind.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from rankctl.parallel.groups import ProcessGroups
from rankctl.parallel.layout import RankLayout

from .naming import salted_names


class GroupsContext:
    """``ParallelContext`` for one rank: its ``ProcessGroups`` and the job's ``RankLayout``."""

    def __init__(self, groups: ProcessGroups, layout: RankLayout) -> None:
        if groups.world_size != layout.world_size:
            raise ValueError(
                f"the groups are for {groups.world_size} ranks but the layout for {layout.world_size}"
            )
        self.groups = groups
        self._layout = layout
        self._alone: dist.ProcessGroup | None = None

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def layout(self) -> RankLayout:
        return self._layout

    def ranks(self, kind: str) -> list[int]:
        return self.groups.ranks(kind)

    def group(self, kind: str) -> dist.ProcessGroup:
        """This rank's ``kind`` group; a one-member kind gets the shared one-member group."""
        if self.groups.size(kind) > 1:
            return self.groups[kind]
        return self.alone()

    def alone(self) -> dist.ProcessGroup:
        """The one group of this rank alone, shared by every one-member kind (created on first use)."""
        if self._alone is None:
            with salted_names("alone"):
                self._alone = dist.new_group([self.rank], use_local_synchronization=True)
        return self._alone

    @property
    def created_alone(self) -> int:
        """How many one-member groups this context created (0 or 1)."""
        return int(self._alone is not None)

    def destroy(self) -> None:
        """Destroy this context's groups (not the default group)."""
        if self._alone is not None:
            dist.destroy_process_group(self._alone)
            self._alone = None
        self.groups.destroy()


def build_context(
    rank: int,
    layout: RankLayout,
    *,
    timeout: timedelta | None = None,
    backend: str | None = None,
) -> GroupsContext:
    """Create ``rank``'s own groups of ``layout`` and wrap them; every rank must call this."""
    groups = ProcessGroups.build(
        rank, layout.world_size, layout.rank_groups(rank), timeout=timeout, backend=backend
    )
    return GroupsContext(groups, layout)
