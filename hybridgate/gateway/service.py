"""The `hybridgate.v1.Generation` servicer on grpc.aio."""

from __future__ import annotations

import logging
import time

import grpc

from hybridgate.gateway.convert import delta_to_proto, request_to_native
from hybridgate.gateway.metrics import GatewayMetrics
from hybridgate.models import DEFAULT_MODEL_ID
from hybridgate.router import FingerprintMismatchError, Router, UnavailableError, WorkerRequestError
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from hybridgate.wire import InvalidFieldError, WorkerState

log = logging.getLogger("hybridgate.gateway")

_STATUS_OF = {
    InvalidFieldError: grpc.StatusCode.INVALID_ARGUMENT,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
    FingerprintMismatchError: grpc.StatusCode.UNAVAILABLE,
    WorkerRequestError: grpc.StatusCode.INTERNAL,
}


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, router: Router, metrics: GatewayMetrics, model_id: str = DEFAULT_MODEL_ID,
                 allow_client_routes: bool = False):
        self.router, self.metrics, self.model_id = router, metrics, model_id
        self.allow_client_routes = allow_client_routes

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        start = time.monotonic()
        try:
            prompt, params = request_to_native(request)
            stream = self.router.generate(prompt, params, label=request.label, route=self._route(request))
        except InvalidFieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        last = None
        try:
            # A cancelled call or an expired deadline raises CancelledError in here;
            # leaving the `async with` sends the abort to the worker.
            async with stream:
                async for delta in stream:
                    now = time.monotonic()
                    if last is None:
                        self.metrics.ttft.observe(now - start)
                    elif delta.token_ids:
                        self.metrics.itl.observe((now - last) / len(delta.token_ids))
                    last = now
                    if delta.finish_reason is not None:
                        self.metrics.e2e.observe(now - start)
                        self.metrics.success.labels(delta.finish_reason.name.lower()).inc()
                    yield delta_to_proto(delta)
        except tuple(_STATUS_OF) as exc:
            code = next(c for t, c in _STATUS_OF.items() if isinstance(exc, t))
            await context.abort(code, str(exc))

    def _route(self, request: pb.GenerateRequest) -> str:
        """The request's route; one other than auto only from a gateway run with --allow-client-routes."""
        route = request.route if request.HasField("route") else "auto"
        if route != "auto" and not self.allow_client_routes:
            raise InvalidFieldError("route", f"{route!r} is honoured only when the gateway runs with "
                                    "--allow-client-routes (an operator's setting); leave it unset or auto")
        return route

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        workers = [
            pb.WorkerInfo(endpoint=c.endpoint, kind=c.kind or "", ready=c.state == WorkerState.READY,
                          running=c.stats.running)
            for c in self.router.clients
        ]
        return pb.ModelInfo(model_id=self.model_id, fingerprint=self.router.fingerprint,
                            max_model_len=self.router.max_model_len, workers=workers)
