"""The rendezvous ports a daemon offers: outside the kernel's ephemeral range (where any outgoing connection may
take one before rank 0 binds it), the last offer kept while its ports stay free."""

from __future__ import annotations

import random
import socket

from rankctl.worker.uplink.reporting import ephemeral_range, free_ports, port_candidates


def test_candidates_lie_outside_the_ephemeral_range_in_the_wider_gap() -> None:
    assert port_candidates(32768, 60999) == range(20000, 32768)
    assert port_candidates(20500, 40000) == range(40001, 65536)


def test_the_kernels_range_is_read_and_a_missing_file_is_linuxs_default(tmp_path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(str(f)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "nope")) == (32768, 60999)


def test_offered_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    ports = free_ports("127.0.0.1", 8, rng=random.Random(1))
    assert len(ports) == len(set(ports)) == 8
    assert all(not low <= p <= high for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_the_last_offer_is_kept_but_a_port_taken_meanwhile_is_replaced() -> None:
    first = free_ports("127.0.0.1", 4, rng=random.Random(2))
    with socket.socket() as held:
        held.bind(("127.0.0.1", first[0]))
        held.listen()
        again = free_ports("127.0.0.1", 4, first, rng=random.Random(3))
    assert again[:3] == first[1:] and first[0] not in again and len(again) == 4


def test_a_range_leaving_no_gap_falls_back_to_the_ports_the_os_hands_out() -> None:
    ports = free_ports("127.0.0.1", 3, low_high=(20000, 65535))
    assert len(ports) == 3 and all(p > 0 for p in ports)
