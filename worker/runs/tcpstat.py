"""Whether a rank's TCP data to a peer is being lost: the evidence that makes a cut link certain.

``unacked(pid)`` counts the process's TCP sockets (its ``/proc/PID/fd`` socket inodes, matched in
``/proc/PID/net/tcp`` and ``tcp6``: its own network namespace's view) that hold data the peer has not acknowledged
(``tx_queue`` > 0) while a retransmission or probe timer runs (``tr`` 1 or 4) and at least ``UNANSWERED`` of its
retransmissions (``retrnsmt``) or probes (the ``timeout`` column, ``icsk_probes_out``) went unanswered. A healthy
busy socket shows ``retrnsmt`` 0 and its probes answered; a cut link shows one or the other climbing (0.3 s, then
about 0.85 s, after the cut): which one depends on whether data was in flight when the route went.
"""

from __future__ import annotations

import os

UNANSWERED = 2   # retransmissions or probes unanswered in a row: the peer does not hear us


def _inodes(pid: int) -> set[bytes]:
    found: set[bytes] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1].encode())
    return found


def unacked(pid: int) -> int:
    """How many of ``pid``'s TCP sockets lose data to their peer (the module docstring); 0 when unreadable."""
    inodes = _inodes(pid)
    if not inodes:
        return 0
    lost = 0
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", "rb") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[9] not in inodes:
                continue
            tx = int(fields[4].split(b":")[0], 16)
            timer = int(fields[5].split(b":")[0], 16)
            if tx > 0 and timer in (1, 4) and max(int(fields[6], 16), int(fields[8])) >= UNANSWERED:
                lost += 1
    return lost
