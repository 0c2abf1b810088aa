#!/venv/bin/python
"""Docker health check of a hotloop service; exit 0 when healthy, 1 when not.

`hotloop-healthcheck PORT`: the gRPC service on 127.0.0.1:PORT reports SERVING.
`hotloop-healthcheck --http PORT PATH`: GET http://127.0.0.1:PORT/PATH answers 200 (the
gateway's `/ready`: at least one rollout replica can serve).
"""
import sys
import urllib.error
import urllib.request

if sys.argv[1] == "--http":
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[2]}{sys.argv[3]}", timeout=3) as r:
            sys.exit(0 if r.status == 200 else 1)
    except (urllib.error.URLError, OSError):  # HTTPError (a 503) is a URLError
        sys.exit(1)

import grpc  # noqa: E402 - only the gRPC check needs it
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

with grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}") as ch:
    try:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.RpcError:
        sys.exit(1)
sys.exit(0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1)
