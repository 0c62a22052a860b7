"""`python -m services.common.rpc.healthcheck HOST:PORT`: exit 0 when the server's gRPC health Check says SERVING.

Container health checks (docker compose) run it; Kubernetes probes speak the same protocol natively.
Exit codes: 0 SERVING, 1 anything else (NOT_SERVING, unreachable, timed out), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, *, service: str = "", timeout_s: float = 3.0) -> str:
    """The status name the server reports for `service` ("" = the whole server), or the RPC error code."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.rpc.healthcheck",
                                     description="gRPC health check: exit 0 if SERVING")
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    args = parser.parse_args(argv)
    status = check(args.address, service=args.service, timeout_s=args.timeout)
    if status != "SERVING":
        print(f"{args.address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
