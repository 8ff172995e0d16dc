"""Revocation without a network (security.revocation, ``ctl certs revoke``): the CA's index, a signed X.509 CRL,
and ``Revocations`` reloading it on change, at most one stat a second, keeping the last good list."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography import x509

from rankctl.cli.commands.certs import certs
from rankctl.security.certs import CertError, init_ca, issue, revoke
from rankctl.security.revocation import CRL, INDEX, Revocations, issued, serial_of_pem
from rankctl.security.tls import load_identity_dir, revoked_problem


def serial(d: Path) -> int:
    return serial_of_pem((d / "cert.pem").read_bytes())


@pytest.fixture()
def ca(tmp_path: Path) -> Path:
    init_ca(tmp_path / "ca", sans=[])
    for out, kw in (("n1", {"node": "n1"}), ("n1-again", {"node": "n1"}), ("n2", {"node": "n2"}),
                    ("eve", {"user": "eve", "role": "viewer"})):
        issue(tmp_path / "ca", tmp_path / out, **kw)
    return tmp_path / "ca"


def test_the_index_lists_every_certificate_issued(ca: Path) -> None:
    rows = issued(ca)
    assert [(r["kind"], r["name"]) for r in rows] == [("coordinator", "coordinator"), ("node", "n1"), ("node", "n1"),
                                                      ("node", "n2"), ("user", "eve")]
    assert rows[1]["serial"] == serial(ca.parent / "n1") and rows[1]["not_after"].startswith("20")


def test_revoking_a_node_revokes_each_of_its_certificates_in_a_crl_signed_by_the_ca(ca: Path) -> None:
    serials, path = revoke(ca, node="n1")
    assert sorted(serials) == sorted([serial(ca.parent / "n1"), serial(ca.parent / "n1-again")])
    revoke(ca, serial=serial(ca.parent / "n2"))
    ca_cert = x509.load_pem_x509_certificate((ca / "ca.pem").read_bytes())
    for where in (path, ca / "coordinator" / CRL):
        crl = x509.load_pem_x509_crl(where.read_bytes())
        assert crl.is_signature_valid(ca_cert.public_key()) and crl.issuer == ca_cert.subject
        assert {r.serial_number for r in crl} == {*serials, serial(ca.parent / "n2")}


def test_revoke_names_what_it_cannot_find(ca: Path) -> None:
    with pytest.raises(CertError, match=r"--user 'bob': .*issued.jsonl lists no user certificate"):
        revoke(ca, user="bob")
    with pytest.raises(CertError, match="exactly one of --node NAME, --user NAME and --serial N"):
        revoke(ca, node="n1", user="eve")
    with pytest.raises(CertError, match="--serial '0' must be a certificate serial"):
        revoke(ca, serial=0)
    assert not (ca / CRL).exists()


def test_the_list_reloads_on_change_at_most_once_a_second_and_keeps_the_last_good_one(ca: Path) -> None:
    now = [0.0]
    idd = load_identity_dir(ca / "coordinator")
    revs = Revocations(idd.path / CRL, x509.load_pem_x509_certificate(idd.ca), clock=lambda: now[0])
    eve = serial(ca.parent / "eve")
    assert not revs.revoked(eve)
    revoke(ca, user="eve")
    assert not revs.revoked(eve)           # checked less than a second ago: no stat yet
    now[0] = 1.5
    assert revs.revoked(eve) and revs.version == 1
    pem = (ca.parent / "eve" / "cert.pem").read_bytes()
    assert "user eve (viewer)" in revoked_problem(revs, pem, "user eve (viewer)") and "revoked" in revoked_problem(
        revs, pem, "x")
    (idd.path / CRL).write_bytes(b"-----BEGIN X509 CRL-----\ngarbage\n-----END X509 CRL-----\n")
    now[0] = 3.0
    assert revs.revoked(eve) and revs.version == 1   # a bad file: the last good list stays
    other = ca.parent / "other"
    init_ca(other, sans=[])
    issue(other, ca.parent / "o1", node="o1")
    revoke(other, node="o1")
    os.replace(other / CRL, idd.path / CRL)          # signed by another CA: refused too
    now[0] = 4.5
    assert revs.revoked(eve)
    (idd.path / CRL).unlink()
    now[0] = 6.0
    assert not revs.revoked(eve) and revs.version == 2


def test_ctl_certs_revoke_prints_serials_and_errors_without_traceback(ca: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(certs, ["revoke", str(ca), "--user", "eve", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout) == {"revoked": [serial(ca.parent / "eve")], "crl": str(ca / CRL)}
    bad = runner.invoke(certs, ["revoke", str(ca), "--node", "ghost"])
    assert bad.exit_code == 2 and "--node 'ghost'" in bad.output and bad.exc_info[0] is SystemExit
    missing = runner.invoke(certs, ["revoke", str(ca.parent / "nowhere"), "--node", "n1"])
    assert missing.exit_code == 2 and "ctl certs init" in missing.output
    assert (ca / INDEX).is_file()


class FakeContext:
    def __init__(self, pem: bytes) -> None:
        self.pem = pem

    def auth_context(self) -> dict:
        return {"x509_pem_cert": [self.pem]}


def test_the_workers_peer_service_refuses_a_revoked_node(ca: Path) -> None:
    from rankctl.worker.daemon.serve import _identify_unrevoked

    now = [0.0]
    idd = load_identity_dir(ca.parent / "n2")
    identify = _identify_unrevoked(Revocations(idd.path / CRL, x509.load_pem_x509_certificate(idd.ca),
                                               clock=lambda: now[0]))
    n1 = FakeContext((ca.parent / "n1" / "cert.pem").read_bytes())
    assert str(identify(n1)) == "node n1"
    revoke(ca, node="n1")
    (idd.path / CRL).write_bytes((ca / CRL).read_bytes())  # the operator copies the list to the node
    now[0] = 2.0
    with pytest.raises(ValueError, match=r"the certificate of node n1 \(serial \d+\) is revoked"):
        identify(n1)
    assert str(identify(FakeContext((ca.parent / "n2" / "cert.pem").read_bytes()))) == "node n2"


def test_one_watcher_closes_only_the_streams_of_revoked_serials_and_stops_when_none_are_left(
        ca: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from rankctl.coordinator.api import node_service

    monkeypatch.setattr(node_service, "REVOCATION_CHECK_S", 0.01)
    idd = load_identity_dir(ca / "coordinator")
    now = [0.0]
    revs = Revocations(idd.path / CRL, x509.load_pem_x509_certificate(idd.ca), clock=lambda: now[0])
    n1, n2 = serial(ca.parent / "n1"), serial(ca.parent / "n2")

    async def main() -> tuple[list[str], bool, bool]:
        closed: list[str] = []
        watch = node_service.RevokedStreams(revs)
        watch.add(n1, lambda: closed.append("n1"))
        remove_n2 = watch.add(n2, lambda: closed.append("n2"))
        revoke(ca, node="n1")
        now[0] = 2.0
        for _ in range(200):
            if closed:
                break
            await asyncio.sleep(0.01)
        running = watch.task is not None
        remove_n2()
        late: list[str] = []
        watch.add(n1, lambda: late.append("n1"))  # a stream of a revoked serial is closed at once
        return closed + late, running, watch.task is None

    closed, running, stopped = asyncio.run(main())
    assert closed == ["n1", "n1"] and running and stopped
