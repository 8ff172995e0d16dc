"""A small synchronous etcd v3 client: the calls the coordinator's replicated store and its election make.

``StoreURL.parse("etcd://h1:2379,h2:2379/prefix")`` checks a ``--store`` value. ``Etcd`` holds one gRPC
channel per endpoint (etcd's own API, through aetcd's generated stubs) and fails over among them: a call
that finds its member unreachable is tried on the next one until ``timeout`` passes; then ``Unreachable``
names every endpoint. Calls block their thread, never the event loop's: the leader's store writer
(``coordinator.ha.replicator``), the lease keeper and the watcher have their own threads.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
from aetcd.rpc import rpc_pb2 as rpc
from aetcd.rpc import rpc_pb2_grpc as rpc_grpc

DEFAULT_PREFIX = "/rankctl"
CALL_TIMEOUT_S = 2.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
MAX_MESSAGE = 8 << 20
_ENDPOINT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class StoreURLError(ValueError):
    """A --store value that is not etcd://HOST:PORT[,HOST:PORT...][/prefix]."""


class Unreachable(Exception):
    """No etcd member answered within the deadline."""


@dataclass(frozen=True)
class StoreURL:
    endpoints: tuple[str, ...]
    prefix: str

    @classmethod
    def parse(cls, text: str) -> "StoreURL":
        rule = "it must be etcd://HOST:PORT[,HOST:PORT...][/prefix]"
        if not text.startswith("etcd://"):
            raise StoreURLError(f"--store {text!r}: {rule}")
        rest = text[len("etcd://"):]
        hosts, _, prefix = rest.partition("/")
        endpoints = tuple(h.strip() for h in hosts.split(",") if h.strip())
        bad = [e for e in endpoints if not _ENDPOINT.match(e) or not 0 < int(e.rsplit(":", 1)[1]) < 65536]
        if not endpoints or bad:
            raise StoreURLError(f"--store {text!r}: endpoint {bad[0] if bad else '(none)'!r} is not HOST:PORT; {rule}")
        prefix = "/" + prefix.strip("/") if prefix.strip("/") else DEFAULT_PREFIX
        if not re.fullmatch(r"[A-Za-z0-9_./-]+", prefix):
            raise StoreURLError(f"--store {text!r}: prefix {prefix!r} may hold letters, digits and _ . / - only")
        return cls(endpoints, prefix)

    def __str__(self) -> str:
        return f"etcd://{','.join(self.endpoints)}{self.prefix}"


@dataclass(frozen=True)
class EtcdTLS:
    """Client TLS to etcd: the CA that signed the members' certificates, and ours (both optional)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            self.ca.read_bytes(), self.key.read_bytes() if self.key else None,
            self.cert.read_bytes() if self.cert else None)


def prefix_end(key: bytes) -> bytes:
    """The range end that covers every key starting with ``key``."""
    return key[:-1] + bytes([key[-1] + 1])


class Etcd:
    """etcd's KV, Lease and Watch services over several endpoints; see the module docstring."""

    def __init__(self, url: StoreURL, tls: EtcdTLS | None = None, timeout: float = CALL_TIMEOUT_S) -> None:
        self.url, self.timeout = url, timeout
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
        creds = tls.credentials() if tls is not None else None
        self._channels = [grpc.secure_channel(e, creds, options=opts) if creds else grpc.insecure_channel(e, options=opts)
                          for e in url.endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self.calls = self.bytes_written = 0   # write transactions sent, and their bytes (the bench's figures)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def _call(self, make: Callable[[grpc.Channel], Any], request: Any, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout or self.timeout)
        problems: dict[str, str] = {}
        with self._lock:
            first = self._current
        tries = 0
        while True:
            idx = (first + tries) % len(self._channels)
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unreachable(self._unreachable(problems))
            try:
                out = make(self._channels[idx])(request, timeout=max(0.05, min(left, self.timeout)))
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                problems[self.url.endpoints[idx]] = f"{exc.code().name}: {exc.details() or ''}"
                tries += 1
                if tries % len(self._channels) == 0:
                    time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                continue
            with self._lock:
                self._current = idx
            return out

    def _unreachable(self, problems: dict[str, str]) -> str:
        """Why no member answered, true to what they did: a member that accepts connections but cannot commit
        (etcd's quorum lost) is not called unreachable, and members not tried before the deadline are asked
        whether they listen."""
        down, up = [], []
        for endpoint in self.url.endpoints:
            said = problems.get(endpoint)
            if said is None:   # not tried in time: does anything listen there at all?
                (up if _listens(endpoint) else down).append(endpoint)
            else:
                (down if said.startswith("UNAVAILABLE") and "connect" in said.lower() else up).append(endpoint)
        seen = "; ".join(f"{e}: {p[:120]}" for e, p in problems.items())
        if up and down and len(up) <= len(self.url.endpoints) // 2:
            return (f"the store {self.url} has lost its quorum: {len(down)} of {len(self.url.endpoints)} members "
                    f"are down ({', '.join(down)}); {', '.join(up)} accept(s) connections but cannot commit ({seen})")
        if up and down:   # a majority listens: the members may be electing a new leader after the loss
            return (f"the store {self.url} committed nothing in time: {len(down)} of {len(self.url.endpoints)} "
                    f"members are down ({', '.join(down)}); a majority ({', '.join(up)}) accepts connections and may "
                    f"still be electing a leader ({seen})")
        if up:
            return f"the store {self.url} does not answer in time: its members accept connections but no call " \
                   f"completes ({seen or 'no answer in time'})"
        return f"the store {self.url} is unreachable: no member accepts connections ({seen or 'no answer in time'})"

    # -- KV --------------------------------------------------------------------------------------
    def txn(self, req: rpc.TxnRequest, timeout: float | None = None) -> rpc.TxnResponse:
        self.calls += 1
        self.bytes_written += req.ByteSize()
        return self._call(lambda ch: rpc_grpc.KVStub(ch).Txn, req, timeout)

    def range(self, key: bytes, end: bytes = b"", *, revision: int = 0, limit: int = 0, keys_only: bool = False,
              timeout: float | None = None) -> rpc.RangeResponse:
        req = rpc.RangeRequest(key=key, range_end=end, revision=revision, limit=limit, keys_only=keys_only,
                               sort_order=rpc.RangeRequest.ASCEND, sort_target=rpc.RangeRequest.KEY)
        return self._call(lambda ch: rpc_grpc.KVStub(ch).Range, req, timeout)

    def get(self, key: bytes, timeout: float | None = None) -> Any:
        kvs = self.range(key, timeout=timeout).kvs
        return kvs[0] if kvs else None

    def scan(self, key: bytes, end: bytes, *, revision: int = 0, page: int = 256) -> Iterator[Any]:
        """Every key in [key, end) at one revision, page by page."""
        start = key
        while True:
            resp = self.range(start, end, revision=revision, limit=page)
            yield from resp.kvs
            if not resp.more or not resp.kvs:
                return
            start = resp.kvs[-1].key + b"\0"

    def compact(self, revision: int) -> None:
        self._call(lambda ch: rpc_grpc.KVStub(ch).Compact, rpc.CompactionRequest(revision=revision))

    # -- leases ----------------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        return self._call(lambda ch: rpc_grpc.LeaseStub(ch).LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl)).ID

    def keepalive(self, lease: int) -> int:
        """Renew ``lease`` once; its remaining TTL (0: it is gone)."""
        def once(ch: grpc.Channel) -> Callable[..., Any]:
            def call(req: Any, timeout: float) -> Any:
                for resp in rpc_grpc.LeaseStub(ch).LeaseKeepAlive(iter([req]), timeout=timeout):
                    return resp
                raise grpc.RpcError("keepalive stream ended")  # pragma: no cover - etcd always answers
            return call
        return self._call(once, rpc.LeaseKeepAliveRequest(ID=lease)).TTL

    def revoke(self, lease: int, timeout: float | None = None) -> None:
        try:
            self._call(lambda ch: rpc_grpc.LeaseStub(ch).LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease), timeout)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                raise

    # -- watch -----------------------------------------------------------------------------------
    def watch(self, key: bytes, end: bytes, start_revision: int, stop: threading.Event) -> Iterator[Any]:
        """Watch responses for [key, end) from ``start_revision`` on the current endpoint until ``stop`` is set
        (the caller cancels the returned call through ``stop``) or the stream breaks (grpc.RpcError)."""
        req = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(key=key, range_end=end,
                                                                      start_revision=start_revision))
        with self._lock:
            ch = self._channels[self._current]

        def requests() -> Iterator[Any]:
            yield req
            stop.wait()

        call = rpc_grpc.WatchStub(ch).Watch(requests())
        canceller = threading.Thread(target=lambda: (stop.wait(), call.cancel()), daemon=True)
        canceller.start()
        try:
            yield from call
        finally:
            call.cancel()

    def next_endpoint(self) -> None:
        with self._lock:
            self._current = (self._current + 1) % len(self._channels)


def _listens(endpoint: str, timeout: float = 0.2) -> bool:
    """Whether a TCP connection to ``endpoint`` (HOST:PORT) is accepted within ``timeout``."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False
