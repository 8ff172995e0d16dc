"""The coordinator's gRPC server options: exclusive binding, message bounds, and HTTP/2 pings both ways.

Daemons ping the coordinator (``worker.uplink.session.KEEPALIVE``) to find one that stopped answering; the coordinator pings
every connection (``keepalive_options``) to find a daemon that did, within the heartbeat timeout, however seldom a
big fleet is asked to heartbeat (``sessions.beat_interval``). Pings are answered in gRPC's C core: no Python runs for
them on either side.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 16 << 20
# grpc enables SO_REUSEPORT by default: a second coordinator on a used address would start
# silently and split the clients between the two. Bind exclusively instead.
SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),
    # daemons ping every 2 s to find a stopped coordinator (SIGSTOP, a frozen host): let them
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


def base_heartbeat_interval(heartbeat_timeout: float) -> float:
    """Four heartbeats per timeout, at most one every 2 s: a small fleet's interval, and the coordinator's ping pace."""
    return min(2.0, heartbeat_timeout / 4)


def keepalive_options(heartbeat_timeout: float) -> tuple[tuple[str, int], ...]:
    """HTTP/2 pings to every connection, answered in gRPC's C core: a daemon stopped or cut off loses its stream
    within the heartbeat timeout even when a big fleet's heartbeats come seldom (``sessions.beat_interval``)."""
    every = max(1.0, base_heartbeat_interval(heartbeat_timeout))
    every_ms, wait_ms = int(every * 1000), int(max(1.0, heartbeat_timeout - every) * 1000)
    return (("grpc.keepalive_time_ms", every_ms), ("grpc.keepalive_timeout_ms", wait_ms),
            ("grpc.http2.ping_timeout_ms", wait_ms),   # what ends an unanswered ping in the gRPC we pin
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging a stream that carries nothing between beats
            ("grpc.http2.min_sent_ping_interval_without_data_ms", every_ms))
