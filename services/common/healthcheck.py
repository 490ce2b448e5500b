"""`python -m loramux_services.common.healthcheck HOST:PORT [TLS options]`: exit 0 when the gRPC
server's overall health is SERVING, 1 otherwise (container health checks). For a port
started with --tls-cert, give the client TLS options (loramux.tls: --tls-ca, or
$LORAMUX_TLS_CA, and for mTLS a client certificate)."""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loramux import tls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loramux_services.common.healthcheck")
    p.add_argument("address")
    tls.add_arguments(p)
    args = p.parse_args(argv)
    try:
        with tls.channel(args.address, tls.from_args(args)) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.RpcError as err:
        print(f"unhealthy: {err.code().name}", file=sys.stderr)
        return 1
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
