"""Rank logs live on the nodes: the coordinator reads them from the owning daemon (FetchLogs).

Placeholder; see the module owner's work in progress.
"""

from __future__ import annotations

from typing import AsyncIterator

from rankctl.proto import rankctl_pb2 as pb


class LogFetcher:
    """Outstanding FetchLogs requests, answered by the nodes' LogChunk messages."""

    def __init__(self, send) -> None:  # noqa: ANN001
        self.send = send

    def deliver(self, node: str, chunk: pb.LogChunk) -> None:
        pass

    def fail_node(self, node: str, why: str) -> None:
        pass


async def get_logs(core, request: pb.GetLogsRequest) -> AsyncIterator[pb.LogLine]:  # noqa: ANN001
    raise NotImplementedError
    yield
