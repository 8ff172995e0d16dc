"""``python.env`` values are secrets (issue 24 item 5): clients see the keys with "<redacted>" values (SubmitJob,
GetJob, ListJobs, CancelJob, PlanJob), the log never holds them, and only the Assign to the job's node does."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
from structlog.testing import capture_logs

from rankctl.coordinator.api.convert import REDACTED
from rankctl.proto import from_struct
from rankctl.proto import rankctl_pb2 as pb
from rankctl.proto import rankctl_pb2_grpc
from test_servicer import FakeDaemon, run

SECRET = "s3cret-token-value-8c1f"
JOB = f"""
name: env
kind: python
resources: {{nodes: 1, slots_per_node: 2}}
backend: gloo
python: {{entrypoint: main.py, env: {{API_TOKEN: {SECRET}, MODE: fast}}}}
"""


def test_env_values_reach_only_the_assign_and_never_a_client_or_the_log(tmp_path: Path) -> None:
    async def test(coord, channel: grpc.aio.Channel) -> dict:  # noqa: ANN001
        client = rankctl_pb2_grpc.ClientServiceStub(channel)
        seen = {"plan": (await client.PlanJob(pb.PlanJobRequest(spec_yaml=JOB))).spec}
        daemon = FakeDaemon(channel)
        await daemon.expect("registered")
        submitted = (await client.SubmitJob(pb.SubmitJobRequest(spec_yaml=JOB))).job
        seen["submit"] = submitted.spec
        assign = await daemon.expect("assign")
        seen["get"] = (await client.GetJob(pb.GetJobRequest(job_id=submitted.id))).spec
        seen["list"] = (await client.ListJobs(pb.ListJobsRequest())).jobs[0].spec
        seen["cancel"] = (await client.CancelJob(pb.CancelJobRequest(job_id=submitted.id))).job.spec
        daemon.close()
        return {"assign": json.loads(assign.spec_json), **{k: from_struct(v) for k, v in seen.items()}}

    with capture_logs() as logs:
        seen = run(test, tmp_path)
    assert seen.pop("assign")["python"]["env"] == {"API_TOKEN": SECRET, "MODE": "fast"}
    for where, spec in seen.items():
        assert spec["python"]["env"] == {"API_TOKEN": REDACTED, "MODE": REDACTED}, where
        assert SECRET not in json.dumps(spec), where
    assert logs and SECRET not in repr(logs)


def test_a_kind_declares_its_own_secret_fields_and_clients_never_see_their_values() -> None:
    """Issue 44 item 3: which fields are secret is a kind's declaration (``JobKind.secrets``), not a ``python.env``
    special case in the coordinator: a scalar is redacted whole, a mapping's values are (its keys stay); an absent
    or empty field is left as it is, and a kind that declares none shows its spec unchanged."""
    from rankctl.coordinator.api.convert import public_spec
    from rankctl.kinds import registry
    from rankctl.kinds.registry import JobKind

    registry.register(JobKind(name="vaulted", secrets=("vault.token", "vault.headers", "vault.missing")))
    try:
        spec = {"kind": "vaulted", "vault": {"token": "t0k3n", "headers": {"X-Key": "k3y"}, "url": "https://x"}}
        shown = public_spec(spec)
        assert shown["vault"] == {"token": REDACTED, "headers": {"X-Key": REDACTED}, "url": "https://x"}
        assert spec["vault"]["token"] == "t0k3n"                               # the stored spec is not changed
        assert public_spec({"kind": "vaulted", "vault": {"token": ""}})["vault"] == {"token": ""}
        assert public_spec({"kind": "comm-check", "vault": {"token": "t"}})["vault"] == {"token": "t"}
    finally:
        registry.unregister("vaulted")
