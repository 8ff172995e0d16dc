"""Container HEALTHCHECK: exit 0 when the worker daemon's gRPC health service says SERVING for the
node as a whole (service "": registered with the coordinator, launcher alive).

Address: RANKCTL_HEALTH_ADDRESS (default 127.0.0.1:7421, the image's --health-listen). With
RANKCTL_TLS_DIR (the node's identity directory) the check speaks TLS and trusts that CA, as the
daemon's health service then does (it asks for no client certificate).
"""

import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rankctl.security.certs import CA, PEER_SAN

address = os.environ.get("RANKCTL_HEALTH_ADDRESS", "127.0.0.1:7421")
tls_dir = os.environ.get("RANKCTL_TLS_DIR")
if tls_dir:
    creds = grpc.ssl_channel_credentials(root_certificates=(Path(tls_dir) / CA).read_bytes())
    channel = grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", PEER_SAN)])
else:
    channel = grpc.insecure_channel(address)
try:
    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                       timeout=4)
except grpc.RpcError as exc:
    sys.exit(f"worker health {address}: {exc.code().name}")
sys.exit(0 if answer.status == health_pb2.HealthCheckResponse.SERVING else f"worker health {address}: "
         f"{health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}")
