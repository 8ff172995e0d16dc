"""A rank pins gloo and NCCL to the interface of its node's advertised address (``runtime.netif``), unless the
user's environment names one; a loopback node sets nothing, and a loopback store with remote peers fails at once.
Pure: the interface lookup against this machine's own table (``lo``, 127.0.0.1, ::1), the rules on a dict."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rankctl.contract.assignment import RankAssignment
from rankctl.runtime import netif
from rankctl.runtime.netif import IFNAME_VARS, _ipv6_interfaces, check_reachable, interface_of, pin_interface


def test_loopback_addresses_are_on_lo() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("localhost") == "lo" or interface_of("localhost") is None  # a name: its first address
    if Path(netif.IF_INET6).exists() and "lo" in Path(netif.IF_INET6).read_text():
        assert interface_of("::1") == interface_of("[::1]") == "lo"


def test_an_address_no_interface_holds_is_none() -> None:
    assert interface_of("198.51.100.7") is None  # TEST-NET-2
    assert interface_of("2001:db8::7") is None
    with pytest.raises(RuntimeError, match="cannot resolve 'no-such-host.invalid'"):
        interface_of("no-such-host.invalid")


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs the ip command to cross-check")
def test_every_ipv4_address_of_this_machine_maps_to_the_interface_ip_names() -> None:
    rows = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    seen = {}
    for row in rows.splitlines():
        name, address = row.split()[1], row.split()[3].split("/")[0]
        seen.setdefault(name, address)  # SIOCGIFADDR answers an interface's primary (first) address
    assert seen.get("lo") == "127.0.0.1"
    for name, address in seen.items():
        assert interface_of(address) == name, (name, address)


def test_the_ipv6_table_is_read_by_address_not_by_text(tmp_path: Path) -> None:
    table = tmp_path / "if_inet6"
    table.write_text("fd000000000000000000000000000002 04 40 00 82     eth3\n"
                     "00000000000000000000000000000001 01 80 10 80       lo\n")
    import ipaddress
    assert _ipv6_interfaces(ipaddress.IPv6Address("fd00::2"), str(table)) == ["eth3"]
    assert _ipv6_interfaces(ipaddress.IPv6Address("fd00::3"), str(table)) == []
    assert _ipv6_interfaces(ipaddress.IPv6Address("::1"), str(tmp_path / "absent")) == []


def test_a_loopback_node_sets_nothing() -> None:
    env: dict[str, str] = {}
    p = pin_interface("127.0.0.1", "127.0.0.1", env)
    assert env == {} and p.interface is None and "loopback" in p.why
    assert pin_interface("", "127.0.0.1", env).address == "127.0.0.1" and env == {}  # derived toward the store


@pytest.fixture
def eth7(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netif, "interface_of", lambda address: "eth7" if address == "10.9.0.4" else None)


def test_a_remote_node_pins_both_variables_to_its_interface(eth7) -> None:  # noqa: ANN001
    env: dict[str, str] = {"PATH": "/bin"}
    p = pin_interface("10.9.0.4", "10.9.0.3", env)
    assert env == {"PATH": "/bin", **{var: "eth7" for var in IFNAME_VARS}}
    assert p.interface == "eth7" and p.set_vars == IFNAME_VARS


def test_the_users_variables_win(eth7) -> None:  # noqa: ANN001
    env = {"GLOO_SOCKET_IFNAME": "ib0"}
    p = pin_interface("10.9.0.4", "10.9.0.3", env)
    assert env == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "eth7"} and p.set_vars == ("NCCL_SOCKET_IFNAME",)


def test_an_address_on_no_interface_sets_nothing(eth7) -> None:  # noqa: ANN001
    env: dict[str, str] = {}
    assert pin_interface("10.9.0.5", "10.9.0.3", env).why == "no interface holds the address" and env == {}


def test_a_loopback_store_with_a_remote_node_fails_naming_both_addresses() -> None:
    with pytest.raises(RuntimeError, match=r"store is on the loopback address 127\.0\.0\.1 .* node address is "
                                           r"10\.9\.0\.4: ranks on other nodes cannot reach it"):
        pin_interface("10.9.0.4", "127.0.0.1", {})
    check_reachable("10.9.0.3", "10.9.0.4")
    check_reachable("127.0.0.1", "127.0.0.1")


def test_the_assignment_carries_the_node_address_over_the_wire() -> None:
    import json

    from rankctl.kinds.spec import parse_spec

    a = RankAssignment(job_id="j-000000", attempt=1, rank=0, world_size=1, local_rank=0, node="n0", coords={},
                       groups={}, rendezvous="10.9.0.3:5000", backend="gloo", kind="train", node_address="10.9.0.4",
                       spec=parse_spec({"name": "j"}))
    assert json.loads(a.to_json())["node_address"] == "10.9.0.4"
    assert RankAssignment.from_doc(json.loads(a.to_json()), parse_spec) == a


def test_the_daemon_s_expansion_hands_each_rank_its_node_address() -> None:
    import json

    from rankctl.proto import rankctl_pb2 as pb
    from rankctl.worker.runs.assign import expand

    doc = {"name": "a", "kind": "comm-check", "resources": {"nodes": 2, "slots_per_node": 2}}
    msg = pb.Assign(job_id="a-000001", attempt=1, world_size=4, first_rank=2, rank_count=2,
                    rendezvous="10.9.0.3:5000", backend="gloo", kind="comm-check", spec_json=json.dumps(doc))
    ranks = expand(msg, "n1", "/tmp/run", 0, "10.9.0.4")
    assert [(a.rank, a.node_address) for a in ranks] == [(2, "10.9.0.4"), (3, "10.9.0.4")]
    assert {a.node_address for a in expand(msg, "n1", "/tmp/run", 0)} == {""}  # a daemon that passes none
