"""Channels from this daemon to other nodes' PeerService (checkpoint and snapshot replication).

A push round goes to the same replica peer every few steps; ``PeerChannels`` keeps one channel per peer for
those rounds instead of a TCP (and, with mutual TLS, a TLS) handshake each. A channel whose call failed is
closed and forgotten, so the next round dials afresh rather than wait out gRPC's reconnect backoff behind a
peer that restarted; at most ``MAX_CHANNELS`` are kept, the least recently used idle one closed first.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Container

import grpc

PEER_NAME = "rankctl-node"  # security.certs.PEER_SAN: on every node certificate; peers check "a node of this CA"
MAX_CHANNELS = 8            # a node pushes to one peer a job: a few at most


def peer_channel(peer: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    """A channel to another node's PeerService: mutual TLS with this node's certificate when
    ``credentials`` (the peer is checked as a node of the same CA), plain text otherwise."""
    if credentials is None:
        return grpc.aio.insecure_channel(peer)
    return grpc.aio.secure_channel(peer, credentials, options=(("grpc.ssl_target_name_override", PEER_NAME),))


class PeerChannels:
    """One open channel per peer, reused across push rounds (one event loop: the daemon's)."""

    def __init__(self, credentials: grpc.ChannelCredentials | None) -> None:
        self.credentials = credentials
        self._open: OrderedDict[str, grpc.aio.Channel] = OrderedDict()   # least recently used first

    def get(self, peer: str, busy: Container[str] = ()) -> grpc.aio.Channel:
        """The channel to ``peer`` (opened now if there is none); an idle one past ``MAX_CHANNELS`` (a peer not
        in ``busy``) is closed."""
        channel = self._open.pop(peer, None) or peer_channel(peer, self.credentials)
        self._open[peer] = channel
        for old in [p for p in self._open if p != peer and p not in busy][:max(0, len(self._open) - MAX_CHANNELS)]:
            self._close_soon(self._open.pop(old))
        return channel

    def forget(self, peer: str) -> None:
        """A call to ``peer`` failed: close its channel; the next round dials afresh."""
        channel = self._open.pop(peer, None)
        if channel is not None:
            self._close_soon(channel)

    async def close(self) -> None:
        channels, self._open = list(self._open.values()), OrderedDict()
        for channel in channels:
            await channel.close()

    def __len__(self) -> int:
        return len(self._open)

    @staticmethod
    def _close_soon(channel: grpc.aio.Channel) -> None:
        asyncio.get_running_loop().create_task(channel.close())
