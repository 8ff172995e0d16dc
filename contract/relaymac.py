"""The signature on a relayed message (``coordinator.relay``, ``worker.relay``): HMAC-SHA256 under the node's
session key (``Registered.relay_key``) of the node's name, the item's number and the message's bytes. A relay
tree's head holds only its own key: it can forward an item, never make or alter one for another node.
"""

from __future__ import annotations

import hashlib
import hmac


def relay_mac(key: bytes, node: str, seq: int, message: bytes) -> bytes:
    return hmac.new(key, b"%s\0%d\0%s" % (node.encode(), seq, message), hashlib.sha256).digest()


def relay_mac_ok(key: bytes, node: str, seq: int, message: bytes, mac: bytes) -> bool:
    return bool(key) and hmac.compare_digest(relay_mac(key, node, seq, message), mac)
