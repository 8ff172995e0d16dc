"""Acks paced (coordinator.acks): a restart's reports from every node at once are acknowledged at the fleet's
rate, not with one more message a node among the Assigns and first steps; each Ack carries the newest number
stored when it goes, and every node is acknowledged in the end."""

from __future__ import annotations

from pathlib import Path

from rankctl.coordinator.fleet.acks import ACK_BURST, ACK_EVERY_S, ACK_RATE_MIN
from test_core import make_world
from test_scale_core import batch, start


def acked(w, names: list[str]) -> dict[str, list[int]]:
    return {n: [a.last_seq for a in w.nodes[n].bodies("ack") if a.last_seq] for n in names}


def test_acks_go_out_at_the_fleet_rate_oldest_first_with_the_newest_number(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    nodes = ACK_BURST + 150                        # the burst, then more than the rate allows in 0.5 s
    job, names = start(w, nodes)
    for n in names:
        batch(w, job, n, "running")
    w.core.flush()
    first = acked(w, names)
    assert [n for n in names if first[n]] == names[:ACK_BURST]           # the burst, in the order stored
    assert all(first[n] == [8] for n in names[:ACK_BURST])
    batch(w, job, names[-1], "running", step=1)    # the last node's next report is stored before its Ack goes
    w.core.flush()
    assert sum(bool(v) for v in acked(w, names).values()) == ACK_BURST  # no time passed: no token
    w.clock.t += 0.5
    w.core.flush()                                  # nothing to store: the due Acks still go at their pace
    half = ACK_RATE_MIN * 0.5
    got = acked(w, names)
    assert [n for n in names if got[n]] == names[:ACK_BURST + int(half)]
    w.clock.t += 1.0
    w.core.flush()
    got = acked(w, names)
    assert all(got[n] for n in names) and got[names[-1]] == [16]         # the newest number stored when it went
    assert not w.core.pending_work()
    for n in names:                                 # acknowledged a moment ago: the next reports wait ACK_EVERY_S
        batch(w, job, n, "running", step=2)
    w.core.flush()
    assert acked(w, names) == got
    w.clock.t += ACK_EVERY_S
    batch(w, job, names[0], "running", step=3)
    w.core.flush()
    assert acked(w, names)[names[0]] == [8, 24]
    w.store.close()


def test_a_node_that_reconnected_is_not_acked_on_its_old_stream(tmp_path: Path) -> None:
    w = make_world(tmp_path)
    job, names = start(w, ACK_BURST + 1)
    for n in names:
        batch(w, job, n, "running")
    w.core.flush()
    last = names[-1]
    old = w.nodes[last].session
    assert old.ack_queued
    w.connect(last, slots=8)                         # the same daemon on a new stream: its Registered said what is stored
    sent_before = len(w.nodes[last].sent)
    w.clock.t += 1.0
    w.core.flush()
    assert not [m for m in w.nodes[last].sent[sent_before:] if m is not None and m.WhichOneof("body") == "ack"]
    assert not w.core.pending_work()
    w.store.close()
