"""End to end with certificates (issue 14): a real coordinator serving mutual TLS only, two worker daemons
with node certificates, and ``ctl`` with user certificates of each role, all made by ``ctl certs``.

A comm-check and a train job succeed over mTLS (checkpoint replication between the nodes included) and
record who submitted them. A client with no certificate or with one from another CA is refused (exit 2,
a clear message) and nothing changes; a viewer cannot submit or cancel; a submitter cannot cancel
another user's job (an admin can); a stream with a user certificate cannot register as a node; a node
certificate for one name cannot register as another. Without ``--tls-dir`` a coordinator or worker
refuses a non-loopback address unless ``--insecure``.
"""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest

from cluster import CTL, Proc, start_coordinator, start_worker, wait_for

pytestmark = pytest.mark.timeout(600)
NODES = ("node-0", "node-1")
USERS = {"alice": "submitter", "bob": "submitter", "val": "viewer", "root": "admin"}
TRAIN = """
name: tls-train
kind: train
resources: {nodes: 2, slots_per_node: 2}
parallel: {tp: 2}
model: {layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}
train: {steps: 6, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 11, checkpoint_every: 2,
        data: builtin:pydoc}
"""
SLEEPER = """
name: {name}
kind: python
resources: {{nodes: 1, slots_per_node: 1}}
backend: gloo
python: {{entrypoint: sleep.py, workdir: {workdir}}}
"""


def certs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CTL, "certs", *args], capture_output=True, text=True, timeout=60)


class TlsCluster:
    def __init__(self, root: Path) -> None:
        self.root, self.ca = root, root / "ca"
        done = certs("init", str(self.ca), "--san", "127.0.0.1")
        assert done.returncode == 0, done.stderr
        self.ids = {}
        for name in NODES:
            self.ids[name] = self._issue("--node", name)
        for name, role in USERS.items():
            self.ids[name] = self._issue("--user", name, "--role", role)
        self.coord, self.address = start_coordinator(root / "coord", 3.0,
                                                     extra=("--tls-dir", str(self.ca / "coordinator")))
        self.workers: dict[str, Proc] = {n: start_worker(self.address, n, 2, root, ("--tls-dir", self.ids[n]),
                                                         data_roots=())  # the default sandbox: the state dir
                                         for n in NODES}
        wait_for(lambda: sorted(n["name"] for n in self.nodes() if n["state"] == "READY") == list(NODES), 60,
                 "both nodes READY over mTLS")

    def _issue(self, *args: str) -> str:
        out = self.root / "ids" / args[1]
        done = certs("issue", str(self.ca), *args, "--out", str(out))
        assert done.returncode == 0, done.stderr
        return str(out)

    def ctl(self, who: str | None, *args: str) -> subprocess.CompletedProcess:
        tls = ["--tls-dir", self.ids[who] if who in self.ids else who] if who else []
        return subprocess.run([*CTL, "--coordinator", self.address, *tls, *args], capture_output=True, text=True,
                              timeout=300)

    def nodes(self) -> list[dict]:
        out = self.ctl("val", "nodes", "--json")
        return json.loads(out.stdout) if out.returncode == 0 else []

    def status(self, job: str) -> dict:
        out = self.ctl("val", "status", job, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def jobs(self) -> list[str]:
        out = self.ctl("root", "jobs", "--json")
        assert out.returncode == 0, out.stderr
        return sorted(j["id"] for j in json.loads(out.stdout))

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.coord.stop()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory):
    c = TlsCluster(tmp_path_factory.mktemp("tls"))
    yield c
    c.stop()


def finish(c: TlsCluster, job: str, timeout: float = 300) -> dict:
    return wait_for(lambda: (s := c.status(job))["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and s, timeout,
                    f"{job} to end")


def test_a_comm_check_and_a_train_job_succeed_over_mtls_and_record_their_submitter(tls: TlsCluster) -> None:
    check = tls.ctl("alice", "submit", "examples/comm-check.yaml", "--set", "resources.slots_per_node=2",
                    "--set", "parallel.pp=1")
    assert check.returncode == 0, check.stderr
    (tls.root / "train.yaml").write_text(TRAIN)
    train = tls.ctl("alice", "submit", str(tls.root / "train.yaml"))
    assert train.returncode == 0, train.stderr
    for job in (check.stdout.strip(), train.stdout.strip()):
        done = finish(tls, job)
        assert done["state"] == "SUCCEEDED", done["reason"]
        assert done["submitted_by"] == "alice"
    text = tls.ctl("val", "status", train.stdout.strip())
    assert "submitted by: alice" in text.stdout, text.stdout
    copies = [p for n in NODES for p in (tls.root / n / "replicas" / "tls-train").glob("step-*/*.done")]
    assert copies, "no checkpoint was replicated between the nodes over mTLS"


def test_clients_without_a_valid_certificate_are_refused_and_change_nothing(tls: TlsCluster, tmp_path: Path) -> None:
    before = tls.jobs()
    plain = tls.ctl(None, "submit", "examples/comm-check.yaml")
    assert plain.returncode == 2 and "accepts no plain-text connection" in plain.stderr, plain.stderr
    other = tmp_path / "other-ca"
    assert certs("init", str(other), "--san", "127.0.0.1").returncode == 0
    assert certs("issue", str(other), "--user", "mallory", "--role", "admin", "--out", str(tmp_path / "m")).returncode == 0
    foreign = tls.ctl(str(tmp_path / "m"), "jobs")
    assert foreign.returncode == 2 and "TLS handshake" in foreign.stderr, foreign.stderr
    from rankctl.security.certs import issue

    ago = datetime.now(timezone.utc) - timedelta(days=10)
    issue(tls.ca, tmp_path / "old", user="olga", role="admin", days=1, not_before=ago)
    expired = tls.ctl(str(tmp_path / "old"), "cancel", tls.jobs()[0] if before else "none")
    assert expired.returncode == 2 and "expired" in expired.stderr, expired.stderr
    assert "Traceback" not in plain.stderr + foreign.stderr + expired.stderr
    assert tls.jobs() == before


def test_roles_viewer_reads_only_submitter_cancels_only_its_own(tls: TlsCluster, tmp_path: Path) -> None:
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(300)\n")
    (tmp_path / "sleep.yaml").write_text(SLEEPER.format(name="sleeper", workdir=tmp_path))
    before = tls.jobs()
    viewer = tls.ctl("val", "submit", str(tmp_path / "sleep.yaml"))
    assert viewer.returncode == 2 and "user val (viewer) may not call" in viewer.stderr \
        and "submitter role" in viewer.stderr, viewer.stderr
    assert tls.jobs() == before
    mine = tls.ctl("alice", "submit", str(tmp_path / "sleep.yaml"))
    assert mine.returncode == 0, mine.stderr
    job = mine.stdout.strip()
    for who, words in (("val", "user val (viewer) may not call CancelJob"),
                       ("bob", "user bob (submitter) may not cancel job")):
        refused = tls.ctl(who, "cancel", job)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
        assert tls.status(job)["state"] not in ("CANCELLED",)
    assert tls.ctl("root", "cancel", job).returncode == 0
    assert finish(tls, job)["state"] == "CANCELLED"
    drain = tls.ctl("alice", "drain", "node-0")
    assert drain.returncode == 2 and "admin role" in drain.stderr, drain.stderr


def _connect(tls: TlsCluster, who: str, name: str) -> grpc.RpcError:
    """Open a node stream with ``who``'s certificate, registering as ``name``; the error that ends it."""
    from rankctl.proto import rankctl_pb2 as pb
    from rankctl.proto import rankctl_pb2_grpc as pb_grpc
    from rankctl.security.tls import channel_credentials, load_identity_dir

    creds = channel_credentials(load_identity_dir(tls.ids[who]))
    with grpc.secure_channel(tls.address, creds) as channel:
        stream = pb_grpc.NodeServiceStub(channel).Connect(
            iter([pb.NodeMessage(register=pb.Register(name=name, address="127.0.0.1", slots=8))]), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(stream)
    return err.value


def test_only_a_node_certificate_registers_and_only_under_its_own_name(tls: TlsCluster) -> None:
    rogue = _connect(tls, "root", "aaa")
    assert rogue.code() is grpc.StatusCode.PERMISSION_DENIED and "only node certificates" in rogue.details()
    forged = _connect(tls, "node-0", "node-9")
    assert forged.code() is grpc.StatusCode.PERMISSION_DENIED, forged
    assert "may not register as node 'node-9'" in forged.details(), forged.details()
    assert sorted(n["name"] for n in tls.nodes()) == list(NODES)


@pytest.mark.parametrize("service", ["coordinator", "worker"])
def test_plain_text_on_a_non_loopback_address_needs_insecure(service: str, tmp_path: Path) -> None:
    args = (["coordinator", "--listen", "0.0.0.0:0"] if service == "coordinator"
            else ["worker", "--coordinator", "10.255.0.1:7420", "--name", "n1"])
    out = subprocess.run([*CTL, *args, "--state-dir", str(tmp_path / "s")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "is not a loopback address" in out.stderr and "--insecure" in out.stderr, out.stderr


def test_a_job_naming_data_outside_the_workers_roots_fails_naming_the_path_and_the_roots(tls: TlsCluster) -> None:
    """The workers run with the default sandbox (their state dir only): /etc/passwd is refused on the node,
    before any rank starts, and the job's reason names the field, the path and the roots."""
    text = TRAIN.replace("name: tls-train", "name: peek").replace("data: builtin:pydoc", "data: /etc/passwd")
    (tls.root / "peek.yaml").write_text(text)
    sub = tls.ctl("alice", "submit", str(tls.root / "peek.yaml"))
    assert sub.returncode == 0, sub.stderr   # the coordinator checks only the text: it never looks at the file
    done = finish(tls, sub.stdout.strip())
    assert done["state"] == "FAILED", done
    assert "train.data: /etc/passwd is outside the allowed roots (" in done["reason"], done["reason"]
    assert str((tls.root / "node-0").resolve()) in done["reason"] or str((tls.root / "node-1").resolve()) in \
        done["reason"], done["reason"]
    assert not any((tls.root / n / "checkpoints" / "peek").exists() for n in NODES)
