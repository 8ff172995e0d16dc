"""End to end: hostile job files are refused quickly by a real ``ctl coordinator`` and the real ``ctl``.

An alias bomb, a world of 10**9 ranks and 1.5e8 slots per node are each refused with exit 2
by ``ctl submit`` (which validates locally first) and with INVALID_ARGUMENT by a raw SubmitJob
or PlanJob, while another client's ListJobs keeps answering, and nothing is stored. Times are
printed (run with ``-s``), never asserted: each refusal must name the bounding rule that refused it (the
work those rules bound is counted in tests/unit/contract/test_hostile_input.py), and a blow-up fails at the
call's own timeout.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import grpc
import pytest

from cluster import CTL, ctl, start_coordinator, start_worker, wait_for
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc as pb_grpc
from test_hostile_input import alias_bomb

pytestmark = [pytest.mark.timeout(300), pytest.mark.grpc_in_process]

HOSTILE = {
    "alias-bomb": alias_bomb(),
    "world-1e9": "name: huge\nkind: comm-check\nresources: {nodes: 1000000, slots_per_node: 1000}\n",
    "slots-1.5e8": "name: wide\nkind: comm-check\nresources: {nodes: 1, slots_per_node: 150000000}\n",
}
EXPECTED = {"alias-bomb": "more than 10000 values", "world-1e9": "maximum world size",
            "slots-1.5e8": "resources.slots_per_node"}


class Poller(threading.Thread):
    """Another client: ListJobs every 50 ms, and once more after ``done`` is set; keeps the slowest answer."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.stub = pb_grpc.ClientServiceStub(grpc.insecure_channel(address))
        self.slowest, self.calls, self.failures = 0.0, 0, []
        self.done = threading.Event()

    def run(self) -> None:
        stop = False
        while not stop:
            stop = self.done.is_set()   # the last call starts after the test's hostile requests were refused
            start = time.monotonic()
            try:
                self.stub.ListJobs(pb.ListJobsRequest(), timeout=30)
            except grpc.RpcError as exc:
                self.failures.append(exc.code())
            self.slowest = max(self.slowest, time.monotonic() - start)
            self.calls += 1
            time.sleep(0.05)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """The module's coordinator: (its process, its address)."""
    proc, address = start_coordinator(tmp_path_factory.mktemp("hostile") / "coord")
    yield proc, address
    proc.stop()


@pytest.fixture(scope="module")
def coordinator(served) -> str:  # noqa: ANN001
    return served[1]


@pytest.fixture
def poller(coordinator: str):
    p = Poller(coordinator)
    p.start()
    yield p
    p.done.set()
    p.join(timeout=60)
    print(f"another client's ListJobs: {p.calls} calls, slowest {p.slowest * 1000:.0f} ms")
    # every call answered within its own deadline, the last one after the hostile requests, and none is stuck
    assert not p.failures and p.calls >= 1 and not p.is_alive(), (p.failures, p.calls)


def timed_ctl(address: str, *args: str):
    start = time.monotonic()
    out = ctl(address, *args, timeout=120)
    return out, time.monotonic() - start


def jobs_json(address: str) -> list:
    out = ctl(address, "jobs", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_ctl_submit_refuses_hostile_jobs_quickly(case: str, coordinator: str, poller: Poller, tmp_path: Path) -> None:
    before = jobs_json(coordinator)
    job = tmp_path / f"{case}.yaml"
    job.write_text(HOSTILE[case])
    out, took = timed_ctl(coordinator, "submit", str(job))
    print(f"ctl submit {case}: exit {out.returncode} in {took:.2f} s (process start included): {out.stderr.strip()}")
    assert out.returncode == 2 and EXPECTED[case] in out.stderr, out.stderr   # refused by the rule that bounds it
    assert jobs_json(coordinator) == before


@pytest.mark.parametrize("rpc", ["SubmitJob", "PlanJob"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_coordinator_refuses_hostile_specs_quickly(case: str, rpc: str, coordinator: str, poller: Poller) -> None:
    before = jobs_json(coordinator)
    stub = pb_grpc.ClientServiceStub(grpc.insecure_channel(coordinator))
    request = (pb.SubmitJobRequest if rpc == "SubmitJob" else pb.PlanJobRequest)(spec_yaml=HOSTILE[case],
                                                                                  source=f"{case}.yaml")
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, rpc)(request, timeout=120)
    took = time.monotonic() - start
    print(f"raw {rpc} {case}: {err.value.code().name} in {took * 1000:.0f} ms: {err.value.details()}")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and EXPECTED[case] in err.value.details()
    assert len(err.value.details()) < 1000
    assert jobs_json(coordinator) == before


def test_ctl_plan_refuses_a_world_of_2_to_the_32() -> None:
    import subprocess

    start = time.monotonic()
    out = subprocess.run(CTL + ["plan", "--world-size", "4294967296"], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    print(f"ctl plan --world-size 4294967296: exit {out.returncode} in {took:.2f} s: {out.stderr.strip()}")
    assert out.returncode == 2 and "exceeds the maximum of 1048576 ranks" in out.stderr, out.stderr   # before a layout


@pytest.mark.parametrize("name, content, words", [
    ("latin1.yaml", b"name: caf\xe9\nkind: comm-check\n", ["not UTF-8 text", "byte offset 9", "latin1.yaml"]),
    ("deep.yaml", b"name: deep\nx: " + b"[" * 10_000 + b"]" * 10_000 + b"\n", ["the limit of 32 levels"]),
    ("newline.yaml", b'name: "abc\\n"\nkind: comm-check\n', ["name (got 'abc\\n')"]),
    ("inf.yaml", b"name: lr\ntrain: {lr: .inf}\n", ["train.lr (got inf): must be a finite number"]),
])
def test_bad_files_are_user_errors(name: str, content: bytes, words: list[str], coordinator: str,
                                   tmp_path: Path) -> None:
    job = tmp_path / name
    job.write_bytes(content)
    for command in ("submit", "plan"):
        out, took = timed_ctl(coordinator, command, str(job))
        print(f"ctl {command} {name}: exit {out.returncode} in {took:.2f} s: {out.stderr.strip()}")
        assert out.returncode == 2 and "internal error" not in out.stderr, out.stderr
        assert all(w in out.stderr for w in words), out.stderr
    if name != "latin1.yaml":  # the wire carries text: the coordinator parses the same bytes
        stub = pb_grpc.ClientServiceStub(grpc.insecure_channel(coordinator))
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=content.decode(), source=name), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words[-1] in err.value.details()


GARBAGE = b"\xff\xff\xff\xff"   # field 0x1fffffff, wire type 7: no protobuf parses it


def _services(address: str, names: list[str]) -> list[tuple[str, object]]:
    """(target, method descriptor) for every method of the named services, from the descriptors."""
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    files = (pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR)
    found = [s for f in files for s in f.services_by_name.values() if s.full_name in names]
    assert sorted(s.full_name for s in found) == sorted(names)
    return [(address, m) for s in found for m in s.methods]


def _send_garbage(target: str, method) -> grpc.RpcError:  # noqa: ANN001 - a MethodDescriptor
    """One call of ``method`` whose request is bytes that do not parse; the error it ends with."""
    name = f"/{method.containing_service.full_name}/{method.name}"
    raw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with grpc.insecure_channel(target) as channel:
        kind = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming else "unary")
        call = getattr(channel, kind)(name, **raw)
        request = iter([GARBAGE]) if method.client_streaming else GARBAGE
        with pytest.raises(grpc.RpcError) as err:
            answer = call(request, timeout=30)
            if method.server_streaming:
                list(answer)
    return err.value


def test_garbage_to_every_method_is_invalid_argument_naming_it_without_a_traceback(served, tmp_path: Path) -> None:
    """Every method of every service the coordinator and a worker daemon serve, sent a request that is not
    protobuf (twice): INVALID_ARGUMENT naming the method, and the servers log no traceback and at most one
    line per method (rate-limited)."""
    proc, address = served
    worker = start_worker(address, "g0", 1, tmp_path, idle_warm=False)
    try:
        started = wait_for(lambda: re.search(r'"health_port": (\d+).*"peer_port": (\d+)', worker.output()), 60,
                           "the worker's ports in its log")
        health, peer = (f"127.0.0.1:{port}" for port in started.groups())
        coordinator_log = len(proc.output())
        targets = (_services(address, ["rankctl.v1.ClientService", "rankctl.v1.NodeService", "grpc.health.v1.Health",
                                       "grpc.reflection.v1alpha.ServerReflection"])
                   + _services(health, ["grpc.health.v1.Health"]) + _services(peer, ["rankctl.v1.PeerService"]))
        for target, method in targets * 2:
            err = _send_garbage(target, method)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method.full_name, err.code(), err.details())
            assert f"/{method.containing_service.full_name}/{method.name}: the request is not a valid" in err.details()
        logs = proc.output()[coordinator_log:] + worker.output()
        assert "Traceback" not in logs and "Unexpected" not in logs
        lines = [line for line in logs.splitlines() if "rpc.malformed_request" in line]
        assert len(lines) == len(targets)   # once per method and server: the second round is not logged
    finally:
        worker.stop()
