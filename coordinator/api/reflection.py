"""Server reflection under both names clients look for: ``grpc.reflection.v1.ServerReflection`` (grpcurl and
Postman try it first) and ``grpc.reflection.v1alpha.ServerReflection``.

grpcio-reflection ships only the v1alpha servicer. The two services are wire-identical apart from the package
name, so the same servicer is registered under the v1 name too, and a v1 descriptor (v1alpha's, renamed) goes
into the pool so that reflection can describe itself under either name.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb2

V1ALPHA = reflection.SERVICE_NAME                      # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection of ``service_names`` (and of both reflection services) under v1 and v1alpha."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer((*service_names, V1, V1ALPHA))
    handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=alpha_pb2.ServerReflectionResponse.SerializeToString)}
    for name in (V1, V1ALPHA):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """v1alpha's file descriptor with the v1 package and file name, once per pool."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()
    for message in proto.message_type:
        for f in message.field:
            if f.type_name:
                f.type_name = f.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type, method.output_type = method.input_type.replace(old, new), method.output_type.replace(old, new)
    pool.Add(proto)
