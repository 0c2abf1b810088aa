#!/venv/bin/python
"""Exit 0 when the gRPC service on 127.0.0.1:$1 reports SERVING (docker healthcheck)."""
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

with grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}") as ch:
    try:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.RpcError:
        sys.exit(1)
sys.exit(0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1)
