"""gRPC mTLS from an identity directory (ca.pem, cert.pem, key.pem), and who the peer of a call is.

Both sides present a certificate signed by the one CA and check the other's. A server learns the
caller's identity from the handshake (``peer_identity``), never from anything the caller sends.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

from rankctl.security.certs import CA, CERT, KEY, CertError, check_identity_files, identity_of_pem
from rankctl.security.identity import Identity
from rankctl.security.revocation import CRL, Revocations, serial_of_pem

PEER_CERT_KEY = "x509_pem_cert"  # gRPC's auth-context property: the peer's certificate, when it sent one


@dataclass(frozen=True)
class IdentityDir:
    path: Path
    ca: bytes
    cert: bytes
    key: bytes
    identity: Identity
    revocations: Revocations | None = None  # the CA's CRL as ``crl.pem`` in this directory (absent: none revoked)


def load_identity_dir(d: str | Path) -> IdentityDir:
    """Read and check an identity directory: all three files there, the key private to its owner,
    the certificate signed by ca.pem, matching the key, not expired, carrying an identity."""
    path = Path(d)
    ca, cert, key = (_read(path / name) for name in (CA, CERT, KEY))
    mode = stat.S_IMODE(os.stat(path / KEY).st_mode)
    if mode & 0o077:
        raise CertError(f"{path / KEY} has mode {mode:04o}; it must be 0600 (chmod 600 {path / KEY})")
    identity = check_identity_files(ca, cert, key, path)
    revocations = Revocations(path / CRL, x509.load_pem_x509_certificate(ca))
    revocations.refresh()  # a bad crl.pem is logged at start, not at the first call
    return IdentityDir(path=path, ca=ca, cert=cert, key=key, identity=identity, revocations=revocations)


def server_credentials(idd: IdentityDir) -> grpc.ServerCredentials:
    """Serve with this identity; every client must present a certificate from the same CA."""
    return grpc.ssl_server_credentials([(idd.key, idd.cert)], root_certificates=idd.ca, require_client_auth=True)


def https_server_context(idd: IdentityDir) -> ssl.SSLContext:
    """HTTPS (the dashboard, /metrics) with this service's certificate; clients must present a certificate of
    the same CA, as on the gRPC port."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(idd.path / CERT, idd.path / KEY)
    ctx.load_verify_locations(cadata=idd.ca.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def split_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ValueError when it is not one."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{listen!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def channel_credentials(idd: IdentityDir) -> grpc.ChannelCredentials:
    """Connect with this identity; the server's certificate must come from the same CA and name its address."""
    return grpc.ssl_channel_credentials(root_certificates=idd.ca, private_key=idd.key, certificate_chain=idd.cert)


def peer_identity(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> Identity | None:
    """The caller's identity from its mTLS certificate (sync or aio context); None on a plain-text call.

    The certificate was verified against the CA in the handshake; CertError when it carries no identity.
    """
    pem = peer_pem(context)
    return identity_of_pem(pem) if pem else None


def peer_pem(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> bytes | None:
    """The caller's certificate (PEM) from the handshake; None on a plain-text call."""
    pems = context.auth_context().get(PEER_CERT_KEY)
    return pems[0] if pems else None


def revoked_problem(revocations: Revocations | None, cert_pem: bytes | None, who: object) -> str | None:
    """Why a caller presenting ``cert_pem`` is refused because its certificate is on the CA's CRL (None: it is
    not, or there is no list to check)."""
    if revocations is None or cert_pem is None:
        return None
    serial = serial_of_pem(cert_pem)
    if revocations.revoked(serial):
        return f"the certificate of {who} (serial {serial}) is revoked: it is on the CA's revocation list"
    return None


def is_loopback(listen_or_address: str) -> bool:
    """Whether a listen address or target stays on this machine: ``127.0.0.1:7420``, ``[::1]:0``,
    ``localhost:1``, a ``unix:`` socket. ``0.0.0.0:7420``, ``[::]:1``, ``:7420`` or any other host is not."""
    text = listen_or_address.strip()
    if text.startswith(("unix:", "unix-abstract:")):
        return True
    if text.startswith("["):
        host = text[1:text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:
        host = text.split(":", 1)[0]
    else:
        host = text  # no port, or a bare IPv6 address
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CertError(f"{path}: not found; an identity directory holds {CA}, {CERT} and {KEY} "
                        "(`ctl certs issue` writes one)") from None
    except OSError as exc:
        raise CertError(f"{path}: cannot read it ({exc.strerror})") from None
