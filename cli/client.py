"""A thin synchronous gRPC client for ``ctl``: one channel, errors mapped to exit codes."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import grpc

from rankctl.cli.errors import EXIT_UNREACHABLE, EXIT_USAGE, CtlError
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc

DEFAULT_COORDINATOR = "127.0.0.1:7420"
CONNECT_TIMEOUT = 5.0
PAGE_SIZE = 500


class Client:
    """Talks to the coordinator's ClientService at ``address`` (HOST:PORT)."""

    def __init__(self, address: str, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.address = address
        self._channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise CtlError(
                f"cannot reach the coordinator at {address} (start one with `ctl coordinator`, "
                "or set --coordinator / RANKCTL_COORDINATOR)",
                EXIT_UNREACHABLE,
            ) from None
        self.stub = pb_grpc.ClientServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------
    def submit(self, spec_yaml: str, overrides: list[str], source: str, queue_anyway: bool = False) -> pb.Job:
        with rpc_errors(self.address):
            req = pb.SubmitJobRequest(spec_yaml=spec_yaml, overrides=overrides, source=source,
                                      queue_anyway=queue_anyway)
            return self.stub.SubmitJob(req).job

    def get(self, job_id: str) -> pb.Job:
        with rpc_errors(self.address):
            return self.stub.GetJob(pb.GetJobRequest(job_id=job_id))

    def jobs(self, limit: int = 0, states: list[str] = ()) -> list[pb.Job]:
        return list(self.iter_jobs(limit, states))

    def iter_jobs(self, limit: int = 0, states: list[str] = ()) -> Iterator[pb.Job]:
        """Job summaries, newest first, page by page; ``limit`` > 0 stops after that many."""
        token, seen = "", 0
        wanted = [pb.JobState.Value(s) for s in states]
        while True:
            size = min(limit - seen, PAGE_SIZE) if limit > 0 else PAGE_SIZE
            with rpc_errors(self.address):
                page = self.stub.ListJobs(pb.ListJobsRequest(page_size=size, page_token=token, states=wanted))
            for job in page.jobs:
                yield job
            seen += len(page.jobs)
            token = page.next_page_token
            if not token or (limit > 0 and seen >= limit):
                return

    def cancel(self, job_id: str, reason: str) -> pb.Job:
        with rpc_errors(self.address):
            return self.stub.CancelJob(pb.CancelJobRequest(job_id=job_id, reason=reason)).job

    def nodes(self) -> list[pb.Node]:
        with rpc_errors(self.address):
            return list(self.stub.ListNodes(pb.ListNodesRequest()).nodes)

    def watch(self, job_id: str, after_seq: int = 0) -> Iterator[pb.JobEvent]:
        with rpc_errors(self.address):
            yield from self.stub.WatchJob(pb.WatchJobRequest(job_id=job_id, after_seq=after_seq))

    def stat_blob(self, digest: str) -> bool:
        """Whether the coordinator holds the blob ``digest`` already."""
        with rpc_errors(self.address):
            return self.stub.StatBlob(pb.StatBlobRequest(digest=digest)).exists

    def upload_blob(self, digest: str, size: int, chunks: Iterable[bytes]) -> pb.BlobRef:
        """Stream ``size`` bytes (chunks of at most 1 MiB); the first chunk names the digest and the size."""
        def stream() -> Iterator[pb.BlobChunk]:
            first = True
            for data in chunks:
                yield pb.BlobChunk(digest=digest, size=size, data=data) if first else pb.BlobChunk(data=data)
                first = False
            if first:
                yield pb.BlobChunk(digest=digest, size=size)

        with rpc_errors(self.address):
            return self.stub.UploadBlob(stream())

    def logs(self, job_id: str, rank: int | None, follow: bool, tail: int) -> Iterator[pb.LogLine]:
        req = pb.GetLogsRequest(job_id=job_id, rank=rank or 0, all_ranks=rank is None, follow=follow, tail=tail)
        with rpc_errors(self.address):
            yield from self.stub.GetLogs(req)


@contextmanager
def rpc_errors(address: str) -> Iterator[None]:
    """Map gRPC failures to CtlError with the exit codes of ``ctl``."""
    try:
        yield
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise CtlError(f"lost the coordinator at {address}: {details}", EXIT_UNREACHABLE) from None
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
            raise CtlError(details, EXIT_USAGE) from None
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise CtlError(f"the coordinator at {address} cannot take this now: {details}", 1) from None
        raise CtlError(f"coordinator at {address} answered {code.name}: {details}", 1) from None
