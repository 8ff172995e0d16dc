"""``ctl`` with several coordinators follows the leader (``cli.client._Following``), also through a member that stood
still during the call: a submit caught in a SIGSTOPped leader woke 12 s later, heard "no coordinator leads" from it
and gave up, while the standby had led for 9 s (an outside probe)."""

from __future__ import annotations

import grpc
import pytest

from rankctl.cli import client as client_mod
from rankctl.cli.client import NO_LEADER_WAIT_S, _Following


class Refused(grpc.RpcError):
    def __init__(self, leader: str = "") -> None:
        self.leader = leader

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def trailing_metadata(self) -> tuple:
        return ((client_mod.LEADER_METADATA, self.leader),)   # a standby always sends it: "" when none leads

    def details(self) -> str:
        return "a standby"


class Members:
    """Two coordinators: ``a`` stands still for ``stall`` seconds on the first call, then refuses (deposed); ``b``
    leads once ``b_leads_at`` has passed (a standby before: it refuses naming ``a``). The call starts at ``b``."""

    def __init__(self, clock: list[float], stall: float, b_leads_at: float) -> None:
        self.addresses, self.address = ["a:1", "b:1"], "b:1"
        self.clock, self.stall, self.b_leads_at, self.calls = clock, stall, b_leads_at, []

    def switch(self, address: str) -> None:
        self.address = address

    def call(self) -> str:
        self.calls.append((self.address, round(self.clock[0], 2)))
        if self.address == "a:1":
            if sum(1 for a, _ in self.calls if a == "a:1") == 1:
                self.clock[0] += self.stall
            raise Refused()
        if self.clock[0] < self.b_leads_at:
            raise Refused(leader="a:1")
        return "submitted"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(client_mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    return now


def test_a_leader_that_stood_still_through_the_call_is_not_the_last_word(clock: list[float]) -> None:
    members = Members(clock, stall=12.0, b_leads_at=103.0)
    assert _Following(members)._follow(members.call) == "submitted"
    assert members.calls[:2] == [("b:1", 100.0), ("a:1", 100.0)] and members.calls[-1][0] == "b:1"


def test_with_no_leader_at_all_it_still_gives_up(clock: list[float]) -> None:
    members = Members(clock, stall=12.0, b_leads_at=1e9)
    with pytest.raises(Refused):
        _Following(members)._follow(members.call)
    assert clock[0] - 100.0 < 12.0 + 2 * NO_LEADER_WAIT_S + 1       # one more wait, not for ever
    quick = Members(clock, stall=0.0, b_leads_at=1e9)                # refusals only: no more than the wait
    began = clock[0]
    with pytest.raises(Refused):
        _Following(quick)._follow(quick.call)
    assert clock[0] - began < NO_LEADER_WAIT_S + 1
