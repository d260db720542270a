"""The OpenAI-compatible HTTP door: a FastAPI app over the same `Router`, served by uvicorn on the
gateway's own event loop beside grpc.aio (hybridgate.gateway.http_server).

Endpoints: POST /v1/chat/completions and /v1/completions (JSON, or server-sent
events with `stream`), POST /v1/embeddings, GET /v1/models (and /v1/models/{name}), GET /health (200 only while a worker is
READY and the gateway is not draining), GET /metrics (the gateway's Prometheus
registry), POST /tokenize and /detokenize (vLLM's shapes), and the schema at
/openapi.json. Every route but /health wants the bearer token when one is set, and a body is at most
4 MiB (hybridgate.gateway.http_guard, in front of the app). Shapes follow the OpenAI API reference; errors are the envelope
{"error": {"message", "type", "param", "code"}} with the status from the one
table in `hybridgate.gateway.errors`, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import math

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridgate.gateway import openai_api as api
from hybridgate.gateway.admission import Admission
from hybridgate.gateway.errors import DRAINING, DRAINING_RETRY_S, HTTP_OF, ROUTER_ERRORS, status_of
from hybridgate.gateway.http_guard import HttpGuard
from hybridgate.gateway.http_stream import EventStream, Run
from hybridgate.gateway.metrics import GatewayMetrics
from hybridgate.gateway.models import ModelNotFoundError, ModelTable, ServedModel
from hybridgate.gateway.openai_format import ChoiceState, Formatter
from hybridgate.router import ResourceExhaustedError, Router
from hybridgate.router.deltas import poller
from hybridgate.router.errors import ContextLengthError
from hybridgate.router.prompts import DEFAULT_MAX_TOKENS_CAP
from hybridgate.wire import InvalidFieldError

log = logging.getLogger("hybridgate.gateway")
INLINE_IDS = 4096  # /detokenize decodes at most this many ids on the event loop (about a millisecond)


class ApiError(Exception):
    """An answer other than 200: HTTP status, OpenAI type, message, param, code; `headers` (Retry-After)."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers or {}

    def envelope(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.envelope(), status_code=self.status, headers=self.headers)


def api_error(exc: BaseException, body=None, retry_ms: int | None = None) -> ApiError:
    """The HTTP answer to a router error, through the one gRPC table."""
    status, kind = HTTP_OF.get(status_of(exc), (500, "server_error"))
    if isinstance(exc, InvalidFieldError):
        param = api.param_of(exc.field, body) if body is not None else exc.field
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
        message = str(exc)
        if exc.field in ("constraint", "prompt") and param != exc.field:  # the request's own field, in the text too
            message = param + message[len(exc.field):]
        return ApiError(status, kind, message, param, code)
    headers = {"Retry-After": str(max(1, math.ceil(retry_ms / 1e3)))} if retry_ms is not None and status == 429 else None
    return ApiError(status, kind, str(exc), headers=headers)


class OpenAIApp:
    """The app and its handlers; `draining` turns /health to 503 while `serve` drains both doors.

    `router`: one router (answering to `model_names`, admitted by `admission`), or a `ModelTable` of
    several, where a request's `model` picks the row (404 `model_not_found` naming the served ones)."""

    def __init__(self, router: Router | ModelTable, metrics: GatewayMetrics, admission: Admission | None = None,
                 model_names: tuple[str, ...] = (), auth_token: str | None = None, log_requests: bool = False):
        self.table = router if isinstance(router, ModelTable) else \
            ModelTable.single(router, model_names, admission)
        self.metrics = metrics
        self.log_requests = log_requests  # one line per finished choice on `hybridgate.requests`, as gRPC's
        self.auth_token = auth_token  # GatewayConfig.auth_token: every endpoint but /health wants it (None: off)
        self.draining = False
        self.formats = {m.name: Formatter(m.router, m.name) for m in self.table}
        self.app = HttpGuard(self._build(), auth_token)  # token and body size before FastAPI reads anything

    @property
    def router(self) -> Router:
        """The default model's router."""
        return self.table.default.router

    @property
    def admission(self) -> Admission:
        """The default model's admission."""
        return self.table.default.admission

    @property
    def format(self) -> Formatter:
        """The default model's body builder."""
        return self.formats[self.table.default.name]

    def _build(self) -> FastAPI:
        app = FastAPI(title="hybridgate", summary="OpenAI-compatible API of a hybridgate gateway",
                      docs_url=None, redoc_url=None)
        app.add_exception_handler(ApiError, lambda request, exc: exc.response())
        app.add_exception_handler(RequestValidationError, self._on_validation_error)
        app.add_exception_handler(StarletteHTTPException, self._on_http_error)
        app.add_exception_handler(Exception, self._on_unexpected)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/v1/completions")(self.completions)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model:path}")(self.model)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.post("/v1/embeddings")(self.embeddings)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        return app

    # --- errors ----------------------------------------------------------------------------

    @staticmethod
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return ApiError(400, "invalid_request_error", "the request body is not valid JSON").response()
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request body")
        return ApiError(400, "invalid_request_error", message, param).response()

    @staticmethod
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, kind, str(exc.detail)).response()

    @staticmethod
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return ApiError(500, "server_error", f"internal error ({type(exc).__name__})").response()

    def _check_model(self, name: str | None) -> ServedModel:
        """The row of the request's `model` (None: the default). Raises ApiError 404 model_not_found."""
        try:
            return self.table.pick(name)
        except ModelNotFoundError as exc:
            raise ApiError(404, "invalid_request_error", str(exc), "model", "model_not_found") from None

    # --- the plain endpoints -------------------------------------------------------------------

    def _model_card(self, name: str, m: ServedModel) -> dict:
        return {"id": name, "object": "model", "created": self.format.created, "owned_by": "hybridgate",
                "root": m.name, "max_model_len": m.router.max_model_len}

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card(name, m) for m in self.table for name in m.listed]}

    async def model(self, model: str) -> dict:
        """OpenAI's "retrieve model": the card of one served name (or alias); 404 model_not_found naming the
        served ones otherwise."""
        if not model:
            raise ApiError(404, "invalid_request_error", "no model named ''", "model", "model_not_found")
        return self._model_card(model, self._check_model(model))

    async def health(self) -> Response:
        ok = self.table.ready and not self.draining
        return Response(status_code=200 if ok else 503)

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, body: api.TokenizeRequest) -> Response:
        """The prompt's ids through generation's own path and limits (`Router.encode_prompt`: a large
        prompt is encoded off the event loop, one over the limits refused naming the field); the answer
        is encoded by msgspec, since FastAPI's encoder walks 100,000s of ids one by one."""
        router = self._check_model(body.model).router
        try:
            if body.messages is not None:
                prompt = api.chat_messages(body)
            elif body.prompt is not None:
                prompt = body.prompt
            else:
                raise InvalidFieldError("prompt", "give prompt or messages")
            ids = await router.encode_prompt(prompt, body.add_generation_prompt)
        except InvalidFieldError as exc:
            raise api_error(exc) from None
        tokens = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return Response(msgspec.json.encode({"count": len(tokens), "max_model_len": router.max_model_len,
                                             "tokens": tokens}), media_type="application/json")

    async def detokenize(self, body: api.DetokenizeRequest) -> dict:
        """At most max_model_len ids (no sequence is longer), each in the vocabulary; many are decoded
        off the event loop."""
        router = self._check_model(body.model).router
        vocab, limit = router.tokenizer.vocab_size, router.max_model_len
        if len(body.tokens) > limit:
            raise ApiError(400, "invalid_request_error", f"tokens: at most {limit} ids (the max model length), "
                           f"got {len(body.tokens)}", "tokens")
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, "invalid_request_error", f"tokens: every id must be in [0, {vocab}), got {bad[0]}",
                           "tokens")
        if len(body.tokens) <= INLINE_IDS:
            return {"prompt": router.tokenizer.decode(body.tokens)}
        return {"prompt": await asyncio.to_thread(router.tokenizer.decode, body.tokens)}

    async def embeddings(self, body: api.EmbeddingRequest, request: Request) -> Response:
        """OpenAI's embeddings (`Router.embed`: each input a prefill-only request, no response cache); the
        request takes one admission slot whatever its number of inputs; a client that leaves aborts them."""
        if self.draining:
            raise ApiError(503, "service_unavailable_error", DRAINING, headers={"Retry-After": str(DRAINING_RETRY_S)})
        api.unknown_fields.note(body)
        served = self._check_model(body.model)
        try:
            inputs = api.embedding_inputs(body)
        except InvalidFieldError as exc:
            raise api_error(exc, body) from None
        if not served.admission.try_enter(1):
            self.metrics.of(served.name).rejected("max_inflight_requests")
            raise api_error(ResourceExhaustedError(
                f"the gateway holds at most {served.admission.limit} requests of model {served.name} "
                "(--max-inflight-requests)"), retry_ms=served.admission.pushback_ms())
        result = []
        try:
            work = served.router.embed(inputs, body.dimensions, label=body.user or "")
            if not await _unless_disconnected(_into(result, work), request):
                return Response(status_code=499)  # nobody reads it: its inputs were aborted
        except ROUTER_ERRORS as exc:
            raise api_error(exc, body, served.admission.pushback_ms()) from None
        finally:
            served.admission.leave(1)
        answer = api.embedding_body(result[0].vectors, result[0].prompt_tokens, body.model or served.name,
                                    body.encoding_format)
        return Response(msgspec.json.encode(answer), media_type="application/json")

    # --- generation ------------------------------------------------------------------------------

    async def chat(self, body: api.ChatCompletionRequest, request: Request) -> Response:
        def prepare():
            messages = api.chat_messages(body)
            return [messages], api.chat_logprobs_count(body)

        return await self._generate(body, request, prepare, chat=True, tools=lambda: api.tool_request(body))

    async def completions(self, body: api.CompletionRequest, request: Request) -> Response:
        def prepare():
            return api.completion_prompts(body), body.logprobs

        return await self._generate(body, request, prepare, chat=False)

    async def _generate(self, body, request: Request, prepare, chat: bool, tools=lambda: None) -> Response:
        if self.draining:
            raise ApiError(503, "service_unavailable_error", DRAINING, headers={"Retry-After": str(DRAINING_RETRY_S)})
        api.unknown_fields.note(body)
        served = self._check_model(body.model)
        admission, series = served.admission, self.metrics.of(served.name)
        try:
            api.refuse_unsupported(body)
            prompts, logprobs = prepare()
            base = api.sampling_params(body, logprobs, api.output_constraint(body, served.router.constraint_limits))
            tool_request = tools()
            states = []
            for p, prompt in enumerate(prompts):
                for i in range(body.n):
                    params = base if base.seed is None else _with_seed(base, base.seed + i)
                    stream = served.router.generate(prompt, params, label=body.user or "", tools=tool_request)
                    states.append(ChoiceState(p * body.n + i, stream, p, logprobs is not None, body.user or ""))
        except InvalidFieldError as exc:
            raise api_error(exc, body) from None
        cost = (base.max_tokens or DEFAULT_MAX_TOKENS_CAP, len(states))  # a slot per choice
        if not admission.try_enter(*cost):
            series.rejected("max_inflight_requests")
            raise api_error(ResourceExhaustedError(
                f"the gateway holds at most {admission.limit} requests of model {served.name}, a choice counting "
                f"as one (--max-inflight-requests); {admission.inflight} are in flight and this one asks for "
                f"{len(states)}"), retry_ms=admission.pushback_ms())
        run = Run(self, states, served)
        try:
            await run.enter()
        except BaseException as exc:
            await run.close()
            admission.leave(*cost)
            if isinstance(exc, ResourceExhaustedError):
                series.rejected(exc.reason)
            if isinstance(exc, ROUTER_ERRORS):
                raise api_error(exc, body, admission.pushback_ms()) from None
            raise
        kind = "chat" if chat else "text"
        if not body.stream:
            try:
                if not await _unless_disconnected(run.finish(), request):
                    return Response(status_code=499)  # nobody reads it: the choices were aborted
                return JSONResponse(self.formats[served.name].whole(kind, states))
            except ROUTER_ERRORS as exc:
                raise api_error(exc, body, admission.pushback_ms()) from None
            finally:
                await run.close()
                admission.leave(*cost)
        run.cost = cost
        return EventStream(self._sse(run, kind, body), run.release, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})

    async def _sse(self, run: Run, kind: str, body):
        """The event stream; leaving it early (the client went away) aborts every choice on its worker."""
        options = body.stream_options
        chunks = self.formats[run.served.name].chunks(kind, run.states, bool(options and options.include_usage),
                                    bool(options and options.continuous_usage_stats))
        try:
            for chunk in chunks.opening():
                yield chunk
            if len(run.states) == 1:  # one choice: its stream read here, with no generator between
                state = run.states[0]
                poll, arrival = poller(state.stream)
                delta = None
                while delta is None or delta.finish_reason is None:
                    delta = poll()
                    if delta is None:
                        await arrival()
                        continue
                    run.observe(state, delta)
                    state.add(delta)
                    for chunk in chunks.delta(state, delta):
                        yield chunk
            else:
                async for state, delta in run.deltas():
                    for chunk in chunks.delta(state, delta):
                        yield chunk
            for chunk in chunks.closing():
                yield chunk
        except StopAsyncIteration:  # a stream that ended without a last message, closed as `async for` did
            for chunk in chunks.closing():
                yield chunk
        except ROUTER_ERRORS as exc:
            yield chunks.error(api_error(exc, body).envelope())
        finally:
            await run.release()


async def _unless_disconnected(work, request: Request) -> bool:
    """Run `work` to its end (True), or stop it when the client disconnects first (False)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()
    return True


async def _into(out: list, work) -> None:
    out.append(await work)


def _with_seed(params, seed: int):
    return msgspec.structs.replace(params, seed=seed)
