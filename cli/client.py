"""A thin synchronous gRPC client for ``ctl``: one channel, errors mapped to exit codes."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

import grpc

from rankctl.cli.errors import EXIT_JOB_FAILED, EXIT_UNREACHABLE, EXIT_USAGE, CtlError
from rankctl.cli.reach import answers, listening, refused_now, speaks_http
from rankctl.proto import LEADER_METADATA, from_short_name
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc

DEFAULT_COORDINATOR = "127.0.0.1:7420"
CONNECT_TIMEOUT = 5.0
PAGE_SIZE = 500
MAX_RANK_PAGE = 4096  # the most ranks one GetJob answers
# as the coordinator's own limit: a finished job's result (per-step losses) may pass gRPC's 4 MiB default
# HTTP/2 pings every 5 s on a call that waits (ctl watch, ctl logs -f): a coordinator that stops answering mid-stream
# (SIGSTOP, a frozen host, a cut link) ends the stream within ~10 s, and the follow loop reconnects or gives up
# (exit 3) instead of waiting on a silent stream for ever; the coordinator permits pings every 1 s
# (``coordinator.app.transport.SERVER_OPTIONS``)
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 16 << 20),
                   ("grpc.keepalive_time_ms", 5000), ("grpc.keepalive_timeout_ms", 5000),
                   ("grpc.http2.ping_timeout_ms", 5000), ("grpc.http2.max_pings_without_data", 0))


class Unimplemented(CtlError):
    """The coordinator does not know this call (an older rankctl)."""


class Client:
    """Talks to the coordinator's ClientService at ``address``: HOST:PORT, or several (``A,B,C``: the coordinators
    of one replicated store). An address that refuses connections is skipped at once; a call that a standby refuses
    goes to the leader it names at once (and later calls stay there), or to the next address; while none leads (an
    election, the store unreachable) calls wait up to ``NO_LEADER_WAIT_S``."""

    def __init__(self, address: str, connect_timeout: float = CONNECT_TIMEOUT, tls_dir: str | None = None) -> None:
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.tls_dir = tls_dir
        self._raw: pb_grpc.ClientServiceStub | None = None  # the stub on the current channel (``raw_stub``)
        self.route: list[tuple[str, str]] = []   # (address, what it said) in the order tried (``_Following``)
        problem: CtlError | None = None
        for candidate in self.addresses:  # the first that answers
            self.address = candidate
            self._channel = self._open(candidate, tls_dir)
            try:
                self._connect(connect_timeout if len(self.addresses) == 1 else min(connect_timeout, 2.0))
                problem = None
                break
            except CtlError as exc:
                self._channel.close()
                self.route.append((candidate, "connection refused" if REFUSED in str(exc) else "unreachable"))
                problem = exc
            except BaseException:
                self._channel.close()
                raise
        if problem is not None:
            raise problem
        self.stub = _Following(self, self.route)

    def switch(self, address: str) -> None:
        """Talk to ``address`` from now on (the leader a standby named, or the next of the addresses)."""
        old, self.address = self._channel, address
        self._channel = self._open(address, self.tls_dir)
        self._raw = pb_grpc.ClientServiceStub(self._channel)
        threading.Thread(target=old.close, daemon=True).start()

    def raw_stub(self) -> pb_grpc.ClientServiceStub:
        if self._raw is None:
            self._raw = pb_grpc.ClientServiceStub(self._channel)
        return self._raw

    def _connect(self, timeout: float) -> None:
        """Wait for the channel; the first time it fails, ask once what listens there: an HTTP server
        (the dashboard's port, say) is an error at once, anything else gets the rest of ``timeout``."""
        end = time.monotonic() + timeout
        settled = threading.Event()
        ready = grpc.channel_ready_future(self._channel)
        ready.add_done_callback(lambda _: settled.set())

        def watch(state: grpc.ChannelConnectivity) -> None:
            if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                settled.set()

        self._channel.subscribe(watch)
        try:
            settled.wait(timeout)
            refused = "" if ready.done() else refused_now(self.address)
            if refused:   # nothing listens there: the kernel said so at once; waiting would not change it
                raise CtlError(f"cannot reach the coordinator at {self.address}: {refused} (start one with `ctl "
                               "coordinator`, or set --coordinator / RANKCTL_COORDINATOR)", EXIT_UNREACHABLE)
            if not ready.done() and speaks_http(self.address):
                raise CtlError(f"{self.address} is an HTTP server (the dashboard?), not the coordinator's gRPC port: "
                               "give --coordinator the address `ctl coordinator --listen` serves (by default "
                               f"port {DEFAULT_COORDINATOR.rpartition(':')[2]})", EXIT_UNREACHABLE)
            ready.result(timeout=max(0.0, end - time.monotonic()))
        except grpc.FutureTimeoutError:
            raise self._unreachable() from None
        finally:
            self._channel.unsubscribe(watch)

    @staticmethod
    def _open(address: str, tls_dir: str | None) -> grpc.Channel:
        if not tls_dir:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        from rankctl.security.certs import CertError
        from rankctl.security.tls import channel_credentials, load_identity_dir

        try:
            identity = load_identity_dir(tls_dir)
        except CertError as exc:
            raise CtlError(f"--tls-dir {tls_dir}: {exc}", EXIT_USAGE) from None
        return grpc.secure_channel(address, channel_credentials(identity), options=CHANNEL_OPTIONS)

    def _unreachable(self) -> CtlError:
        """Why no channel came up: nothing listens (exit 3), or something listens but the handshake
        failed: a TLS coordinator refusing plain text, or a certificate it does not accept (exit 2)."""
        if not listening(self.address):
            return CtlError(f"cannot reach the coordinator at {self.address} (start one with `ctl coordinator`, "
                            "or set --coordinator / RANKCTL_COORDINATOR)", EXIT_UNREACHABLE)
        if not answers(self.address):
            return CtlError(f"the coordinator at {self.address} accepts connections but does not answer (stopped, "
                            "hung or overloaded); check its process and its log", EXIT_UNREACHABLE)
        if not self.tls_dir:
            return CtlError(f"the coordinator at {self.address} accepts no plain-text connection: it serves mutual "
                            "TLS; pass --tls-dir DIR (or set RANKCTL_TLS_DIR) with your certificate from "
                            "`ctl certs issue`", EXIT_USAGE)
        return CtlError(f"the TLS handshake with the coordinator at {self.address} failed with the identity in "
                        f"{self.tls_dir}: the coordinator refused its certificate (another CA, expired, or revoked) "
                        "or its own certificate does not match (its CA or its --san names)", EXIT_USAGE)

    def info(self) -> pb.GetInfoResponse:
        with rpc_errors(self.address):
            return self.stub.GetInfo(pb.GetInfoRequest())

    def close(self) -> None:
        # grpc's connectivity poller (started by _connect's subscribe) wakes every 0.2 s and Channel.close waits
        # for it: close off the caller's path, so that `ctl` exits without that wait (0.2 s a client)
        threading.Thread(target=self._channel.close, name="rankctl-channel-close", daemon=True).start()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------
    def submit(self, spec_yaml: str, overrides: list[str], source: str, queue_anyway: bool = False,
               allocation: pb.AllocationRequest | None = None) -> pb.Job:
        with rpc_errors(self.address):
            req = pb.SubmitJobRequest(spec_yaml=spec_yaml, overrides=overrides, source=source,
                                      queue_anyway=queue_anyway, allocation=allocation)
            return self.stub.SubmitJob(req).job

    def get(self, job_id: str, rank_offset: int = 0, rank_limit: int = 0, summary_only: bool = False) -> pb.Job:
        """The job, its summary and one page of ranks (``rank_limit`` 0: the coordinator's default page)."""
        req = pb.GetJobRequest(job_id=job_id, rank_offset=rank_offset, rank_limit=rank_limit,
                               summary_only=summary_only)
        with rpc_errors(self.address):
            return self.stub.GetJob(req)

    def get_ranks(self, job_id: str, first: int, last: int) -> pb.Job:
        """The job with ranks ``first..last`` (clipped to the world), fetched page by page."""
        job = self.get(job_id, first, min(last - first + 1, MAX_RANK_PAGE))
        while job.next_rank_offset and job.next_rank_offset <= last:
            nxt = job.next_rank_offset
            page = self.get(job_id, nxt, min(last - nxt + 1, MAX_RANK_PAGE))
            job.ranks.extend(page.ranks)
            job.next_rank_offset = page.next_rank_offset
        end = first + len(job.ranks)
        job.next_rank_offset = end if end < job.world_size else 0
        return job

    def jobs(self, limit: int = 0, states: list[str] = ()) -> list[pb.Job]:
        return list(self.iter_jobs(limit, states))

    def iter_jobs(self, limit: int = 0, states: list[str] = ()) -> Iterator[pb.Job]:
        """Job summaries, newest first, page by page; ``limit`` > 0 stops after that many."""
        token, seen = "", 0
        wanted = [from_short_name(pb.JobState, s) for s in states]
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

    def drain(self, node: str, reason: str = "", undrain: bool = False) -> pb.DrainNodeResponse:
        """Drain a node (its jobs move off it) or undrain it (it takes work again, its exclusions cleared)."""
        with rpc_errors(self.address):
            return self.stub.DrainNode(pb.DrainNodeRequest(node=node, reason=reason, undrain=undrain))

    def start_workers(self, allocation: pb.AllocationRequest, nodes: int, slots: int) -> pb.WorkerPool:
        with rpc_errors(self.address):
            req = pb.StartWorkersRequest(allocation=allocation, nodes=nodes, slots=slots)
            return self.stub.StartWorkers(req).pool

    def release_workers(self, pool_id: str, reason: str = "") -> pb.WorkerPool:
        with rpc_errors(self.address):
            return self.stub.ReleaseWorkers(pb.ReleaseWorkersRequest(id=pool_id, reason=reason)).pool

    def worker_pools(self) -> list[pb.WorkerPool]:
        with rpc_errors(self.address):
            return list(self.stub.ListWorkerPools(pb.ListWorkerPoolsRequest()).pools)

    def watch(self, job_id: str, after_seq: int = 0) -> Iterator[pb.JobEvent]:
        with rpc_errors(self.address):
            yield from self.stub.WatchJob(pb.WatchJobRequest(job_id=job_id, after_seq=after_seq))

    def watch_batches(self, job_id: str, after_seq: int = 0, min_interval: float = 0.0) -> Iterator[pb.JobEventBatch]:
        """Event batches with the job's state and summary until it is terminal; Unimplemented on old coordinators."""
        req = pb.WatchJobRequest(job_id=job_id, after_seq=after_seq, min_interval=min_interval)
        with rpc_errors(self.address):
            yield from self.stub.WatchJobBatches(req)

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

    def logs(self, job_id: str, rank: int | None, follow: bool, tail: int, records: bool = False,
             from_attempt: int = 0) -> Iterator[pb.LogLine]:
        """What the ranks printed (``records``: rankctl's own record lines too, ``contract.files.logrecords``);
        ``from_attempt`` (with ``follow``): every attempt from that one on, each to its end."""
        req = pb.GetLogsRequest(job_id=job_id, rank=rank or 0, all_ranks=rank is None, follow=follow, tail=tail,
                                records=records, from_attempt=from_attempt)
        with rpc_errors(self.address):
            yield from self.stub.GetLogs(req)


class _Following:
    """A ClientService stub that takes each call to the leader (see ``Client``); ``route`` records each address
    tried and what it said ("connection refused", "standby, names LEADER", "answered")."""

    def __init__(self, client: Client, route: list[tuple[str, str]] | None = None) -> None:
        self._client = client
        self.route = [] if route is None else route

    def __getattr__(self, name: str):  # noqa: ANN204 - a grpc multicallable's stand-in
        streaming = name in STREAMING_CALLS

        def call(request, **kwargs):  # noqa: ANN001, ANN202
            if streaming:
                return self._stream(name, request, kwargs)
            return self._follow(lambda: getattr(self._client.raw_stub(), name)(request, **kwargs))
        return call

    def _stream(self, name: str, request, kwargs: dict) -> Iterator:  # noqa: ANN001
        """A server stream: followed until its first message (a failover later ends it as with one coordinator)."""
        it = self._follow(lambda: _started(getattr(self._client.raw_stub(), name)(request, **kwargs)))
        yield from it

    def _follow(self, attempt):  # noqa: ANN001, ANN202
        """``attempt()`` on the leader: a standby naming one moves there at once, a refused address is skipped at once
        (when every address refused, the call fails), else the next address; after a round of every address, again
        for ``NO_LEADER_WAIT_S``. A round that itself took half of that (a member that stood still through the call:
        SIGSTOP, a frozen host) earns one more wait: the others may lead by now (a submit caught in a stopped
        leader said "no coordinator leads" while the standby had led for 9 s)."""
        client, end = self._client, time.monotonic() + NO_LEADER_WAIT_S
        tried: dict[str, str] = {}
        began, extended = time.monotonic(), False
        while True:
            try:
                out = attempt()
                self.route.append((client.address, "answered"))
                return out
            except grpc.RpcError as exc:
                elsewhere = _elsewhere(exc, client.address, several=len(client.addresses) > 1)
                if elsewhere is None:
                    raise
                leader, tried[client.address] = elsewhere
                self.route.append((client.address, tried[client.address]))
                rest = [a for a in (leader, *client.addresses) if a and a not in tried]
                if rest:
                    client.switch(rest[0])
                    continue
                now = time.monotonic()
                if all(why == REFUSED for why in tried.values()):
                    raise   # nothing listens anywhere: no coordinator can answer this call
                if now > end:
                    if extended or now - began < NO_LEADER_WAIT_S / 2:
                        raise
                    extended, end = True, now + NO_LEADER_WAIT_S
                time.sleep(0.25)
                tried.clear()
                began = time.monotonic()


def _elsewhere(exc: grpc.RpcError, address: str, several: bool) -> tuple[str, str] | None:
    """For a call another coordinator may answer: (the leader a standby named or "", what ``address`` said); None
    for any other failure (a leader's answer, a store that refused a write, a lost connection with ``several``
    False: told as it is, as with one coordinator)."""
    if exc.code() is not grpc.StatusCode.UNAVAILABLE:
        return None
    metadata = dict(exc.trailing_metadata() or ())
    if LEADER_METADATA in metadata:   # a standby (coordinator.gate): it names the leader when it knows one
        leader = metadata[LEADER_METADATA]
        return leader, f"standby, names {leader}" if leader else f"standby: {(exc.details() or '')[:200]}"
    if _about_store(exc) or not several:
        return None
    return "", refused_now(address) or "unavailable"


REFUSED = "connection refused"


def _started(it: Iterator) -> Iterator:
    """``it`` with its first message already received (so that a refusal raises here), then the rest."""
    first = next(it, _END)

    def rest() -> Iterator:
        if first is not _END:
            yield first
            yield from it
    return rest()


_END = object()
STREAMING_CALLS = {"WatchJob", "WatchJobBatches", "GetLogs"}
NO_LEADER_WAIT_S = 8.0


@contextmanager
def rpc_errors(address: str) -> Iterator[None]:
    """Map gRPC failures to CtlError with the exit codes of ``ctl``."""
    try:
        yield
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code is grpc.StatusCode.UNAVAILABLE and _about_store(exc):
            raise CtlError(details, EXIT_JOB_FAILED) from None  # no coordinator can store it: the store's trouble
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise CtlError(f"lost the coordinator at {address}: {details}", EXIT_UNREACHABLE) from None
        if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
            raise CtlError(f"refused: {details}", EXIT_USAGE) from None
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
            raise CtlError(details, EXIT_USAGE) from None
        if code is grpc.StatusCode.UNIMPLEMENTED:
            raise Unimplemented(f"the coordinator at {address} does not implement this call: {details}", 1) from None
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise CtlError(f"the coordinator at {address} cannot take this now: {details}", 1) from None
        raise CtlError(f"coordinator at {address} answered {code.name}: {details}", 1) from None


def _about_store(exc: grpc.RpcError) -> bool:
    """An UNAVAILABLE that a coordinator answered because of its store (a write it could not store, or a
    standby with no leader because of the store): a clear refusal, not a lost coordinator."""
    details = exc.details() or ""
    return "the store " in details or "could not store" in details or (
        LEADER_METADATA in dict(exc.trailing_metadata() or ()))
