"""Start-up latency through the real ``ctl``, coordinator and daemon (issue 23, item 1).

``ctl submit --wait`` returns with the job's end, and a follower of the job's event batches gets that end
at once even under a ``min_interval`` of an hour (it used to come up to ``min_interval`` after the previous
batch: ``--wait`` asked for 1 s and returned up to a second late). Figures: ``bench/startup.py``.
"""

from __future__ import annotations

import json

import grpc
import pytest

from cluster import ProcCluster, ctl, status
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc

SLOTS = 4
JOB = f"""
name: startup
kind: comm-check
resources: {{nodes: 1, slots_per_node: {SLOTS}}}
backend: gloo
comm_check: {{size_bytes: 1024, iters: 1, warmup: 0}}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("e2e-startup")
    (root / "job.yaml").write_text(JOB)
    c = ProcCluster(root, ["n0"], SLOTS)
    yield c
    c.stop()


def test_submit_wait_returns_the_final_status_of_the_job(cluster: ProcCluster) -> None:
    out = ctl(cluster.address, "submit", "--wait", "--json", str(cluster.root / "job.yaml"), timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["state"] == "SUCCEEDED" and doc["world_size"] == SLOTS, doc


def test_a_follower_gets_the_jobs_end_at_once_under_an_hours_min_interval(cluster: ProcCluster) -> None:
    job = cluster.submit(str(cluster.root / "job.yaml"))
    with grpc.insecure_channel(cluster.address) as channel:
        stub = rankctl_pb2_grpc.ClientServiceStub(channel)
        batches = list(stub.WatchJobBatches(pb.WatchJobRequest(job_id=job, min_interval=3600.0), timeout=120))
    assert batches[-1].state == pb.JOB_STATE_SUCCEEDED  # not DEADLINE_EXCEEDED after an hour's wait
    assert status(cluster.address, job)["state"] == "SUCCEEDED"
