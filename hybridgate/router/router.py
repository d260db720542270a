"""The embeddable Router: prompt → ids → a worker → streamed text deltas.

    async with Router(model_path, [ZmqWorkerClient("ipc:///run/hg/w0")]) as router:
        async with router.generate("Hello", SamplingParams(max_tokens=32)) as stream:
            async for delta in stream:
                print(delta.text, end="")

Leaving the inner `async with` in any way (break, exception, cancellation)
sends the abort to the worker before `__aexit__` returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from hybridgate.models import ChatTemplate, GGUFModel, Tokenizer, load_gguf, model_fingerprint
from hybridgate.models.chat import template_token_ids
from hybridgate.clients.interface import StateChange, WorkerClient, WorkerDead
from hybridgate.router.client import RateLimitedLog, ZmqWorkerClient
from hybridgate.router.config import RouterConfig
from hybridgate.router.constraints import ConstraintCheck, ConstraintLimits
from hybridgate.router import embeddings
from hybridgate.router.embeddings import Embeddings
from hybridgate.router.errors import InvalidRequestError, UnavailableError
from hybridgate.router.handoff import PauseHook
from hybridgate.router.handoff_metrics import HandoffMetrics
from hybridgate.router.membership import Membership
from hybridgate.router.placement import Placement, Placer, _Pending
from hybridgate.router.policy import make_policy
from hybridgate.router.prompts import Prompt, Prompts, TokenIds, read_chat_template
from hybridgate.router.registry import RedisRegistry
from hybridgate.router.response_cache import ResponseCache
from hybridgate.router.stream import GenerationStream, Stalled, WorkerAvailable
from hybridgate.router.tools import ToolCallStream, ToolRequest, choose_format
from hybridgate.router.tools import plan as plan_tools
from hybridgate.wire import (
    MAX_STOP_TOKEN_IDS,
    HandoffExported,
    HandoffExportFailed,
    HandoffImported,
    HandoffRefused,
    HandoffReservation,
    Hello,
    Outputs,
    Overload,
    Ready,
    RequestError,
    SamplingParams,
)

log = logging.getLogger("hybridgate.router")

MAX_LABEL_BYTES = 256  # a request's label goes into logs and metrics' exemplars: short
RECENT_IDS = 4096  # ended request ids remembered, so late outputs for them are not counted as errors

# Where a request runs: "auto" is the placement policy's choice; "gpu->cpu" prefills on a
# GPU worker and hands the KV to a CPU worker that decodes (DESIGN.md, "KV hand-off").
ROUTES = ("auto", "gpu", "cpu", "gpu->cpu")




class Router:
    """Tokenizes, places, and streams; an async context manager over worker clients.

    `clients`: worker endpoints (`ipc://...`, `tcp://...`, each gets a
    `ZmqWorkerClient`) or client objects such as
    `hybridgate.workers.inprocess.InProcessClient`.

    A stream whose worker dies, restarts, stalls (no progress for
    `request_stall_timeout_s`), drops it or refuses it for lack of KV blocks is
    moved to another worker, resumed after the ids already streamed when
    `resume_on_worker_loss` (the table is in `GenerationStream`'s docstring).

    Raises (on entry): `UnavailableError` when no worker is READY within
    `startup_timeout_s` (the message names the setting), `FingerprintMismatchError`
    when every worker serves another model (naming both fingerprints).
    """

    def __init__(
        self,
        model: str | Path | GGUFModel,
        clients: Sequence[WorkerClient | str],
        config: RouterConfig | None = None,
        on_ready_change: Callable[[bool], None] | None = None,
        registry: RedisRegistry | None = None,
        response_cache: ResponseCache | None = None,
    ):
        self.model = model if isinstance(model, GGUFModel) else load_gguf(model)
        self.config = config or RouterConfig()
        self.tokenizer = Tokenizer.from_model(self.model)
        self.tokenizer.token_texts  # noqa: B018 (the detokenizers' shared table, made now rather than mid-stream)
        template = read_chat_template(self.config.chat_template)
        # Without a template (a base model): completions only; a chat names --chat-template.
        self.chat_template = ChatTemplate(self.tokenizer, template, template_token_ids(self.model.metadata))
        self.tool_format = choose_format(self.config.tool_call_format, template or self.tokenizer.chat_template,
                                         self.model.config.architecture)
        self.constraint_limits = ConstraintLimits.of(self.config)  # the doors build constraints within these
        # every constraint compiled once, on the check's own threads, before its request runs
        self.constraints = ConstraintCheck(threads=self.config.constraint_compile_threads,
                                           timeout_s=self.config.constraint_compile_timeout_s)
        self.fingerprint = model_fingerprint(self.model)
        self.max_model_len = min(self.config.max_model_len or 1 << 62, self.model.config.max_model_len)
        self.prompts = Prompts(str(self.model.path), self.tokenizer, self.chat_template, self.max_model_len,
                               self.config.prompt_processes, template)
        self.members = Membership([ZmqWorkerClient(c, dead_after_s=self.config.dead_after_s) if isinstance(c, str)
                                   else c for c in clients], self.fingerprint, on_ready_change)
        self.registry = registry  # workers found in Redis join and leave `clients` while the router runs
        self.response_cache = response_cache  # deterministic requests: replayed answers, shared generations
        self._streams: dict[str, GenerationStream] = {}  # by the request id on its worker
        self._waiting: dict[str, GenerationStream] = {}  # moved streams waiting for a READY worker
        self._stall_task: asyncio.Task | None = None
        self._handlers = {Hello: self.members.on_hello, Ready: lambda client, msg: None, Outputs: self._on_outputs,
                          RequestError: self._on_request_error, Overload: self._on_overload,
                          WorkerDead: self._on_dead, StateChange: self.members.on_state_change,
                          HandoffReservation: self._on_handoff, HandoffExported: self._on_handoff,
                          HandoffExportFailed: self._on_handoff, HandoffImported: self._on_handoff,
                          HandoffRefused: self._on_handoff}
        self.handoff_metrics = HandoffMetrics()
        self.handoff_pause = PauseHook.from_env()
        self._recent: dict[str, None] = {}  # ended request ids, oldest first
        self._unknown_ids = 0
        self._unknown_log = RateLimitedLog(log)
        mc = self.model.config
        self.placer = Placer(make_policy(self.config.policy, self.config.ttft_slo_s, self.config.tpot_slo_s),
                             self.fingerprint, kv_values_per_token=mc.kv_values_per_token,
                             handoff_rate=self.handoff_metrics.rate)

    async def __aenter__(self) -> Router:
        for client in self.clients:
            await client.start(self._on_message)
        self._stall_task = asyncio.create_task(self._watch_stalls())
        try:
            if self.registry is not None:
                await self.registry.start(self)
                if not self.clients:  # workers join later; health says NOT_SERVING until one is READY
                    return self
            await asyncio.wait_for(self.members.wait_usable(), self.config.startup_timeout_s)
        except asyncio.TimeoutError:
            await self.close()
            raise UnavailableError(f"no worker became READY within startup_timeout_s="
                                   f"{self.config.startup_timeout_s:g} s (raise it for slow starts)") from None
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def fail_all(self, exc: BaseException) -> None:
        """End every stream now with `exc` (its caller reads it next; leaving the stream aborts it)."""
        for stream in list(self._streams.values()):
            stream.fail(exc)

    async def close(self) -> None:
        self.fail_all(UnavailableError("the router is shutting down"))
        if self._stall_task is not None:
            self._stall_task.cancel()
            await asyncio.gather(self._stall_task, return_exceptions=True)
        if self.registry is not None:
            await self.registry.close()
        if self.response_cache is not None:
            await self.response_cache.close()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
        self.prompts.close()
        self.constraints.close()

    async def add_client(self, client: WorkerClient) -> None:
        """A worker joins while the router runs (the registry found it); placement sees it once READY."""
        self.members.add(client)
        await client.start(self._on_message)

    async def drop_client(self, client: WorkerClient, reason: str) -> None:
        """A worker leaves (its registry entry expired): its streams get WorkerDead (moved or failed), then
        the client is closed. Placement never sees it again."""
        if not self.members.remove(client):
            return
        for stream in list(self._streams.values()):
            if stream.client is client or (stream.handoff is not None and stream.handoff.active
                                          and stream.handoff.involves(client)):
                self._on_dead(client, WorkerDead(reason))
                break
        self.placer.drop(client)
        await client.close()
        self.members.changed()

    def redis_up(self) -> bool | None:
        """Whether the last Redis calls of the registry and the response cache succeeded (False when either
        failed); None without Redis or before the first call (the `redis_up` metric)."""
        ups = [self.registry.up if self.registry is not None else None,
               self.response_cache.up if self.response_cache is not None else None]
        known = [u for u in ups if u is not None]
        return all(known) if known else None

    @property
    def clients(self) -> list[WorkerClient]:
        return self.members.clients

    @property
    def ready(self) -> bool:
        return self.members.ready

    @property
    def on_ready_change(self) -> Callable[[bool], None]:
        """Called with the new readiness whenever "some worker is READY" flips (the gateway's health)."""
        return self.members.on_ready_change

    @on_ready_change.setter
    def on_ready_change(self, callback: Callable[[bool], None]) -> None:
        self.members.on_ready_change = callback

    @property
    def wire_errors(self) -> int:
        """Frames from workers dropped: undecodable, unexpected, or for request ids this router never sent."""
        return self._unknown_ids + sum(getattr(c, "wire_errors", 0) for c in self.clients)

    async def wait_settled(self, timeout_s: float) -> None:
        """Wait until no worker is still CONNECTING (each READY, DEAD or REFUSED), at most timeout_s."""
        await self.members.wait_settled(timeout_s)

    # --- requests -----------------------------------------------------------

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, label: str = "",
                 route: str = "auto", deadline_s: float | None = None,
                 tools: ToolRequest | None = None) -> GenerationStream:
        """A stream for one request; enter it with `async with` to send the request.

        `prompt` is raw text or chat messages (mappings with `role` and
        `content`). `route` is one of `ROUTES`: "auto" (placement decides),
        "gpu", "cpu", or "gpu->cpu" (GPU prefill, KV hand-off, CPU decode).
        Validation happens here: `InvalidRequestError` names the field and its
        limit. Entering the stream raises `UnavailableError` when no READY
        worker of the route's kind is there. `deadline_s`: seconds the caller
        will wait (a gRPC call's remaining time); a request whose deadline is
        shorter than every plan's predicted TTFT raises `DeadlineExceededError`
        on entry, before any work, and one still waiting on its worker when it
        passes is dropped there unrun (the same error). With a `response_cache`,
        a deterministic request (temperature 0 or a seed) gets a
        `response_cache.CachedStream` (same interface): a stored answer
        replayed, or a generation shared with identical requests in flight
        (which runs under the deadline of the request that started it).
        `tools`: a chat's tools (`hybridgate.router.tools`): rendered in the router's tool-call format,
        constrained by its grammar, and the stream is a `ToolCallStream` whose deltas carry the calls.
        A chat whose history holds calls or tool results needs no `tools` to render.
        """
        params = (params or SamplingParams()).validate()
        template_tools, new_parser = None, None
        chat = not isinstance(prompt, (str, TokenIds))
        if chat and (tools is not None or self.tool_format.channels or
                     any(m.get("tool_calls") or m.get("role") == "tool" for m in prompt)):
            prompt, template_tools, params, new_parser = self._with_tools(prompt, params, tools)
        bad = [t for t in params.stop_token_ids if t >= self.tokenizer.vocab_size]
        if bad:
            raise InvalidRequestError("stop_token_ids", f"every id must be in [0, {self.tokenizer.vocab_size}), "
                                      f"got {bad[0]}")
        params = self._with_end_of_turn(params)
        self.prompts.check(prompt)
        label_bytes = len(label.encode("utf-8", "replace"))
        if label_bytes > MAX_LABEL_BYTES:
            raise InvalidRequestError("label", f"at most {MAX_LABEL_BYTES} bytes, got {label_bytes} bytes")
        if route not in ROUTES:
            raise InvalidRequestError("route", f"must be one of {', '.join(ROUTES)}, got {route!r}")
        if deadline_s is not None and not deadline_s >= 0:
            raise InvalidRequestError("deadline_s", f"must be >= 0 seconds, got {deadline_s}")
        stream = GenerationStream(self, prompt, params, label, request_id=uuid.uuid4().hex, route=route,
                                  deadline_s=deadline_s)
        stream.template_tools = template_tools
        out = self.response_cache.wrap(stream) if self.response_cache is not None else stream
        return ToolCallStream(out, new_parser()) if new_parser is not None else out

    async def embed(self, inputs: Sequence[str | TokenIds], dimensions: int | None = None, label: str = "",
                    route: str = "auto", deadline_s: float | None = None) -> Embeddings:
        """One embedding per input, each a prefill-only request on the workers, pooled as the model's file (or
        RouterConfig.pooling) says, truncated to `dimensions` and L2-normalised (`hybridgate.router.embeddings`;
        no response cache). Raises InvalidRequestError naming the field before any work."""
        label_bytes = len(label.encode("utf-8", "replace"))
        if label_bytes > MAX_LABEL_BYTES:
            raise InvalidRequestError("label", f"at most {MAX_LABEL_BYTES} bytes, got {label_bytes} bytes")
        return await embeddings.embed(self, inputs, dimensions, label, route, deadline_s)

    def _with_tools(self, messages: Prompt, params: SamplingParams, tools: ToolRequest | None):
        """(messages, the template's tools, params with the calls' constraint, the output's parser class or None)
        of a chat with tools, a history of calls, or any chat in a format with channels. Raises
        InvalidRequestError when tools meet another constraint."""
        plan = plan_tools(self.tool_format, messages, tools, self.tokenizer.special_tokens)
        if plan.constraint is not None:
            if params.constraint is not None:
                raise InvalidRequestError("tools", "cannot be combined with another output constraint "
                                          f"({params.constraint.kind}) unless tool_choice is none")
            params = msgspec.structs.replace(params, constraint=plan.constraint)
        if plan.keep_special:
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        return plan.messages, plan.template_tools, params, plan.new_parser

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True, tools: ToolRequest | None = None) -> list[int]:
        """The prompt's ids, on this thread (`Prompts.tokenize`; a chat with `tools` rendered as `generate`
        renders it, as is any chat in a format with channels). Raises InvalidRequestError."""
        if not isinstance(prompt, (str, TokenIds)) and (tools is not None or self.tool_format.channels):
            plan = plan_tools(self.tool_format, prompt, tools, self.tokenizer.special_tokens)
            return self.prompts.tokenize(plan.messages, add_generation_prompt, plan.template_tools)
        return self.prompts.tokenize(prompt, add_generation_prompt)

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        """The ids that end the model's turn: the vocabulary's (`Tokenizer.stop_token_ids`), or EOS and the
        tool-call format's `turn_end` tokens where it names them (harmony's `<|end|>` ends a message only)."""
        ends = self.tool_format.turn_end
        if ends is None:
            return self.tokenizer.stop_token_ids
        special = self.tokenizer.special_tokens
        return frozenset({self.tokenizer.eos_token_id, *(special[t] for t in ends if t in special)}) - {-1}

    def _with_end_of_turn(self, params: SamplingParams) -> SamplingParams:
        """`params` with the vocabulary's end-of-turn ids (`Tokenizer.stop_token_ids` less EOS, which the worker
        stops on already: `<|eot_id|>`, `<end_of_turn>`, ...) among its stop token ids, unless it ignores EOS."""
        extra = self.end_of_turn_ids - {self.tokenizer.eos_token_id} - set(params.stop_token_ids)
        if params.ignore_eos or not extra:
            return params
        ids = params.stop_token_ids + tuple(sorted(extra))
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS - len(extra)} ids with this "
                                      f"model's {len(extra)} end-of-turn ids, got {len(params.stop_token_ids)}")
        return msgspec.structs.replace(params, stop_token_ids=ids)

    async def encode_prompt(self, prompt: Prompt, add_generation_prompt: bool = True) -> Sequence[int]:
        """The prompt's ids as a generation would have them: the same checks (`InvalidRequestError`
        naming the field and the limit), and a large prompt encoded off the event loop (`Prompts`)."""
        self.prompts.check(prompt)
        return await self.prompts.encode(prompt, add_generation_prompt)

    def resolve(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, int]:
        """(max_tokens, seed) for this request, checked against the model length (`Prompts.resolve`)."""
        return self.prompts.resolve(prompt_ids, params)

    def plan(self, prompt_ids: list[int], max_tokens: int, deadline_s: float | None = None, *,
             exclude: Sequence[WorkerClient] = (), streamed: Sequence[int] = (), kind: str | None = None,
             handoff: bool = True) -> Placement:
        """The placement policy's plan (RouterConfig.policy) over the READY workers not in `exclude` (and of
        `kind`, when given), for every placement of a request, first or later (`Placer.place`: `streamed`
        ids already sent to the caller, `handoff` whether a gpu->cpu plan may be chosen).

        Raises UnavailableError when no such worker is READY.
        """
        pending: dict[WorkerClient, list[_Pending]] = {}
        for stream in self._streams.values():
            if stream.client is not None and not stream.done:
                placed, whole = stream.placement, len(stream.prompt_ids) + stream.max_tokens
                handing_off = placed is not None and placed.route == "gpu->cpu" and stream.client is placed.clients[0]
                pending.setdefault(stream.client, []).append(_Pending(
                    stream.uncached_tokens, bool(stream.received),
                    len(stream.prompt_ids) + 1 if handing_off else whole))
                if handing_off:
                    # Still on its GPU worker: a decode the CPU worker will have, counted there already.
                    pending.setdefault(placed.clients[1], []).append(_Pending(0, True, whole))
        return self.placer.place(self.clients, pending, prompt_ids, max_tokens, deadline_s, exclude=exclude,
                                 streamed=streamed, kind=kind, handoff=handoff)

    def register(self, stream: GenerationStream, client: WorkerClient | None) -> None:
        """Route outputs for `stream.worker_request_id` to `stream`; None: it waits for a READY worker."""
        self._streams[stream.worker_request_id] = stream
        if client is None:
            self._waiting[stream.worker_request_id] = stream
        else:
            self.placer.sent(client)

    def unregister(self, stream: GenerationStream, client: WorkerClient | None) -> None:
        self._waiting.pop(stream.worker_request_id, None)
        if self._streams.pop(stream.worker_request_id, None) is not None and client is not None:
            self.placer.ended(client)
        self._recent[stream.worker_request_id] = None
        if len(self._recent) > RECENT_IDS:
            del self._recent[next(iter(self._recent))]

    async def _watch_stalls(self) -> None:
        """One timer for every stream: one without progress for the stall timeout gets `Stalled`."""
        timeout = self.config.request_stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for stream in list(self._streams.values()):
                silent = now - stream.last_progress
                if not stream.done and silent > timeout:
                    client = stream.client
                    where = f"on worker {client.endpoint}" if client is not None else "waiting for a worker"
                    try:
                        stream.put(Stalled(f"request {stream.request_id}: no progress for {silent:.1f} s {where} "
                                           f"(request_stall_timeout_s={timeout:g})"))
                    except Exception as exc:  # one stream's failure must not stop the timer for the rest
                        log.exception("moving stalled request %s failed", stream.request_id)
                        stream.fail(UnavailableError(f"request {stream.request_id} stalled and could not be moved: "
                                                     f"{exc}"))

    def reassign(self, stream: GenerationStream, old: WorkerClient, new: WorkerClient) -> None:
        """The stream's sequence moved from `old` to `new` (a hand-off's import)."""
        if stream.request_id in self._streams:
            self.placer.ended(old)
            self.placer.sent(new)

    # --- worker messages (the output pump) ---------------------------------

    def _on_message(self, client: WorkerClient, msg: msgspec.Struct) -> None:
        """Every message and lifecycle event of every client; health follows readiness both ways."""
        self._handlers[type(msg)](client, msg)
        if self._waiting and self.ready:
            for stream in list(self._waiting.values()):
                stream.put(WorkerAvailable())
        self.members.changed()

    def _stream_of(self, client: WorkerClient, request_id: str) -> GenerationStream | None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.client is client:
            return stream
        if request_id not in self._recent:  # late outputs of an ended request are normal; others are not
            self._unknown_ids += 1
            self._unknown_log.warning("worker %s sent a message for request %r, which this router did not send it",
                                      getattr(client, "name", client.endpoint), request_id[:64])
        return None

    def _on_outputs(self, client: WorkerClient, msg: Outputs) -> None:
        streams, now = self._streams, time.monotonic()  # the clock read once for every sequence of the step
        for out in msg.outputs:  # one lookup per output: a message carries every running sequence's ids
            stream = streams.get(out.request_id)
            if stream is None:
                self._stream_of(client, out.request_id)  # counted and logged as unknown unless recently ended
            elif stream.handoff is not None and stream.handoff.active:
                stream.handoff.on_message(client, out)  # both workers' outputs, reordered
            elif stream.client is client:
                stream.put_output(out, now)
            else:
                self._stream_of(client, out.request_id)

    def _in_handoff(self, request_id: str) -> GenerationStream | None:
        """The stream of `request_id` while its KV hand-off is active (it takes both workers' messages)."""
        stream = self._streams.get(request_id)
        return stream if stream is not None and stream.handoff is not None and stream.handoff.active else None

    def _on_request_error(self, client: WorkerClient, msg: RequestError) -> None:
        stream = self._in_handoff(msg.request_id)
        if stream is not None:
            stream.handoff.on_message(client, msg)
            return
        stream = self._stream_of(client, msg.request_id)
        if stream is not None:
            stream.put(msg)

    def _on_overload(self, client: WorkerClient, msg: Overload) -> None:
        log.warning("worker %s dropped %d requests: %s", client.endpoint, len(msg.request_ids), msg.reason)
        for rid in msg.request_ids:
            stream = self._stream_of(client, rid)
            if stream is not None:
                stream.put(msg)

    def _on_handoff(self, client: WorkerClient, msg) -> None:
        stream = self._streams.get(msg.request_id)
        if stream is not None and stream.handoff is not None:
            stream.handoff.on_message(client, msg)

    def _on_dead(self, client: WorkerClient, msg: WorkerDead) -> None:
        """The worker's sequences are gone: the single signal its streams act on (fail or move)."""
        log.error("%s", msg.reason)
        self.placer.forget(client)
        for stream in list(self._streams.values()):
            if stream.handoff is not None and stream.handoff.active and stream.handoff.involves(client):
                stream.handoff.on_message(client, msg)
            elif stream.client is client:
                stream.put(msg)
