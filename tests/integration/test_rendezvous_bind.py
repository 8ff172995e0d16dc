"""Rank 0's rendezvous store listens on the rendezvous address only (the node's advertised address), not on
every interface. Linux routes all of 127.0.0.0/8 to loopback: a listener reachable on 127.0.0.1 but not on
127.0.0.2 is bound to 127.0.0.1 alone."""

from __future__ import annotations

import contextlib
import socket
import threading
from datetime import timedelta
from typing import Iterator

import pytest
import torch.distributed as dist

from rankctl.contract.assignment import RankAssignment
from rankctl.kinds.spec import parse_spec
from rankctl.runtime import rendezvous
from rankctl.runtime.rendezvous import await_listener, listen_on, open_store

# the store's server thread stays in this process: run after the tests that fork ranks (tests/conftest.py)
pytestmark = pytest.mark.grpc_in_process


def reachable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


@pytest.fixture(scope="module")
def loopback_aliases() -> None:
    with socket.socket() as wild:
        wild.bind(("0.0.0.0", 0))
        wild.listen()
        if not reachable("127.0.0.2", wild.getsockname()[1]):
            pytest.skip("127.0.0.2 is not a loopback address here")


def assignment(host: str, port: int, rank: int = 0) -> RankAssignment:
    return RankAssignment(job_id="j-000000", attempt=1, rank=rank, world_size=1, local_rank=0, node="n0",
                          coords={}, groups={}, rendezvous=f"{host}:{port}", backend="gloo", kind="train",
                          spec=parse_spec({"name": "j"}))


@pytest.mark.parametrize(("host", "other"), [("127.0.0.1", "127.0.0.2"), ("127.0.0.2", "127.0.0.1")])
def test_the_listener_takes_the_rendezvous_host_only(loopback_aliases, host: str, other: str) -> None:
    with listen_on(host, 0) as sock:
        bound, port = sock.getsockname()
        assert bound == host and reachable(host, port) and not reachable(other, port)


def test_a_host_that_is_not_this_machines_is_an_error_not_a_wider_bind() -> None:
    with pytest.raises(RuntimeError, match=r"192\.0\.2\.1:\d+: .*--advertise-address must be an address of this host"):
        listen_on("192.0.2.1", 0)  # TEST-NET-1: on no interface
    with pytest.raises(RuntimeError, match="cannot resolve the rendezvous host 'no-such-host.invalid'"):
        listen_on("no-such-host.invalid", 0)


def test_rank_0_hosts_the_store_on_the_rendezvous_address_and_ranks_reach_it(loopback_aliases) -> None:
    with listen_on("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]  # free now; the store binds it again (SO_REUSEADDR, as torch does)
    store = open_store(assignment("127.0.0.1", port), timedelta(seconds=10))
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        store.set("k", "v")
        assert client.get("k") == b"v" and store.port == port
        assert not reachable("127.0.0.2", port)
        with pytest.raises(RuntimeError, match="cannot host the rendezvous store on 127.0.0.1"):
            open_store(assignment("127.0.0.1", port), timedelta(seconds=1))  # the port is taken: said so
    finally:
        del store


class ProbeClock:
    """``await_listener``'s clock made of its own pauses (``time.sleep`` advances ``time.monotonic``, without
    waiting), with its connection attempts counted: how long it waits is counted, not timed."""

    def __init__(self) -> None:
        self.now, self.slept, self.tries = 0.0, [], 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    @contextlib.contextmanager
    def installed(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        connect = socket.create_connection

        def counted(*args, **kwargs) -> socket.socket:  # noqa: ANN002, ANN003 - socket.create_connection's
            self.tries += 1
            return connect(*args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(rendezvous, "time", self)
            m.setattr(rendezvous.socket, "create_connection", counted)
            yield


def test_a_rank_that_starts_before_rank_0_reaches_the_store_it_opens_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client rank started before rank 0 waits for the listener itself (torch's own client backs off for up to
    about a second between tries) and then reaches the store; with nothing listening it returns at its timeout
    and leaves the error to the store."""
    with listen_on("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
    opened: list = []
    late = threading.Timer(0.05, lambda: opened.append(open_store(assignment("127.0.0.1", port), timedelta(seconds=10))))
    late.start()
    try:
        client = open_store(assignment("127.0.0.1", port, rank=1), timedelta(seconds=10))
        late.join()
        opened[0].set("k", "v")
        assert client.get("k") == b"v"
    finally:
        late.join()
        opened.clear()
    clock = ProbeClock()
    with clock.installed(monkeypatch):
        await_listener("127.0.0.1", port, 0.2)  # closed now: returns, no error of its own
    # it waited out its timeout, probing every 5 ms: each refused try but the last followed by a 5 ms pause
    assert clock.slept == [0.005] * (clock.tries - 1), (clock.tries, clock.slept)
    assert 0.195 - 1e-9 <= clock.now <= 0.2 + 1e-9, clock.now
    clock = ProbeClock()
    with clock.installed(monkeypatch):
        await_listener("no-such-host.invalid", port, 30)  # unresolvable: returns at once for the store to name it
    assert clock.tries == 1 and clock.slept == [], (clock.tries, clock.slept)
