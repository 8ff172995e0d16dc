"""The signature on what a relay head carries (``coordinator.scheduling.relay``, ``worker.uplink.relay``): HMAC-SHA256 under the
node's session key (``Registered.relay_key``) of the direction (``DOWN``: a message for the node; ``UP``: a report
batch of the node), the node's name, the item's number and its bytes. A relay tree's head holds only its own key:
it can carry an item, never make or alter one for or of another node, nor turn one direction's into the other's.
"""

from __future__ import annotations

import hashlib
import hmac

DOWN, UP = b"down", b"up"


def relay_mac(key: bytes, direction: bytes, node: str, seq: int, *parts: bytes) -> bytes:
    mac = hmac.new(key, b"%s\0%s\0%d" % (direction, node.encode(), seq), hashlib.sha256)
    for part in parts:   # each with its length: no two splits of the same bytes sign alike
        mac.update(b"\0%d\0" % len(part))
        mac.update(part)
    return mac.digest()


def relay_mac_ok(key: bytes, direction: bytes, node: str, seq: int, mac: bytes, *parts: bytes) -> bool:
    return bool(key) and hmac.compare_digest(relay_mac(key, direction, node, seq, *parts), mac)
