"""The `hybridgate.v1.Generation` servicer on grpc.aio."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from hybridgate.gateway.admission import Admission
from hybridgate.gateway.config import GatewayConfig
from hybridgate.gateway.convert import ResponseEncoder, embed_inputs_to_native, request_to_native, tools_to_native
from hybridgate.gateway.metrics import GatewayMetrics
from hybridgate.gateway.models import ModelNotFoundError, ModelTable, ServedModel
from hybridgate.router.prompts import DEFAULT_MAX_TOKENS_CAP
from hybridgate.gateway.errors import DRAINING, ROUTER_ERRORS, status_of
from hybridgate.router import ResourceExhaustedError, Router
from hybridgate.router.deltas import poller
from hybridgate.router.tools import ToolCallStream
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.v1 import generation_pb2_grpc as pb_grpc
from hybridgate.wire import InvalidFieldError, WorkerState

log = logging.getLogger("hybridgate.gateway")
request_log = logging.getLogger("hybridgate.requests")



@dataclass
class _Outcome:
    """How one request went, as the gateway saw it (for the metrics and the request log)."""

    start: float
    first: float | None = None  # monotonic time of the first response
    finish: str | None = None  # "stop", "length", "eos", "abort" (None: cut short by an error)
    route: str = ""
    status: grpc.StatusCode = grpc.StatusCode.OK


PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRFC A6: the trailer gRPC's retry policy reads
MAX_MESSAGE_BYTES = 4 << 20  # the gRPC server's largest message either way (DESIGN.md, Limits)


class GenerationService(pb_grpc.GenerationServicer):
    """`log_requests`: one line per finished request on the `hybridgate.requests` logger;
    `log_request_text` adds the prompt (off: prompts stay out of logs unless asked).
    `router`: one router, or a `ModelTable` of several (the request's `model` picks one; NOT_FOUND
    naming the served ones for another). `model_id`: a single router's served name (default:
    `hybridgate.models.model_names` of its model: its file's stem, its general.name as an alias).
    `max_inflight_requests`: a single router's requests accepted and not yet finished (a table's rows
    carry their own admission); one more is refused at once with RESOURCE_EXHAUSTED and a
    `grpc-retry-pushback-ms` trailer (hybridgate.gateway.admission)."""

    def __init__(self, router: Router | ModelTable, metrics: GatewayMetrics, model_id: str | None = None,
                 log_requests: bool = False, log_request_text: bool = False,
                 allow_client_routes: bool = False, max_inflight_requests: int = GatewayConfig.max_inflight_requests):
        self.models = router if isinstance(router, ModelTable) else \
            ModelTable.single(router, (model_id,) if model_id else (), max_inflight_requests=max_inflight_requests)
        self.metrics = metrics
        self.log_requests, self.log_request_text = log_requests, log_request_text
        self.allow_client_routes = allow_client_routes
        self.draining = False  # set by the gateway's drain: new calls get UNAVAILABLE

    @property
    def router(self) -> Router:
        """The default model's router."""
        return self.models.default.router

    @property
    def admission(self) -> Admission:
        """The default model's admission."""
        return self.models.default.admission

    async def _pick(self, name: str | None, context: grpc.aio.ServicerContext) -> ServedModel:
        try:
            return self.models.pick(name)
        except ModelNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    async def _refuse(self, context: grpc.aio.ServicerContext, reason: str, message: str,
                      served: ServedModel) -> None:
        """RESOURCE_EXHAUSTED now, with the retry pushback; counted under `reason`."""
        self.metrics.of(served.name).rejected(reason)
        pushback = served.admission.pushback_ms()
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message}; retry in {pushback} ms",
                            trailing_metadata=((PUSHBACK_KEY, str(pushback)),))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        outcome = _Outcome(time.monotonic())
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        served = self.models.default if not request.HasField("model") else await self._pick(request.model, context)
        series, admission = self.metrics.of(served.name), served.admission
        try:
            prompt, params = request_to_native(request, served.router.constraint_limits)
            tools = tools_to_native(request)
            if tools is not None and isinstance(prompt, str):
                raise InvalidFieldError("tools", "need a chat input, not a raw prompt")
            stream = served.router.generate(prompt, params, label=request.label, route=self._route(request),
                                            deadline_s=context.time_remaining(), tools=tools)
        except InvalidFieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # Admission sits here, in the handler, before any await (a named model's lookup awaits only
        # to refuse): 40 calls that arrive together see the count of those admitted before them.
        cost = params.max_tokens or DEFAULT_MAX_TOKENS_CAP
        if not admission.try_enter(cost):
            await self._refuse(context, "max_inflight_requests",
                               f"the gateway holds {admission.limit} requests of model {served.name}, its limit "
                               "(--max-inflight-requests)", served)
        last, encode, clock = None, ResponseEncoder(stream.request_id).encode, time.monotonic
        observe_itl, count, streamed = series.itl.observe, series.streamed, admission.streamed  # per message
        poll, arrival = poller(stream)
        try:
            # A cancelled call or an expired deadline raises CancelledError in here;
            # leaving the `async with` sends the abort to the worker.
            async with stream:
                while True:
                    delta = poll()
                    if delta is None:
                        await arrival()
                        continue
                    now, n = clock(), len(delta.token_ids)
                    if last is None:
                        outcome.first = now
                        series.ttft.observe(now - outcome.start)
                        series.first_token(len(stream.prompt_ids))
                    elif n:
                        observe_itl((now - last) / n)
                    last = now
                    streamed(n, now)
                    count(n)
                    if delta.finish_reason is None:
                        yield encode(delta)
                        continue
                    outcome.finish, outcome.route = delta.finish_reason.name.lower(), delta.route
                    series.e2e.observe(now - outcome.start)
                    series.finished(outcome.finish, len(stream.prompt_ids), len(stream.ids))
                    context.set_trailing_metadata(self._placement_metadata(stream, delta))
                    yield encode(delta, stream.calls if isinstance(stream, ToolCallStream) else ())
                    break
        except StopAsyncIteration:  # a stream that ended without a last message ends the call, as `async for` did
            pass
        except ResourceExhaustedError as exc:
            outcome.status = grpc.StatusCode.RESOURCE_EXHAUSTED
            await self._refuse(context, exc.reason, str(exc), served)
        except ROUTER_ERRORS as exc:
            outcome.status = status_of(exc)
            await context.abort(outcome.status, str(exc))
        except (asyncio.CancelledError, GeneratorExit):
            # grpc.aio cancels the call's task wherever it waits: inside this generator (the
            # router's queue: CancelledError) or in its own write of the last response, after
            # which the suspended generator is closed (GeneratorExit at the `yield`).
            outcome.status = grpc.StatusCode.CANCELLED
            raise
        finally:
            admission.leave(cost)
            # The client cancelled, or its deadline passed, before the last response.
            if outcome.status == grpc.StatusCode.CANCELLED and outcome.finish is None:
                outcome.finish = "abort"
                series.finished("abort", len(stream.prompt_ids), len(stream.ids))
            if self.log_requests:
                self._log(stream, request, prompt, outcome)

    def _placement_metadata(self, stream, delta) -> tuple[tuple[str, str], ...]:
        """The call's trailing metadata: the plan, the policy and its predicted TTFT beside the observed
        one (the router's, arrival to first token), in ms; the placement metrics are counted here."""
        observed_ms = delta.timings.ttft_ms if delta.timings is not None else 0.0
        placement = stream.placement
        if placement is None:  # a client's route (--allow-client-routes), or the response cache: no policy ran
            policy = "response-cache" if stream.plan in ("cache", "coalesced") else "client-route"
            return (("hybridgate-plan", stream.plan), ("hybridgate-policy", policy),
                    ("hybridgate-observed-ttft-ms", f"{observed_ms:.1f}"))
        self.metrics.observe_placement(placement, observed_ms / 1e3)
        return (("hybridgate-plan", placement.route), ("hybridgate-policy", placement.policy),
                ("hybridgate-predicted-ttft-ms", f"{placement.plan.ttft_s * 1e3:.1f}"),
                ("hybridgate-predicted-tpot-ms", f"{placement.plan.tpot_s * 1e3:.1f}"),
                ("hybridgate-observed-ttft-ms", f"{observed_ms:.1f}"))

    def _log(self, stream, request: pb.GenerateRequest, prompt, outcome: _Outcome) -> None:
        now = time.monotonic()
        ttft = f"{(outcome.first - outcome.start) * 1e3:.1f}" if outcome.first is not None else "-"
        route = outcome.route or (stream.client.kind or "" if stream.client is not None else "")
        line = (f"request id={stream.request_id} label={request.label!r} route={route or '-'} "
                f"prompt_tokens={len(stream.prompt_ids)} completion_tokens={len(stream.ids)} ttft_ms={ttft} "
                f"total_ms={(now - outcome.start) * 1e3:.1f} finish_reason={outcome.finish or 'error'} "
                f"status={outcome.status.name}")
        if self.log_request_text:
            line += f" prompt={prompt!r}"
        request_log.info("%s", line)

    def _route(self, request: pb.GenerateRequest) -> str:
        """The request's route; one other than auto only from a gateway run with --allow-client-routes."""
        route = request.route if request.HasField("route") else "auto"
        if route != "auto" and not self.allow_client_routes:
            raise InvalidFieldError("route", f"{route!r} is honoured only when the gateway runs with "
                                    "--allow-client-routes (an operator's setting); leave it unset or auto")
        return route

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """One vector per input (`Router.embed`); the call takes one admission slot whatever its inputs."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        served = self.models.default if not request.HasField("model") else await self._pick(request.model, context)
        try:
            inputs = embed_inputs_to_native(request)
        except InvalidFieldError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        dims = request.dimensions if request.HasField("dimensions") else served.router.model.config.hidden_size
        if len(inputs) * (4 * dims + 16) > MAX_MESSAGE_BYTES:  # packed float32s and each vector's tags and lengths
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(inputs)} vectors of {dims} floats pass "
                                f"the {MAX_MESSAGE_BYTES >> 20} MiB message limit; send fewer inputs per call")
        if not served.admission.try_enter(1):
            await self._refuse(context, "max_inflight_requests", f"the gateway holds {served.admission.limit} "
                               f"requests of model {served.name}, its limit (--max-inflight-requests)", served)
        try:
            result = await served.router.embed(inputs, request.dimensions if request.HasField("dimensions") else None,
                                               label=request.label, deadline_s=context.time_remaining())
        except ResourceExhaustedError as exc:
            await self._refuse(context, exc.reason, str(exc), served)
        except ROUTER_ERRORS as exc:
            await context.abort(status_of(exc), str(exc))
        finally:
            served.admission.leave(1)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=v) for v in result.vectors],
                                prompt_tokens=result.prompt_tokens)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        served = await self._pick(request.model if request.HasField("model") else None, context)
        info = _model_info(served)
        info.models.extend(_model_info(m) for m in self.models)
        return info


def add_to_server(service: GenerationService, server: grpc.aio.Server) -> None:
    """Register `service` as `add_GenerationServicer_to_server` does, except that Generate's responses go out
    as the bytes it yields (`ResponseEncoder`), without a serializer."""
    handlers = _GeneratedHandlers()
    pb_grpc.add_GenerationServicer_to_server(service, handlers)
    table = {**handlers.table, "Generate": handlers.table["Generate"]._replace(response_serializer=None)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(handlers.service, table),))
    server.add_registered_method_handlers(handlers.service, table)


class _GeneratedHandlers:
    """Stands for the server in the generated registration, to take its table of method handlers."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, table: dict) -> None:
        self.service, self.table = service, table


def _model_info(served: ServedModel) -> pb.ModelInfo:
    router = served.router
    workers = [
        pb.WorkerInfo(endpoint=c.endpoint, kind=c.kind or "", ready=c.state == WorkerState.READY,
                      running=c.stats.running, cpu_isa=c.hello.cpu_isa if c.hello is not None else "")
        for c in router.clients
    ]
    return pb.ModelInfo(model_id=served.name, fingerprint=router.fingerprint, max_model_len=router.max_model_len,
                        workers=workers, aliases=served.names[1:])
