"""Issue 27 end to end: three real etcd members, two ``ctl coordinator --store etcd://...`` and two worker daemons
that know both coordinators (``--coordinator A,B``), every check through ``ctl``.

* the leader SIGKILLed while a train job runs: the standby answers ``ctl status`` (the time is printed: a figure,
  not a threshold; 3.5-4 s here with the default 3 s lease), the job succeeds on
  attempt 1 with the losses of an uninterrupted run, ``ctl jobs`` lists every job, the events are contiguous;
* the leader SIGSTOPped past its lease, then continued: the standby leads, the old leader wrote nothing (etcd's
  log entries after the stop are all the new leader's) and stands by;
* one etcd member SIGKILLed: a new job succeeds; every member down for 15 s: ``ctl submit`` exits 1 naming the
  store, the running job keeps stepping, and it succeeds with every step stored once etcd is back;
* a python job with a shipped workdir, queued before a failover, runs after it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import etcdcluster
from cluster import CTL, Proc, ctl, free_ports, highest_step, status, wait_for

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not etcdcluster.available(), reason="etcd (Debian etcd-server) is not installed")]
STEPS = 40
OUTAGE_STEPS = 80  # longer than the 15 s outage
JOB = """
name: {name}
kind: train
resources: {{nodes: 2, slots_per_node: 2}}
parallel: {{tp: 2}}
model: {{layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}}
train: {{steps: {steps}, global_batch: 8, micro_batch: 2, lr: 1.0e-2, warmup: 2, seed: 11, data: builtin:pydoc}}
"""
EVENT_SEQS = """
import sys
from rankctl.cli.client import Client
with Client(sys.argv[1]) as c:
    print(" ".join(str(ev.seq) for ev in c.watch(sys.argv[2])))
"""


class HACluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.etcd = etcdcluster.EtcdCluster(root / "etcd-logs")
        self.etcd.start_all()
        self.addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
        self.both = ",".join(self.addresses)
        self.coordinators: list[Proc | None] = [None, None]
        for i in range(2):
            self.start_coordinator(i)
        self.workers = [Proc(["worker", "--coordinator", self.both, "--slots", "2", "--name", f"node-{i}",
                              "--state-dir", str(root / f"node-{i}"), "--data-root", "/"], root / f"node-{i}.log")
                        for i in range(2)]
        wait_for(lambda: len(self.ready()) == 2, 120, "both nodes READY")

    def start_coordinator(self, i: int) -> None:
        state = self.root / f"coord-{i}"
        state.mkdir(exist_ok=True)
        self.coordinators[i] = Proc(["coordinator", "--listen", self.addresses[i], "--state-dir", str(state),
                                     "--heartbeat-timeout", "5", "--store", self.etcd.url],
                                    self.root / f"coord-{i}.log")

    def ready(self) -> list[str]:
        out = ctl(self.both, "nodes", "--json")
        return [n["name"] for n in json.loads(out.stdout) if n["state"] == "READY"] if out.returncode == 0 else []

    def info(self) -> dict:
        out = ctl(self.both, "info", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def leader(self) -> int:
        """The index of the leading coordinator (once one leads)."""
        address = wait_for(lambda: self.info()["leader"], 30, "a leader")
        return self.addresses.index(address)

    def submit(self, name: str, steps: int = STEPS, template: str = JOB) -> str:
        path = self.root / f"{name}.yaml"
        path.write_text(template.format(name=name, steps=steps))
        out = ctl(self.both, "submit", str(path))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split()[-1]

    def done(self, job: str, timeout: float = 300) -> dict:
        return wait_for(lambda: (s := status(self.both, job))["state"] in {"SUCCEEDED", "FAILED", "CANCELLED"} and s,
                        timeout, f"{job} to end")

    def stop(self) -> None:
        for proc in [*self.workers, *self.coordinators]:
            if proc is not None:
                if proc.p.poll() is None:
                    proc.p.send_signal(signal.SIGCONT)
                proc.stop()
        self.etcd.close()


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory):
    c = HACluster(tmp_path_factory.mktemp("ha"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(ha: HACluster) -> dict:
    ref = ha.done(ha.submit("uninterrupted"))
    assert ref["state"] == "SUCCEEDED", ref["reason"]
    return ref


def losses(done: dict) -> list[tuple[int, float]]:
    return [(x["step"], x["loss"]) for x in done["result"]["losses"]]


def assert_same_losses(done: dict, ref: dict) -> None:
    assert [s for s, _ in losses(done)] == list(range(1, STEPS + 1))
    for (step, ours), (_, theirs) in zip(losses(done), losses(ref)):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (step, ours, theirs)


def event_seqs(address: str, job: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", EVENT_SEQS, address, job], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [int(s) for s in out.stdout.split()]


def stepping(ha: HACluster, job: str, step: int) -> None:
    wait_for(lambda: highest_step(ha.root, job, 1) >= step, 180, f"{job} at step {step}")


def test_the_leader_sigkilled_the_standby_answers_within_5_s_and_the_job_goes_on_untouched(
        ha: HACluster, reference: dict) -> None:
    job = ha.submit("failover")
    stepping(ha, job, 10)
    leader = ha.leader()
    killed_at = time.monotonic()
    ha.coordinators[leader].kill(signal.SIGKILL)
    wait_for(lambda: ctl(ha.both, "status", job).returncode == 0, 30, "ctl status after the leader died", interval=0.1)
    answered = time.monotonic() - killed_at
    print(f"\nthe standby answered ctl status {answered:.2f} s after the leader was SIGKILLed")
    ha.start_coordinator(leader)  # back as a standby, for the next tests
    done = ha.done(job)
    assert done["state"] == "SUCCEEDED" and done["attempt"] == 1, done["reason"]
    assert_same_losses(done, reference)
    seqs = event_seqs(ha.both, job)
    print(f"events of the job: {len(seqs)}, seq 1..{seqs[-1]}")
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) > 10
    listed = json.loads(ctl(ha.both, "jobs", "--json").stdout)
    assert {j["id"] for j in listed} >= {job, reference["id"]}


def _log_entries(ha: HACluster) -> list[tuple[int, str]]:
    """(mod revision, writer id) of every log entry on etcd (the writer: ``holder:fence:seq``)."""
    from rankctl.coordinator.store import mirror

    out = ha.etcd.ctl("get", "--prefix", f"{ha.etcd.prefix}/log/", "-w", "json")
    import base64
    kvs = json.loads(out.stdout).get("kvs", [])
    return [(kv["mod_revision"], mirror.decode(base64.b64decode(kv["value"]))["id"]) for kv in kvs]


def test_a_leader_stopped_past_its_lease_is_replaced_writes_nothing_and_stands_by(ha: HACluster) -> None:
    job = ha.submit("stopped-leader", steps=60)
    stepping(ha, job, 5)
    old = ha.leader()
    old_id = next(m["id"] for m in ha.info()["coordinators"] if m["leading"])
    ha.coordinators[old].p.send_signal(signal.SIGSTOP)
    try:
        # the store's revision once the stopped leader's last write, possibly in flight at the stop, has landed
        # (read before the stop, CI saw a group commit of the leader's land between the read and the stop)
        time.sleep(0.5)
        revision = json.loads(ha.etcd.ctl("get", "x", "-w", "json").stdout)["header"]["revision"]
        wait_for(lambda: (i := ha.info())["leader"] and i["leader"] != ha.addresses[old], 30, "the standby to lead")
        time.sleep(2)
    finally:
        ha.coordinators[old].p.send_signal(signal.SIGCONT)
    wait_for(lambda: any(m["address"] == ha.addresses[old] and not m["leading"] for m in ha.info()["coordinators"]),
             30, "the old leader registered again as a standby")
    done = ha.done(job)
    assert done["state"] == "SUCCEEDED", done["reason"]
    after = [(rev, writer) for rev, writer in _log_entries(ha) if rev > revision]
    writers = {w.split(":")[0] for _, w in after}
    print(f"\nlog entries written after the stop: {len(after)}, by {sorted(writers)}; the old leader was {old_id}")
    assert after and old_id not in writers
    old_log = (ha.root / f"coord-{old}.log").read_text()
    assert "coordinator.stepping_down" in old_log


def submitted_once_elected(ha: HACluster, name: str) -> str:
    """Submit ``name`` while one etcd member of three is down. The other two may still be electing a leader (the
    lost one led; on a loaded machine that can outlast a commit's deadline): until then a submit is refused
    cleanly, naming the store and that a majority listens, and stores nothing."""
    path = ha.root / f"{name}.yaml"
    path.write_text(JOB.format(name=name, steps=10))
    refusals: list[str] = []

    def submit() -> str | None:
        out = ctl(ha.both, "submit", str(path))
        if out.returncode == 0:
            return out.stdout.strip().split()[-1]
        assert out.returncode == 1 and "committed nothing in time" in out.stderr, out.stderr
        listed = json.loads(ctl(ha.both, "jobs", "--json").stdout)
        assert "Traceback" not in out.stderr and not any(j["name"] == name for j in listed), out.stderr
        refusals.append(out.stderr.strip())
        return None

    job = wait_for(submit, 60, f"{name} accepted once the two members elect a leader", interval=1.0)
    print(f"\n{len(refusals)} submit(s) refused while the members elected a leader")
    return job


def test_etcd_members_lost_one_then_all_for_15_s(ha: HACluster) -> None:
    ha.etcd.kill(2)
    try:
        one = ha.done(submitted_once_elected(ha, "one-member-down"))
        assert one["state"] == "SUCCEEDED", one["reason"]
        job = ha.submit("etcd-outage", steps=OUTAGE_STEPS)
        stepping(ha, job, 5)
        ha.etcd.stop_all()
        before = highest_step(ha.root, job, 1)
        refused = ctl(ha.both, "submit", str(ha.root / "one-member-down.yaml"), timeout=60)
        print(f"\nctl submit with etcd down: exit {refused.returncode}: {refused.stderr.strip()}")
        assert refused.returncode == 1 and "etcd://" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        time.sleep(max(0.0, 15 - 5))
        during = highest_step(ha.root, job, 1)
        assert during > before, (before, during)  # the ranks kept training
    finally:
        ha.etcd.start_all()
    done = ha.done(job)
    assert done["state"] == "SUCCEEDED" and done["attempt"] == 1, done["reason"]
    assert [s for s, _ in losses(done)] == list(range(1, OUTAGE_STEPS + 1))


def test_a_stalled_etcd_delays_writes_never_reads_or_heartbeats(ha: HACluster) -> None:
    """Every etcd member SIGSTOPped for about a second while a job runs (a stall: connections accepted, nothing
    answered; shorter than the leader's lease and the store's call deadline). The leader stores behind its event
    loop (``coordinator.ha.replicator``): a status query and the node list are answered while etcd is stopped, both
    nodes READY; a ``ctl submit`` sent meanwhile is delayed, not lost: it returns once etcd goes on, and its job
    runs; the running job succeeds on attempt 1 with every step's loss."""
    from rankctl.cli.client import Client
    from rankctl.proto import rankctl_pb2 as pb

    job = ha.submit("etcd-stall", steps=OUTAGE_STEPS)   # running through the stall even on a loaded machine
    stepping(ha, job, 5)
    path = ha.root / "during-the-stall.yaml"
    path.write_text(JOB.format(name="during-the-stall", steps=5))
    with Client(ha.addresses[ha.leader()]) as client:
        client.get(job)                                      # the channel up before the stall
        for i in range(len(ha.etcd.names)):
            ha.etcd.kill(i, signal.SIGSTOP)
        try:
            seen, nodes = client.get(job), client.nodes()    # reads: never behind a write waiting for etcd
            submit = subprocess.Popen([*CTL, "--coordinator", ha.both, "submit", str(path)], text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            time.sleep(1.0)
        finally:
            for i in range(len(ha.etcd.names)):
                ha.etcd.kill(i, signal.SIGCONT)
    out, err = submit.communicate(timeout=60)
    assert seen.id == job and [n.state for n in nodes] == [pb.NODE_STATE_READY] * 2, nodes
    assert submit.returncode == 0, err
    later = ha.done(out.split()[-1])
    assert later["state"] == "SUCCEEDED", later["reason"]
    done = ha.done(job)
    assert done["state"] == "SUCCEEDED" and done["attempt"] == 1, done["reason"]
    assert [s for s, _ in losses(done)] == list(range(1, OUTAGE_STEPS + 1))


def test_a_python_job_with_a_shipped_workdir_queued_before_a_failover_runs_after_it(ha: HACluster) -> None:
    work = ha.root / "work"
    work.mkdir()
    (work / "job.yaml").write_text(
        f"name: shipped-ha\nkind: python\nresources: {{nodes: 2, slots_per_node: 2}}\n"
        f"python: {{entrypoint: run.py, workdir: {work}}}\n")
    (work / "run.py").write_text("import helper\nprint('shipped', helper.VALUE, flush=True)\n")
    (work / "helper.py").write_text("VALUE = 'from the workdir'\n")
    # busy holds both nodes until it is cancelled after the failover: a short one could end, and let the
    # shipped job run, before the failover
    busy = ha.submit("busy", steps=100_000)
    stepping(ha, busy, 3)
    out = ctl(ha.both, "submit", str(work / "job.yaml"))
    assert out.returncode == 0, out.stderr
    shipped = out.stdout.strip().split()[-1]
    assert status(ha.both, shipped)["state"] == "PENDING"
    leader = ha.leader()
    ha.coordinators[leader].kill(signal.SIGKILL)
    try:
        wait_for(lambda: ctl(ha.both, "cancel", busy).returncode == 0, 60, "busy cancelled by the new leader")
        done = ha.done(shipped)
    finally:
        ha.start_coordinator(leader)
    assert done["state"] == "SUCCEEDED", done["reason"]
    # the nodes may still be re-registering with whichever coordinator leads now: their logs stay on them
    wait_for(lambda: ctl(ha.both, "logs", shipped).stdout.count("shipped from the workdir") == 4, 90,
             "the four ranks' lines from the workdir in ctl logs")


def test_a_sqlite_state_dir_migrated_onto_etcd_keeps_its_jobs(ha: HACluster, tmp_path: Path) -> None:
    from cluster import start_coordinator

    plain, address = start_coordinator(tmp_path / "sqlite")
    (tmp_path / "queued.yaml").write_text(JOB.format(name="queued", steps=5))
    out = ctl(address, "submit", str(tmp_path / "queued.yaml"), "--queue-anyway")
    assert out.returncode == 0, out.stderr
    queued = out.stdout.strip().split()[-1]
    running_refused = subprocess.run([*CTL, "coordinator", "migrate", "--from", str(tmp_path / "sqlite"), "--store",
                                      ha.etcd.url + "-migrated"], capture_output=True, text=True, timeout=60)
    assert running_refused.returncode != 0 and "in use by another coordinator" in running_refused.stderr
    plain.stop()
    url = ha.etcd.url + "-migrated"
    moved = subprocess.run([*CTL, "coordinator", "migrate", "--from", str(tmp_path / "sqlite"), "--store", url],
                           capture_output=True, text=True, timeout=60)
    print("\n" + moved.stdout.strip())
    assert moved.returncode == 0 and "1 jobs" in moved.stdout, moved.stderr
    again = subprocess.run([*CTL, "coordinator", "migrate", "--from", str(tmp_path / "sqlite"), "--store", url],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "holds state already" in again.stderr
    proc = Proc(["coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "onetcd"), "--store", url],
                tmp_path / "onetcd.log")
    try:
        address = wait_for(lambda: (p := tmp_path / "onetcd" / "address").exists() and p.read_text().strip(), 30,
                           "the coordinator on the migrated prefix")
        listed = wait_for(lambda: (o := ctl(address, "jobs", "--json")).returncode == 0 and json.loads(o.stdout), 30,
                          "jobs from the migrated store")
        assert [j["id"] for j in listed] == [queued] and listed[0]["state"] == "PENDING"
    finally:
        proc.stop()


def test_ctl_skips_a_refused_address_at_once_and_follows_the_leader_a_standby_names(ha: HACluster) -> None:
    """A dead coordinator first in the list cost every call 2 s, a refused port alone 5 s, and a standby's address
    alone ended in its refusal: now a refused address is tried once and skipped, the standby's named leader is
    called next (and kept for later calls), and a lone refused address fails at once saying so."""
    from rankctl.cli.client import Client
    from rankctl.cli.errors import EXIT_UNREACHABLE, CtlError

    leader = ha.addresses[ha.leader()]
    standby = next(a for a in ha.addresses if a != leader)
    refused = f"127.0.0.1:{free_ports(1)[0]}"
    with Client(f"{refused},{standby}") as client:
        client.jobs()
        client.jobs()
    assert client.route == [(refused, "connection refused"), (standby, f"standby, names {leader}"),
                            (leader, "answered"), (leader, "answered")]
    with pytest.raises(CtlError) as err:
        Client(refused)
    assert err.value.exit_code == EXIT_UNREACHABLE and f"{refused}: connection refused" in str(err.value)
    out = ctl(standby, "jobs", "--json")
    assert out.returncode == 0, out.stderr


def _refusal(address: str) -> str:
    """What the coordinator at ``address`` answers a ListJobs with ("" when it serves it)."""
    import grpc

    from rankctl.proto import rankctl_pb2 as pb
    from rankctl.proto import rankctl_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.ClientServiceStub(channel).ListJobs(pb.ListJobsRequest(), timeout=10)
            return ""
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"


def test_a_coordinator_cut_from_the_store_and_a_lost_quorum_are_named_as_they_are(ha: HACluster,
                                                                                   tmp_path: Path) -> None:
    """A standby that reaches only etcd member 0, which dies while the others keep quorum, said "no coordinator
    leads" while another led; with quorum lost, the problem line called the live member unreachable."""
    from rankctl.cli.client import Client

    ha.leader()
    cut_address, (first, second, third) = f"127.0.0.1:{free_ports(1)[0]}", ha.etcd.endpoints
    cut = Proc(["coordinator", "--listen", cut_address, "--state-dir", str(tmp_path / "cut"),
                "--store", f"etcd://{first}{ha.etcd.prefix}"], tmp_path / "cut.log")
    try:
        wait_for(lambda: "standby" in _refusal(cut_address), 30, "the third coordinator standing by")
        ha.etcd.kill(0)
        said = wait_for(lambda: "cannot reach the store" in (r := _refusal(cut_address)) and r, 30, "the cut one")
        assert said.startswith("UNAVAILABLE") and "no coordinator leads" not in said and "is unreachable" in said
        with Client(f"{cut_address},{ha.both}") as client:
            client.jobs()
        assert client.route[0][0] == cut_address and "cannot reach the store" in client.route[0][1], client.route
        assert client.route[-1][1] == "answered" and client.route[-1][0] in ha.addresses, client.route
        ha.etcd.kill(1)
        problem = wait_for(lambda: "lost its quorum" in (p := ha.info()["store"]["problem"] or "") and p, 30,
                           "the store problem naming the lost quorum")
        down, _, live = problem.partition("are down (")[2].partition(")")
        assert sorted(down.split(", ")) == sorted([first, second]) and live.startswith(f"; {third} accept"), problem
    finally:
        cut.stop()
        ha.etcd.start_all()
        ha.leader()
