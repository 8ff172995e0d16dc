"""Collectives on the node's advertised address: the interface that holds it pins gloo and NCCL.

Without ``GLOO_SOCKET_IFNAME`` gloo binds to whatever the host name resolves to, and a host whose name maps to
127.0.0.1 (common, and the default in many containers) then advertises loopback to its remote peers, which
never pass rendezvous. So before the default group (or a script's ``init_process_group``) each rank sets
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the interface holding its node's advertised address,
unless the user's environment already names one. A loopback node address (one machine) sets nothing. The
lookup is stdlib only: ``if_nameindex`` and ``SIOCGIFADDR`` for IPv4, ``/proc/net/if_inet6`` for IPv6.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import MutableMapping
from dataclasses import dataclass

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SIOCGIFADDR = 0x8915
IF_INET6 = "/proc/net/if_inet6"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, kw_only=True)
class Pinning:
    """What a rank did about its collectives' interface: the variables it set, and why (for the rank's log)."""
    address: str                # the node address the interface was looked up for ("" when none is known)
    interface: str | None       # the interface that holds it, None when nothing was pinned
    set_vars: tuple[str, ...]   # the variables this rank set (the others were the user's)
    why: str


def resolve(host: str) -> IPAddress:
    """``host`` (an address, bracketed IPv6, or a name: its first address) as an IP address."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror as exc:
        raise RuntimeError(f"cannot resolve {host!r}: {exc.strerror}") from None


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            out = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return ipaddress.IPv4Address(out[20:24])


def _ipv6_interfaces(address: ipaddress.IPv6Address, table: str = IF_INET6) -> list[str]:
    """Interfaces that hold ``address``, from the kernel's table (address, index, prefix, scope, flags, name)."""
    try:
        with open(table) as f:
            rows = [line.split() for line in f]
    except OSError:  # no IPv6 here
        return []
    return [row[5] for row in rows if len(row) >= 6 and ipaddress.IPv6Address(int(row[0], 16)) == address]


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` (IPv4: its primary address), None when none does."""
    ip = resolve(address)
    if ip.version == 6:
        found = _ipv6_interfaces(ip)
        return found[0] if found else None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == ip:
            return name
    return None


def source_address(host: str) -> str:
    """The local address this machine would use to reach ``host`` (a UDP connect: nothing is sent)."""
    ip = resolve(host)
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((str(ip), 9))
        return s.getsockname()[0]


def check_reachable(rendezvous_host: str, node_address: str) -> None:
    """A store on loopback while this rank's node is not (its peers are remote) can never be reached: say so now."""
    if resolve(rendezvous_host).is_loopback and not resolve(node_address).is_loopback:
        raise RuntimeError(
            f"the rendezvous store is on the loopback address {rendezvous_host} but this rank's node address is "
            f"{node_address}: ranks on other nodes cannot reach it (rank 0's node must advertise an address its "
            "peers can reach: ctl worker --advertise-address)")


def pin_interface(node_address: str, rendezvous_host: str, environ: MutableMapping[str, str]) -> Pinning:
    """Set ``IFNAME_VARS`` in ``environ`` to the interface of ``node_address`` unless already set.

    ``node_address`` empty (a daemon that does not pass it): the local address toward the rendezvous host.
    """
    if node_address:
        check_reachable(rendezvous_host, node_address)
    else:
        try:
            node_address = source_address(rendezvous_host)
        except (OSError, RuntimeError) as exc:
            return Pinning(address="", interface=None, set_vars=(), why=f"no route to the rendezvous host: {exc}")
    if resolve(node_address).is_loopback:
        return Pinning(address=node_address, interface=None, set_vars=(), why="loopback: one machine")
    interface = interface_of(node_address)
    if interface is None:
        return Pinning(address=node_address, interface=None, set_vars=(), why="no interface holds the address")
    todo = tuple(var for var in IFNAME_VARS if var not in environ)
    for var in todo:
        environ[var] = interface
    return Pinning(address=node_address, interface=interface, set_vars=todo,
                   why="pinned" if todo else "the environment names the interfaces already")
