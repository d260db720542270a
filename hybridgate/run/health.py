"""`hybridgate health`: exit 0 when a gateway's gRPC health says SERVING, or a worker answers READY.

    hybridgate health                                  # the gateway at --host/--port (HYBRIDGATE_HOST, _PORT)
    hybridgate health --target gateway:50051 --service hybridgate.v1.Generation
    hybridgate health --worker tcp://127.0.0.1:5555    # a worker: CONNECT, then HELLO and READY over ZeroMQ

For container health checks (the Dockerfile's HEALTHCHECK, compose.yaml): one line on stdout, exit status 0
(serving / ready) or 1 (anything else, within `--timeout`). Loads no model.
"""

from __future__ import annotations

import argparse
import asyncio
import time


def gateway_status(target: str, service: str, timeout_s: float, tls_ca: str | None = None) -> str:
    """The health service's status name for `service` ("SERVING", "NOT_SERVING", ...), or the gRPC error's
    status name ("UNAVAILABLE" when nothing listens). `tls_ca`: connect over TLS trusting that PEM file."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hybridgate.client import open_channel

    with open_channel(target, tls_ca) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def worker_state(endpoint: str, timeout_s: float, curve_key: str | None = None) -> str:
    """The state a router reaches with the worker at `endpoint` within `timeout_s` ("READY", "CONNECTING",
    ...): the router's own client and lifecycle, without a model (HELLO's fingerprint is not checked).
    `curve_key`: the deployment's CURVE key file, for a worker on tcp:// with CURVE (without it, plain)."""
    from hybridgate.security.keys import Transport, TransportConfig
    from hybridgate.router.client import ZmqWorkerClient
    from hybridgate.wire import WorkerState

    changed = asyncio.Event()
    transport = Transport(TransportConfig(curve_key=curve_key, insecure_tcp=True))  # a probe sends no request
    client = ZmqWorkerClient(endpoint, dead_after_s=max(timeout_s, 1.0), transport=transport)
    await client.start(lambda c, msg: changed.set())
    deadline = time.monotonic() + timeout_s
    try:
        while client.state != WorkerState.READY and time.monotonic() < deadline:
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                break
        return client.state.name
    finally:
        await client.close()


def add_health_parser(sub) -> None:
    from hybridgate.settings import TARGET_HELP, add_command_settings

    health = sub.add_parser("health", help="exit 0 when a gateway is SERVING (gRPC health) or a worker is READY")
    health.add_argument("--target", default=None, help=TARGET_HELP)
    add_command_settings(health, "health")
    health.add_argument("--service", default="", help="the health service name to ask about (default: the "
                                                      "server as a whole, \"\")")
    health.add_argument("--worker", default=None, metavar="ENDPOINT",
                        help="check a worker instead (tcp://HOST:PORT or ipc://PATH): READY over ZeroMQ")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    health.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="the gateway serves TLS: trust the CA certificates in this PEM file (default: plaintext)")
    health.add_argument("--curve-key", default=None, metavar="FILE",
                        help="with --worker on tcp://: the deployment's CURVE key file (mode 0600), as the worker's")
    health.set_defaults(func=run_health)


def run_health(args: argparse.Namespace) -> int:
    if not args.timeout > 0:
        raise ValueError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    if args.worker:
        state = asyncio.run(worker_state(args.worker, args.timeout, args.curve_key))
        print(f"worker {args.worker}: {state}")
        return 0 if state == "READY" else 1
    from hybridgate.client import gateway_target

    target = gateway_target(args)
    status = gateway_status(target, args.service, args.timeout, args.tls_ca)
    print(f"gateway {target}{f' service {args.service}' if args.service else ''}: {status}")
    return 0 if status == "SERVING" else 1
