"""A private CA and the certificates it issues: one directory per identity (ca.pem, cert.pem, key.pem).

EC P-256 keys, SHA-256 signatures. The identity is the subject: CN = name, OU = role, O = rankctl.
Leaf certificates both serve and connect (EKU serverAuth + clientAuth); their SANs are the names and
addresses clients dial. Keys are written 0600, directories made here 0700; a key is never overwritten.
"""

from __future__ import annotations

import ipaddress
import os
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rankctl.contract.names import node_name_problem, shown
from rankctl.security.identity import COORDINATOR, NODE, ROLES, Identity
from rankctl.security.revocation import CRL, RevocationError, record_issued, serials_of, write_crl

CA, CA_KEY = "ca.pem", "ca-key.pem"  # in the CA directory; every identity directory has a copy of ca.pem
CERT, KEY = "cert.pem", "key.pem"
COORDINATOR_DIR = "coordinator"
ORG = "rankctl"
DEFAULT_DAYS = 825  # the longest validity browsers accept for a leaf; CA and leaves alike here (docs/operations.md)
CLOCK_SKEW = timedelta(minutes=5)  # certificates start this far in the past: machines' clocks differ
LOOPBACK_SANS = ("localhost", "127.0.0.1", "::1")  # always on the coordinator's certificate
PEER_SAN = "rankctl-node"  # on every node certificate: nodes reach each other by address and check "a node of this CA"


class CertError(ValueError):
    """A certificate cannot be made, read or trusted; the message names the file or field and the rule."""


def init_ca(ca_dir: Path, sans: Iterable[str], days: int = DEFAULT_DAYS) -> Path:
    """Make a CA in ``ca_dir`` (ca.pem, ca-key.pem) and issue the coordinator's identity directory
    ``ca_dir/coordinator`` for ``sans`` plus loopback. Refuses when a CA key is already there."""
    ca_dir = Path(ca_dir)
    if (ca_dir / CA_KEY).exists():
        raise CertError(f"{ca_dir / CA_KEY} exists: {ca_dir} already holds a CA, and a key is never overwritten")
    _refuse_existing_key(ca_dir / COORDINATOR_DIR)
    _check_days(days)
    names = _sans([*sans, *LOOPBACK_SANS])
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rankctl CA"),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG)])
    start = _now() - CLOCK_SKEW
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _make_dir(ca_dir)
    _write(ca_dir / CA_KEY, _key_pem(key), private=True)
    _write(ca_dir / CA, cert.public_bytes(serialization.Encoding.PEM))
    coordinator = Identity(COORDINATOR, COORDINATOR)
    return _issue(ca_dir, ca_dir / COORDINATOR_DIR, coordinator, names, days, None)


def issue(ca_dir: Path, out_dir: Path, *, node: str | None = None, user: str | None = None,
          role: str | None = None, sans: Iterable[str] = (), days: int = DEFAULT_DAYS,
          not_before: datetime | None = None) -> Path:
    """Issue a node's or a user's identity directory ``out_dir`` from the CA in ``ca_dir``.

    Exactly one of ``node`` (role ``node``; SANs: its name, ``PEER_SAN`` and ``sans``) and ``user`` (``role`` one of
    ROLES). Valid from ``not_before`` (default: now) for ``days``, never past the CA's own end.
    """
    if (node is None) == (user is None):
        raise CertError("give exactly one of a node name and a user name")
    if node is not None:
        if role not in (None, NODE):
            raise CertError(f"node {shown(node)}: role {shown(role)} is for users; a node's role is {NODE!r}")
        identity, names = _identity(node, NODE), [node, PEER_SAN, *sans]
    else:
        if role is None:
            raise CertError(f"user {shown(user)} needs a role: one of {', '.join(ROLES)}")
        if role not in ROLES:
            raise CertError(f"user {shown(user)}: role {shown(role)} must be one of {', '.join(ROLES)}")
        identity, names = _identity(user, role), list(sans)
    _check_days(days)
    return _issue(Path(ca_dir), Path(out_dir), identity, _sans(names), days, not_before)


@lru_cache(maxsize=1024)
def identity_of_pem(cert_pem: bytes) -> Identity:
    """The identity a PEM certificate carries (CN = name, OU = role); CertError when it carries none."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise CertError(f"certificate: not a PEM certificate ({exc})") from None
    return _identity_of(cert)


def check_identity_files(ca_pem: bytes, cert_pem: bytes, key_pem: bytes, where: Path) -> Identity:
    """Check an identity directory's contents: ``cert.pem`` is signed by ``ca.pem``, ``key.pem`` is its
    key, it has not expired and it carries an identity. Errors name the file under ``where``."""
    ca = _load_cert(ca_pem, where / CA)
    cert = _load_cert(cert_pem, where / CERT)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise CertError(f"{where / KEY}: not an unencrypted PEM private key ({exc})") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise CertError(f"{where / CERT} is not signed by {where / CA} (its issuer is "
                        f"{shown(cert.issuer.rfc4514_string(), 80)}); issue it from the same CA") from None
    if _spki(key.public_key()) != _spki(cert.public_key()):
        raise CertError(f"{where / KEY} is not the key of {where / CERT}: issue the directory again")
    if _now() > cert.not_valid_after_utc:
        raise CertError(f"{where / CERT} expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; issue a new one")
    try:
        return _identity_of(cert)
    except CertError as exc:
        raise CertError(f"{where / CERT}: {exc}") from None


def _issue(ca_dir: Path, out_dir: Path, identity: Identity, sans: list[x509.GeneralName], days: int,
           not_before: datetime | None) -> Path:
    _refuse_existing_key(out_dir)
    if not_before is not None and not_before.tzinfo is None:
        raise CertError(f"not_before {not_before} must carry a time zone (e.g. datetime.now(timezone.utc))")
    ca_cert, ca_key = _load_ca(ca_dir)
    start = not_before or _now() - CLOCK_SKEW
    end = min(start + timedelta(days=days), ca_cert.not_valid_after_utc)
    if end <= start:
        raise CertError(f"the CA in {ca_dir} expired at {ca_cert.not_valid_after_utc:%Y-%m-%d}; make a new one")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.name),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_key_usage(digital_signature=True), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _make_dir(out_dir)
    _write(out_dir / KEY, _key_pem(key), private=True)
    _write(out_dir / CERT, cert.public_bytes(serialization.Encoding.PEM))
    _write(out_dir / CA, ca_cert.public_bytes(serialization.Encoding.PEM))
    record_issued(ca_dir, cert, identity.kind, identity.name, identity.role)
    return out_dir


def revoke(ca_dir: Path, *, node: str | None = None, user: str | None = None,
           serial: int | None = None) -> tuple[list[int], Path]:
    """Revoke every certificate the CA in ``ca_dir`` issued to ``node`` or ``user`` (its index), or one ``serial``:
    write the CA's CRL to ``ca_dir/crl.pem`` and ``ca_dir/coordinator/crl.pem``. Returns (the serials just revoked,
    the CRL's path); CertError naming the option when nothing matches."""
    ca_dir = Path(ca_dir)
    ca_cert, ca_key = _load_ca(ca_dir)
    try:
        serials = serials_of(ca_dir, node=node, user=user, serial=serial)
    except RevocationError as exc:
        raise CertError(str(exc)) from None
    write_crl(ca_dir, ca_cert, ca_key, serials, [ca_dir / COORDINATOR_DIR])
    return serials, ca_dir / CRL


def _identity(name: str, role: str) -> Identity:
    try:
        return Identity(name, role)
    except ValueError as exc:
        raise CertError(str(exc)) from None


def _identity_of(cert: x509.Certificate) -> Identity:
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    subject = shown(cert.subject.rfc4514_string(), 80)
    if len(cn) != 1 or len(ou) != 1:
        raise CertError(f"certificate subject {subject} must hold one CN (the name) and one OU (the role)")
    try:
        return Identity(cn[0].value, ou[0].value)
    except ValueError as exc:
        raise CertError(f"certificate subject {subject}: {exc}") from None


def _sans(values: Iterable[str]) -> list[x509.GeneralName]:
    """Each value as an IP address SAN when it is an IP literal, else a DNS name SAN; duplicates dropped."""
    out: list[x509.GeneralName] = []
    for value in values:
        try:
            name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(value))
        except ValueError:
            problem = node_name_problem(value.lower() if isinstance(value, str) else value, "SAN")
            if problem:
                raise CertError(f"{problem} (or be an IP address)") from None
            name = x509.DNSName(value.lower())
        if name not in out:
            out.append(name)
    return out


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    paths = ca_dir / CA, ca_dir / CA_KEY
    for path in paths:
        if not path.is_file():
            raise CertError(f"{path}: not found; `ctl certs init {ca_dir}` makes a CA there")
    cert = _load_cert(paths[0].read_bytes(), paths[0])
    try:
        key = serialization.load_pem_private_key(paths[1].read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise CertError(f"{paths[1]}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or _spki(key.public_key()) != _spki(cert.public_key()):
        raise CertError(f"{paths[1]} is not the key of {paths[0]}")
    return cert, key


def _load_cert(pem: bytes, path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise CertError(f"{path}: not a PEM certificate ({exc})") from None


def _refuse_existing_key(out_dir: Path) -> None:
    if (out_dir / KEY).exists():
        raise CertError(f"{out_dir / KEY} exists: a key is never overwritten (remove {out_dir} to issue it again)")


def _check_days(days: int) -> None:
    if not isinstance(days, int) or days < 1:
        raise CertError(f"days {shown(days)} must be a whole number of at least 1")


def _key_usage(**on: bool) -> x509.KeyUsage:
    names = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
             "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{n: on.get(n, False) for n in names})


def _spki(public_key) -> bytes:  # noqa: ANN001 - any cryptography public key
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _make_dir(path: Path) -> None:
    """Create ``path`` 0700 (an existing directory keeps its mode: the keys in it are 0600 anyway)."""
    if not path.is_dir():
        path.mkdir(parents=True, mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode passes through the umask


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write a file; a private one 0600 and only when it does not exist yet (O_EXCL: no race)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if private else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o600 if private else 0o644)
    except FileExistsError:
        raise CertError(f"{path} exists: a key is never overwritten") from None
    with os.fdopen(fd, "wb") as f:
        if private:
            os.fchmod(f.fileno(), 0o600)
        f.write(data)


def _now() -> datetime:
    return datetime.now(timezone.utc)
