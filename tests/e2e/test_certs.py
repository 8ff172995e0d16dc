"""Certificates and mTLS (security.certs, security.tls, ``ctl certs``): a CA, node and user identity
directories, and an in-process gRPC health server that admits only clients of its own CA."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
from concurrent import futures
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rankctl.cli.commands.certs import certs
from rankctl.security.certs import CertError, identity_of_pem, init_ca, issue
from rankctl.security.identity import ROLES, Identity, role_allows, user_name_problem
from rankctl.security.tls import (channel_credentials, is_loopback, load_identity_dir, peer_identity,
                                  server_credentials)

pytestmark = pytest.mark.grpc_in_process


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CA with the coordinator, node-3 and a user per role; a second, foreign CA with one admin."""
    root = tmp_path_factory.mktemp("pki")
    init_ca(root / "ca", sans=["coord.example.com", "10.0.0.2"])
    issue(root / "ca", root / "node-3", node="node-3", sans=["10.0.0.13"])
    for role in ROLES:
        issue(root / "ca", root / role, user=f"u-{role}", role=role)
    init_ca(root / "other", sans=[])
    issue(root / "other", root / "mallory", user="mallory", role="admin")
    ago = datetime.now(timezone.utc) - timedelta(days=10)
    issue(root / "ca", root / "expired", user="old", role="viewer", not_before=ago, days=1)
    return root


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_and_issue_write_private_keys_and_round_trip_identities(pki: Path) -> None:
    assert _mode(pki / "ca" / "ca-key.pem") == 0o600 and _mode(pki / "ca") == 0o700
    expected = {"ca/coordinator": Identity("coordinator", "coordinator"), "node-3": Identity("node-3", "node"),
                **{role: Identity(f"u-{role}", role) for role in ROLES}}
    for sub, identity in expected.items():
        d = pki / sub
        assert _mode(d / "key.pem") == 0o600 and _mode(d) == 0o700
        assert (d / "ca.pem").read_bytes() == (pki / "ca" / "ca.pem").read_bytes()
        assert load_identity_dir(d).identity == identity == identity_of_pem((d / "cert.pem").read_bytes())
    assert str(Identity("alice", "submitter")) == "user alice (submitter)"
    assert str(Identity("node-3", "node")) == "node node-3" and Identity("node-3", "node").kind == "node"


def test_roles_are_ordered() -> None:
    assert role_allows("admin", "submitter") and role_allows("submitter", "submitter")
    assert not role_allows("viewer", "submitter") and not role_allows("node", "viewer")


def test_a_ca_and_a_key_are_never_overwritten(pki: Path) -> None:
    with pytest.raises(CertError, match="ca-key.pem exists"):
        init_ca(pki / "ca", sans=[])
    with pytest.raises(CertError, match="key.pem exists"):
        issue(pki / "ca", pki / "node-3", node="node-3")


@pytest.mark.parametrize("kwargs, message", [
    ({"user": "Alice!", "role": "viewer"}, "user name 'Alice!' must be 1-63 characters"),
    ({"user": "alice", "role": "root"}, "role 'root' must be one of viewer, submitter, admin"),
    ({"user": "alice"}, "user 'alice' needs a role: one of viewer, submitter, admin"),
    ({"node": "Node_3"}, "node name 'Node_3' must be"),
    ({"node": "n1", "role": "admin"}, "a node's role is 'node'"),
    ({"node": "n1", "user": "alice", "role": "admin"}, "exactly one of"),
    ({"node": "n1", "sans": ["bad host"]}, "SAN 'bad host' must be"),
])
def test_bad_names_and_roles_are_refused_clearly(pki: Path, tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(CertError, match=message.replace("(", r"\(")):
        issue(pki / "ca", tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
    assert user_name_problem("a.b_c-1") is None


def test_identity_of_a_cert_without_a_role_is_an_error(pki: Path) -> None:
    with pytest.raises(CertError, match="must hold one CN .the name. and one OU .the role."):
        identity_of_pem((pki / "ca" / "ca.pem").read_bytes())


def test_load_identity_dir_names_the_problem(pki: Path, tmp_path: Path) -> None:
    d = tmp_path / "copy"
    shutil.copytree(pki / "viewer", d)
    os.chmod(d / "key.pem", 0o644)
    with pytest.raises(CertError, match=r"key.pem has mode 0644; it must be 0600 \(chmod 600 "):
        load_identity_dir(d)
    os.chmod(d / "key.pem", 0o600)
    shutil.copy(pki / "other" / "ca.pem", d / "ca.pem")
    with pytest.raises(CertError, match=r"cert.pem is not signed by .*ca.pem"):
        load_identity_dir(d)
    with pytest.raises(CertError, match="cert.pem expired at"):
        load_identity_dir(pki / "expired")
    (d / "ca.pem").unlink()
    with pytest.raises(CertError, match="ca.pem: not found"):
        load_identity_dir(d)


class _RecordingHealth(health.HealthServicer):
    """The standard health service, noting who called Check."""

    def __init__(self) -> None:
        super().__init__()
        self.callers: list[Identity | None] = []

    def Check(self, request, context):  # noqa: ANN001, N802 - grpc's servicer signature
        self.callers.append(peer_identity(context))
        return super().Check(request, context)


@pytest.fixture(scope="module")
def server(pki: Path):
    """A health server on 127.0.0.1 with the coordinator's identity (client certificates required)."""
    servicer = _RecordingHealth()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_secure_port("127.0.0.1:0", server_credentials(load_identity_dir(pki / "ca" / "coordinator")))
    srv.start()
    yield f"127.0.0.1:{port}", servicer
    srv.stop(None)


def _check(target: str, creds: grpc.ChannelCredentials) -> None:
    with grpc.secure_channel(target, creds) as channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)


def test_the_server_sees_the_client_identity(pki: Path, server) -> None:
    target, servicer = server
    _check(target, channel_credentials(load_identity_dir(pki / "submitter")))
    _check(target, channel_credentials(load_identity_dir(pki / "node-3")))
    assert servicer.callers[-2:] == [Identity("u-submitter", "submitter"), Identity("node-3", "node")]


def _creds(ca: Path, identity: Path | None) -> grpc.ChannelCredentials:
    if identity is None:
        return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes(), certificate_chain=(
        identity / "cert.pem").read_bytes(), private_key=(identity / "key.pem").read_bytes())


@pytest.mark.parametrize("client", ["mallory", None, "expired"], ids=["another-ca", "no-cert", "expired"])
def test_clients_without_a_valid_cert_of_this_ca_are_refused(pki: Path, server, client: str | None) -> None:
    target, servicer = server
    before = len(servicer.callers)
    with pytest.raises(grpc.RpcError) as err:
        _check(target, _creds(pki / "ca" / "ca.pem", pki / client if client else None))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(servicer.callers) == before


def test_aio_peer_identity_is_none_on_plain_text(pki: Path) -> None:
    async def main() -> list[Identity | None]:
        servicer = _RecordingHealth()
        srv = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
        tls = srv.add_secure_port("127.0.0.1:0", server_credentials(load_identity_dir(pki / "ca" / "coordinator")))
        plain = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        creds = channel_credentials(load_identity_dir(pki / "admin"))
        for channel in (grpc.aio.secure_channel(f"127.0.0.1:{tls}", creds),
                        grpc.aio.insecure_channel(f"127.0.0.1:{plain}")):
            async with channel:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        await srv.stop(None)
        return servicer.callers

    assert asyncio.run(main()) == [Identity("u-admin", "admin"), None]


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:7420", True), ("[::1]:0", True), ("localhost:1", True), ("unix:/tmp/s", True),
    ("0.0.0.0:7420", False), ("[::]:1", False), ("10.0.0.5:1", False), (":7420", False), ("node-3:1", False),
])
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_ctl_certs_issue_prints_the_directory_and_errors_without_traceback(tmp_path: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(certs, ["init", str(tmp_path / "ca"), "--json"])
    assert made.exit_code == 0 and json.loads(made.stdout) == {"dir": str(tmp_path / "ca" / "coordinator")}
    out = tmp_path / "bob"
    made = runner.invoke(certs, ["issue", str(tmp_path / "ca"), "--user", "bob", "--role", "viewer", "--out", str(out)])
    assert made.exit_code == 0 and made.stdout.strip() == str(out)
    again = runner.invoke(certs, ["issue", str(tmp_path / "ca"), "--user", "bob", "--role", "god", "--out", str(out)])
    assert again.exit_code == 2 and "role 'god' must be one of viewer, submitter, admin" in again.output
    assert again.exc_info[0] is SystemExit
