"""Revoking certificates: the CA's index of what it issued, its X.509 CRL, and a reloading check.

``ctl certs issue`` (and ``init``) append each certificate to ``CA_DIR/issued.jsonl`` (serial, kind, name, role,
expiry); ``revoke`` turns an identity or a serial into serials, adds them to the CA's CRL (a real X.509 CRL signed
by the CA key: ``openssl crl -in crl.pem -text`` reads it) and writes it as ``crl.pem`` in CA_DIR and in the
coordinator's identity directory. A service finds the list as ``crl.pem`` in its own identity directory;
``Revocations`` re-reads it when its size or mtime changes (one stat at most once a second, never a parse per call)
and keeps the last good list when a new file does not verify.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from pathlib import Path
from typing import Callable

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from rankctl.contract.names import shown

log = structlog.get_logger("rankctl.security")
CRL = "crl.pem"          # in CA_DIR, in the coordinator's identity directory, and wherever an operator copies it
INDEX = "issued.jsonl"   # in CA_DIR: one JSON object a line per certificate issued
CRL_DAYS = 3650          # next_update of the list; services check revocation by serial, not by freshness
RECHECK_S = 1.0          # the file is stat'ed at most this often


class RevocationError(ValueError):
    """A revocation cannot be made; the message names the option, the value and the rule."""


def record_issued(ca_dir: Path, cert: x509.Certificate, kind: str, name: str, role: str) -> None:
    """Append one issued certificate to the CA's index (so ``--node``/``--user`` can find every serial)."""
    line = {"serial": cert.serial_number, "kind": kind, "name": name, "role": role,
            "not_after": cert.not_valid_after_utc.isoformat()}
    with open(Path(ca_dir) / INDEX, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


def issued(ca_dir: Path) -> list[dict]:
    """The CA's index, oldest first (empty when nothing was recorded)."""
    path = Path(ca_dir) / INDEX
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def serials_of(ca_dir: Path, *, node: str | None = None, user: str | None = None,
               serial: int | None = None) -> list[int]:
    """The serials one of ``node``, ``user`` or ``serial`` names; RevocationError when none or several are given or
    the CA issued nothing under that name."""
    given = [(k, v) for k, v in (("--node", node), ("--user", user), ("--serial", serial)) if v is not None]
    if len(given) != 1:
        raise RevocationError("give exactly one of --node NAME, --user NAME and --serial N")
    what, value = given[0]
    index = issued(ca_dir)
    if what == "--serial":
        if not isinstance(serial, int) or serial < 1:
            raise RevocationError(f"--serial {shown(serial)} must be a certificate serial (a positive integer)")
        return [serial]
    kind = "node" if what == "--node" else "user"
    found = [row["serial"] for row in index if row.get("kind") == kind and row.get("name") == value]
    if not found:
        raise RevocationError(f"{what} {shown(value)}: {Path(ca_dir) / INDEX} lists no {kind} certificate of that "
                              "name (certificates issued before the index existed: revoke them with --serial)")
    return found


def write_crl(ca_dir: Path, cert: x509.Certificate, key, serials: list[int],  # noqa: ANN001 - the CA's EC key
              targets: list[Path]) -> list[int]:
    """Add ``serials`` to the CA's CRL (CA_DIR/crl.pem), sign it and write it to CA_DIR and each of ``targets``
    (atomically: a reader sees the old list or the new one). Returns every serial the list now holds."""
    now = datetime.now(timezone.utc)
    revoked = dict(_entries(Path(ca_dir) / CRL, cert))
    for serial in serials:
        revoked.setdefault(serial, now)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(cert.subject)
               .last_update(now - timedelta(minutes=5)).next_update(now + timedelta(days=CRL_DAYS)))
    for serial, when in sorted(revoked.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    pem = builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    for directory in [Path(ca_dir), *targets]:
        if directory.is_dir():
            _replace(directory / CRL, pem)
    return sorted(revoked)


def _entries(path: Path, ca: x509.Certificate) -> list[tuple[int, datetime]]:
    if not path.is_file():
        return []
    crl = load_crl(path.read_bytes(), ca, path)
    return [(r.serial_number, r.revocation_date_utc) for r in crl]


def load_crl(pem: bytes, ca: x509.Certificate, path: Path) -> x509.CertificateRevocationList:
    """Parse a PEM CRL and check that ``ca`` signed it; ValueError naming ``path`` otherwise."""
    try:
        crl = x509.load_pem_x509_crl(pem)
    except ValueError as exc:
        raise ValueError(f"{path}: not a PEM CRL ({exc})") from None
    if crl.issuer != ca.subject or not crl.is_signature_valid(ca.public_key()):
        raise ValueError(f"{path}: not signed by this CA ({shown(ca.subject.rfc4514_string(), 80)})")
    return crl


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@lru_cache(maxsize=4096)
def serial_of_pem(cert_pem: bytes) -> int:
    """A PEM certificate's serial (cached: a connection's certificate is parsed once)."""
    return x509.load_pem_x509_certificate(cert_pem).serial_number


@dataclass
class Revocations:
    """The revoked serials of ``ca``'s CRL at ``path`` (absent file: none). ``revoked(serial)`` is a set lookup after
    at most one stat a second; ``version`` grows each time the list changes."""

    path: Path
    ca: x509.Certificate
    clock: Callable[[], float] = time.monotonic
    version: int = 0
    _serials: frozenset[int] = field(default_factory=frozenset)
    _seen: tuple[int, int] | None = None
    _checked: float = float("-inf")

    def revoked(self, serial: int) -> bool:
        self.refresh()
        return serial in self._serials

    def refresh(self) -> None:
        now = self.clock()
        if now - self._checked < RECHECK_S:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
            seen = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            seen = None
        except OSError as exc:
            log.warning("crl.unreadable", path=str(self.path), error=exc.strerror)
            return
        if seen != self._seen:
            self._load(seen)

    def _load(self, seen: tuple[int, int] | None) -> None:
        try:
            serials = (frozenset(r.serial_number for r in load_crl(self.path.read_bytes(), self.ca, self.path))
                       if seen is not None else frozenset())
        except (OSError, ValueError) as exc:
            log.error("crl.rejected", path=str(self.path), error=str(exc), kept=len(self._serials))
            self._seen = seen
            return
        self._seen = seen
        if serials != self._serials:
            self._serials, self.version = serials, self.version + 1
            log.info("crl.loaded", path=str(self.path), revoked=len(serials))
