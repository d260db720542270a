"""The gateway server: Generation, grpc.health.v1 and reflection on grpc.aio, the OpenAI-compatible
HTTP API on the same event loop (hybridgate.gateway.http), metrics over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from hybridgate.gateway.config import GatewayConfig
from hybridgate.gateway.http import OpenAIApp
from hybridgate.gateway.http_server import HttpDoor
from hybridgate.gateway.metrics import GatewayMetrics, chained
from hybridgate.gateway.models import ModelTable
from hybridgate.gateway.security import BearerInterceptor, server_credentials
from hybridgate.gateway.service import MAX_MESSAGE_BYTES, GenerationService, add_to_server
from hybridgate.router import Router, UnavailableError
from hybridgate.router.handoff_metrics import HandoffMetrics
from hybridgate.v1 import generation_pb2 as pb

log = logging.getLogger("hybridgate.gateway")

CLOSE_S = 2.0  # after the grace period: for the streams cut then to send their last message
IDLE_POLL_S = 0.02  # how often a drain looks whether every request has finished
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class Gateway:
    """A started gRPC server around a router, or a `ModelTable` of several (one per served model);
    `port` is the bound port (0 picks a free one). `reuse_port`: bind with SO_REUSEPORT, beside this
    machine's other gateways of one `serve`.

    Health: the service names "" and hybridgate.v1.Generation are SERVING while some model has a READY
    worker; each served model's name is a service name of its own, SERVING while that model has one.

    Raises (here): OSError naming --host and --port when the port cannot be bound; the C
    core's own log line about it is kept off stderr, so the user reads one line.
    """

    def __init__(self, router: Router | ModelTable, config: GatewayConfig, reuse_port: bool = False):
        self.models = router if isinstance(router, ModelTable) else \
            ModelTable.single(router, config.served_model_name, max_inflight_requests=config.max_inflight_requests)
        self.router, self.config = self.models.default.router, config
        self.model_names = self.models.default.names
        routers = [m.router for m in self.models]
        caches = [r.response_cache for r in routers if r.response_cache is not None]
        # The router-wide series (wire errors, hand-offs, Redis, response cache) sum the models' routers.
        self.metrics = GatewayMetrics(chained(*(lambda r=r: r.clients for r in routers)),
                                      wire_errors=lambda: sum(r.wire_errors for r in routers),
                                      handoff=lambda: HandoffMetrics.summed([r.handoff_metrics for r in routers]),
                                      redis_up=lambda: _all_up([r.redis_up() for r in routers]),
                                      response_cache=caches or None,
                                      models=[(m.name, m.router.fingerprint, lambda r=m.router: r.clients)
                                              for m in self.models],
                                      constraint_check=[r.constraints for r in routers],
                                      max_model_len=max(r.max_model_len for r in routers))
        self.health = health.aio.HealthServicer()
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca) \
            if config.tls_cert else None  # read before anything binds: a bad file fails at once
        interceptors = [BearerInterceptor(config.auth_token)] if config.auth_token else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # A second server on a taken port fails instead of sharing it; `serve --gateways N` shares
            # it among its own gateways only (hybridgate.run.scaleout holds the port first).
            ("grpc.so_reuseport", int(reuse_port)),
        ])
        self.service = service = GenerationService(self.models, self.metrics, log_requests=config.log_requests,
                                    log_request_text=config.log_request_text,
                                    allow_client_routes=config.allow_client_routes)
        add_to_server(service, self.server)
        self.http: HttpDoor | None = None
        if config.http_port is not None:  # bound now, so a taken port fails before anything starts
            self.openai = OpenAIApp(self.models, self.metrics, auth_token=config.auth_token,
                                    log_requests=config.log_requests)
            tls = (config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls_cert else None
            self.http = HttpDoor(self.openai.app, config.host, config.http_port, CLOSE_S, reuse_port, tls)
        if config.log_requests:  # the request log shows at any --log-level
            logging.getLogger("hybridgate.requests").setLevel(logging.INFO)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        with _fd2_captured() as core_log:
            try:
                address = f"{config.host}:{config.port}"
                self.port = self.server.add_secure_port(address, credentials) if credentials is not None \
                    else self.server.add_insecure_port(address)
            except RuntimeError:  # grpc's "Failed to bind"
                self.port = 0
        if self.port == 0:
            # The C core's own line about it ("E... add_port.cc ... Failed to add port") would
            # precede ours and say less: it goes to the debug log.
            log.debug("gRPC: %s", core_log[0].strip())
            raise OSError(f"cannot listen on {config.host}:{config.port}: the address is in use or not this "
                          "machine's (--host, --port)")
        sys.stderr.write(core_log[0])
        self.metrics_port: int | None = None
        self._httpd = None
        self._lag_task: asyncio.Task | None = None
        self._health_tasks: set[asyncio.Task] = set()  # health changes under way; stop() cancels them
        self.draining = False

    async def start(self) -> None:
        """Serve metrics, then gRPC. Raises OSError naming the flag when the metrics port is taken
        (before the gRPC server starts, so nothing is left running on the way out)."""
        await self.set_serving()
        if self.config.metrics_port is not None:
            host, port = self.config.host, self.config.metrics_port
            try:
                httpd, _ = start_http_server(port, host, registry=self.metrics.registry)
            except OSError as exc:
                reason = exc.strerror or exc
                raise OSError(f"cannot serve metrics on {host}:{port}: {reason} (--metrics-port)") from None
            self.metrics_port = httpd.server_port
            self._httpd = httpd
        await self.server.start()
        self._lag_task = asyncio.get_running_loop().create_task(self.metrics.watch_loop_lag())
        if self.http is not None:
            await self.http.start()

    @property
    def http_port(self) -> int | None:
        """The HTTP API's bound port (None: off)."""
        return self.http.port if self.http is not None else None

    async def set_serving(self, serving: bool | None = None) -> None:
        """Every health service name from its model's readiness; `serving` False, or a drain begun: all
        NOT_SERVING."""
        def status(ready: bool):
            return health_pb2.HealthCheckResponse.SERVING if ready and serving is not False and not self.draining \
                else health_pb2.HealthCheckResponse.NOT_SERVING

        for name in ("", SERVICE_NAME):
            await self.health.set(name, status(self.models.ready))
        for model in self.models:
            for name in model.names:
                await self.health.set(name, status(model.router.ready))

    def on_ready_change(self, ready: bool) -> None:
        """For `Router(on_ready_change=...)` of each model's router: health follows the workers (a task
        the gateway holds until it is done, so that `stop` can cancel it: none may say SERVING after stop)."""
        task = asyncio.get_running_loop().create_task(self.set_serving())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    @property
    def inflight(self) -> int:
        """Requests of either door admitted and not yet finished (choices counted one by one)."""
        return sum(m.admission.inflight for m in self.models)

    async def _idle(self, timeout_s: float) -> bool:
        """Whether every request finishes within `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(min(IDLE_POLL_S, max(deadline - loop.time(), 0)))
        return not self.inflight

    async def stop(self) -> None:
        """Drain, then close (SIGINT/SIGTERM). Both doors keep their listeners and connections through the
        grace period (`grace_s`) and answer health NOT_SERVING (gRPC) and 503 (/health) at once; a new
        generation request is refused with UNAVAILABLE (HTTP 503 and Retry-After), the requests in flight
        go on. Those still running when the grace period ends get UNAVAILABLE (an SSE stream: an error
        event and [DONE]) and CLOSE_S to send it; then the servers stop."""
        self.draining = self.service.draining = True
        if self.http is not None:
            self.openai.draining = True
        for task in list(self._health_tasks):
            task.cancel()
        await asyncio.gather(*self._health_tasks, return_exceptions=True)
        await self.set_serving(False)
        if not await self._idle(self.config.grace_s):
            cut = UnavailableError(f"the gateway is shutting down and this request outlived its grace period "
                                   f"({self.config.grace_s:g} s, --grace-period)")
            for model in self.models:
                model.router.fail_all(cut)
            await self._idle(CLOSE_S)
        if self.http is not None:
            await asyncio.gather(self.server.stop(CLOSE_S), self.http.stop())
        else:
            await self.server.stop(CLOSE_S)
        if self._lag_task is not None:
            self._lag_task.cancel()
        if self._httpd is not None:  # its serve_forever polls every 0.5 s: wait for it off the loop
            await asyncio.to_thread(self._httpd.shutdown)


def _all_up(ups: list[bool | None]) -> bool | None:
    """Whether every router's last Redis calls succeeded (None: none has Redis, or none called yet)."""
    known = [u for u in ups if u is not None]
    return all(known) if known else None


@contextlib.contextmanager
def _fd2_captured():
    """Capture what is written to file descriptor 2 meanwhile (gRPC's C core logs there, not
    through Python); yields a list that holds the text once the block is left."""
    sys.stderr.flush()
    saved = os.dup(2)
    captured: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.append(tmp.read().decode("utf-8", errors="replace"))
