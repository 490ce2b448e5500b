"""`python -m services.common.healthcheck HOST:PORT`: exit 0 when the gRPC server's overall
health is SERVING, 1 otherwise (container health checks)."""
from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        with grpc.insecure_channel(argv[0]) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.RpcError as err:
        print(f"unhealthy: {err.code().name}", file=sys.stderr)
        return 1
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
