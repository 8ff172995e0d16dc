"""What a kind's rank code sees of its rank: the ``RankContext`` protocol, defined here on the kinds' side.

``runtime.context.RankContext`` implements it; kinds type against this protocol and never import the
runtime, so the only dependency between the two packages is runtime -> kinds.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from rankctl.contract.assignment import RankAssignment
    from rankctl.contract.spec import JobSpec
    from rankctl.parallel.groups import ProcessGroups
    from rankctl.parallel.layout import RankLayout


class RankExit(RuntimeError):
    """A rank's code asked for this exit status (a script's ``sys.exit(code)``): the rank process exits with it
    (1..255, as a shell sees it), so that the job's exit code is the program's own."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code if 0 < code < 256 else 1


class StatusSink(Protocol):
    """The rank's status file (``runtime.status.StatusWriter``)."""

    def write(self, phase: str, **fields: Any) -> None: ...


class RankContext(Protocol):
    """One rank's view of its job: identity, typed spec, process groups, device, status and log."""

    assignment: "RankAssignment"
    spec: "JobSpec"
    status: StatusSink
    log: Any
    timeout: timedelta

    @property
    def coords(self) -> dict[str, int]: ...
    @property
    def local_world_size(self) -> int: ...
    @property
    def node_index(self) -> int: ...
    @property
    def layout(self) -> "RankLayout": ...
    @property
    def groups(self) -> "ProcessGroups": ...
    @property
    def backend(self) -> str: ...
    @property
    def device(self) -> "torch.device": ...
    @property
    def checkpoint_dir(self) -> str: ...

    def ranks(self, name: str) -> list[int]: ...
    def group(self, name: str) -> "dist.ProcessGroup": ...
    def report(self, step: int, loss: float | None = None, **metrics: float) -> None: ...
    def reported(self) -> dict[str, Any]: ...
