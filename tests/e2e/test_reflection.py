"""A stock gRPC client that knows nothing of rankctl (no .proto, no rankctl_pb2) finds the API by
server reflection and calls it: what grpcurl, Postman or Evans do."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as wire
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from rankctl.coordinator.app.server import start_coordinator

pytestmark = pytest.mark.grpc_in_process
JOB = "name: waits\nkind: comm-check\nresources: {nodes: 1, slots_per_node: 2}\n"  # PENDING: no nodes


class V1Stub:
    """``grpc.reflection.v1.ServerReflection`` by its path (the messages are v1alpha's: the same wire form)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.ServerReflectionInfo = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=wire.ServerReflectionRequest.SerializeToString,
            response_deserializer=wire.ServerReflectionResponse.FromString)


class ReflectedClient:
    """Calls unary methods by name, with message classes built from the server's descriptors (``version``: the
    reflection service asked, "v1" as grpcurl and Postman do, or "v1alpha")."""

    def __init__(self, channel: grpc.Channel, version: str) -> None:
        self.channel = channel
        self.db = ProtoReflectionDescriptorDatabase(channel)
        if version == "v1":
            self.db._stub = V1Stub(channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)

    def call(self, service: str, method: str, **fields: Any) -> Any:
        desc = self.pool.FindServiceByName(service).methods_by_name[method]
        request, reply = (message_factory.GetMessageClass(t) for t in (desc.input_type, desc.output_type))
        rpc = self.channel.unary_unary(f"/{service}/{method}", request_serializer=request.SerializeToString,
                                       response_deserializer=reply.FromString)
        return rpc(request(**fields), timeout=10)


def explore(address: str, version: str) -> dict[str, Any]:
    """Everything a reflection-only client learns and gets back (runs in a thread: the client is blocking)."""
    with grpc.insecure_channel(address) as channel:
        client = ReflectedClient(channel, version)
        api = "rankctl.v1.ClientService"
        submitted = client.call(api, "SubmitJob", spec_yaml=JOB, queue_anyway=True).job
        job = client.call(api, "GetJob", job_id=submitted.id)
        schema = client.call(api, "GetJobSchema")
        state = job.DESCRIPTOR.fields_by_name["state"].enum_type.values_by_number[job.state].name
        return {"services": set(client.db.get_services()), "job": job, "state": state, "schema": schema,
                "file": client.pool.FindFileContainingSymbol(api).name,
                "reflection": client.pool.FindServiceByName("grpc.reflection.v1.ServerReflection").file.name}


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_a_reflection_only_client_lists_the_services_and_reads_a_job(tmp_path: Path, version: str) -> None:
    async def main() -> dict[str, Any]:
        coord = await start_coordinator("127.0.0.1:0", tmp_path, heartbeat_timeout=10.0)
        try:
            return await asyncio.wait_for(asyncio.to_thread(explore, coord.address, version), 30)
        finally:
            await coord.stop(grace=0.1)

    seen = asyncio.run(main())
    assert {"rankctl.v1.ClientService", "rankctl.v1.NodeService", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= seen["services"]
    assert seen["file"] == "rankctl/v1/rankctl.proto" and seen["reflection"] == "grpc/reflection/v1/reflection.proto"
    job = seen["job"]
    assert job.DESCRIPTOR.file.pool is not descriptor_pool.Default()  # not rankctl_pb2's classes
    assert job.name == "waits" and job.world_size == 2 and seen["state"] == "JOB_STATE_PENDING"
    assert "no nodes connected" in job.reason
    assert job.create_time.seconds > 0 and not job.HasField("finish_time")
    assert "created_at" not in job.DESCRIPTOR.fields_by_name                 # no unix-seconds double beside it
    assert job.spec.fields["resources"].struct_value.fields["slots_per_node"].number_value == 2  # a Struct, not JSON text
    schema = json.loads(seen["schema"].schema_json)
    assert "comm_check" in schema["properties"] and seen["schema"].version.startswith("sha256:")
