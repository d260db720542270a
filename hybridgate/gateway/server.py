"""The gateway server: Generation, grpc.health.v1 and reflection on grpc.aio, metrics over HTTP."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from hybridgate.config import setting
from hybridgate.gateway.metrics import GatewayMetrics
from hybridgate.gateway.service import GenerationService
from hybridgate.router import Router
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("hybridgate.gateway")

MAX_MESSAGE_BYTES = 4 << 20
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    grace_s: float = 10.0
    allow_client_routes: bool = setting(
        False, "honour a request's `route` field (gpu, cpu, gpu->cpu): an operator's tool and the tests' handle; "
               "without it a route other than auto is INVALID_ARGUMENT")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")


class Gateway:
    """A started gRPC server around a router; `port` is the bound port (0 picks a free one)."""

    def __init__(self, router: Router, config: GatewayConfig):
        self.router, self.config = router, config
        self.metrics = GatewayMetrics(lambda: router.clients, handoff=lambda: router.handoff_metrics)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # a second server on a taken port fails instead of sharing it
        ])
        service = GenerationService(router, self.metrics, allow_client_routes=config.allow_client_routes)
        pb_grpc.add_GenerationServicer_to_server(service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        try:
            self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        except RuntimeError:  # grpc's "Failed to bind"
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {config.host}:{config.port}: the address is in use or not this "
                          "machine's (--host, --port)")
        self.metrics_port: int | None = None

    async def start(self) -> None:
        await self.set_serving(self.router.ready)
        await self.server.start()
        if self.config.metrics_port is not None:
            httpd, _ = start_http_server(self.config.metrics_port, self.config.host, registry=self.metrics.registry)
            self.metrics_port = httpd.server_port
            self._httpd = httpd

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def on_ready_change(self, ready: bool) -> None:
        """For `Router(on_ready_change=...)`: health follows the workers."""
        asyncio.get_running_loop().create_task(self.set_serving(ready))

    async def stop(self) -> None:
        """Health NOT_SERVING, then in-flight streams get `grace_s` to finish."""
        await self.set_serving(False)
        await self.server.stop(self.config.grace_s)
        if getattr(self, "_httpd", None) is not None:
            self._httpd.shutdown()
