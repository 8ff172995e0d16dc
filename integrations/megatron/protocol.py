"""What ``initialize_model_parallel`` needs from a rank: its rank, layout and own groups (``ParallelContext``).

A narrower view than a kind's ``RankContext`` (``kinds.context``): ``rankctl.context()`` (the rank runtime's
context) and ``GroupsContext`` (``adapter.py``) both satisfy it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch.distributed as dist

    from rankctl.parallel.layout import RankLayout


@runtime_checkable
class ParallelContext(Protocol):
    """What Megatron's parallel state needs of one rank: global rank, the job's layout, and its groups by kind.

    ``group(kind)`` returns a real process group for every kind this rank belongs to, a
    one-member group included (Megatron asks ``group.size()`` and ``group.rank()`` of it);
    each kind's group is created once. ``ranks(kind)`` lists the members, ascending.
    ``alone()`` is the group of this rank alone (the one a one-member kind's ``group`` returns).
    Group names are ``rankctl.parallel.layout.GROUP_NAMES``; a rank lacks ``embd`` / ``pos_embd``
    when it is not a member, and asking for them then raises ``KeyError``.
    """

    @property
    def rank(self) -> int: ...

    @property
    def layout(self) -> "RankLayout": ...

    def group(self, kind: str) -> "dist.ProcessGroup": ...

    def ranks(self, kind: str) -> list[int]: ...

    def alone(self) -> "dist.ProcessGroup": ...
