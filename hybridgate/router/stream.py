"""One request's stream: worker outputs in, text deltas out (detokenizer and stop strings here)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridgate.models import IncrementalDetokenizer
from hybridgate.router.client import WorkerDead
from hybridgate.router.errors import UnavailableError, WorkerRequestError
from hybridgate.router.handoff import Handoff, worker_name
from hybridgate.router.stop import StopMatcher
from hybridgate.wire import AddRequest, FinishReason, RequestError, SamplingParams, SeqOutput

if TYPE_CHECKING:
    from hybridgate.router.router import Prompt, Router

_LARGE_PROMPT_CHARS = 1 << 16  # tokenize off the event loop above this


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Timings:
    queue_ms: float
    ttft_ms: float
    total_ms: float


@dataclass(frozen=True)
class Delta:
    """New text and ids of one step; the last delta has finish_reason, usage, timings and route."""

    request_id: str
    token_index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    route: str = ""


class GenerationStream:
    """Async context manager and async iterator of `Delta`s for one request."""

    def __init__(self, router: Router, prompt: Prompt, params: SamplingParams, label: str, request_id: str,
                 route: str = "auto"):
        self.router, self.prompt, self.params, self.label = router, prompt, params, label
        self.request_id, self.route = request_id, route
        self.client = None
        self.handoff: Handoff | None = None  # a gpu->cpu request's hand-off (hybridgate/router/handoff.py)
        self.prompt_ids: list[int] = []
        self.ids: list[int] = []
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=router.config.queue_size)
        self._detok = IncrementalDetokenizer(router.tokenizer)
        self._stop = StopMatcher(params.stop)
        self._eos = router.tokenizer.eos_token_id
        self._arrival = time.monotonic()
        self._first_token_at: float | None = None
        self._queue_ms = 0.0
        self._cached = 0

    async def __aenter__(self) -> GenerationStream:
        self._arrival = time.monotonic()
        big = isinstance(self.prompt, str) and len(self.prompt) > _LARGE_PROMPT_CHARS
        self.prompt_ids = await asyncio.to_thread(self.router.tokenize, self.prompt) if big else self.router.tokenize(self.prompt)
        self.max_tokens, self.seed = self.router.resolve(self.prompt_ids, self.params)
        self._submit(exclude=())
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.finished:
            self.finished = True
            self._abort()
        self.router.unregister(self, self.client)

    def _submit(self, exclude) -> None:
        self.handoff = None
        request = AddRequest(self.request_id, self.prompt_ids, self.params, self.seed, self.max_tokens, self._eos)
        # A retry after a lost worker keeps a one-kind route; a failed hand-off's goes where placement says.
        retry = bool(exclude)
        kind = {"auto": None, "gpu->cpu": None if retry else "gpu"}.get(self.route, self.route)
        client = self.router.place(exclude, kind)
        cpu = self.router.place(exclude, "cpu") if self.route == "gpu->cpu" and not retry else None
        self.client = client
        self.router.register(self, client)
        if cpu is None:
            client.add(request)
            return
        self.handoff = Handoff(self, request, client, cpu, self.router.handoff_metrics, self.router.handoff_pause,
                               self.router.config.handoff_stall_s, self.router.config.handoff_answer_s)
        self.handoff.start()

    def _abort(self) -> None:
        if self.handoff is not None and self.handoff.active:
            self.handoff.abort()
        elif self.client is not None:
            self.client.abort([self.request_id])

    def moved(self, old, new) -> None:
        """The hand-off's import moved the sequence to the CPU worker (called by `Handoff`)."""
        self.router.reassign(self, old, new)
        self.client = new

    # --- fed by the router's output pump ------------------------------------

    def put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self._abort()
            self.fail(UnavailableError(f"the client read too slowly: over {self._queue.maxsize} steps buffered"))

    def fail(self, exc: BaseException) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(exc)

    # --- consumed by the caller ---------------------------------------------

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Delta:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, SeqOutput):
                delta = self._on_output(item)
                if delta is not None:
                    return delta
            elif isinstance(item, WorkerDead) and not self.ids and self._retry():
                continue
            else:
                self.finished = True
                self._abort()
                self.router.unregister(self, self.client)
                raise _error_of(item)
        raise StopAsyncIteration

    def _retry(self) -> bool:
        """A request whose worker died before its first token goes to another worker."""
        dead = self.client
        self.router.unregister(self, dead)
        try:
            self._submit(exclude=[dead])
        except UnavailableError:
            return False
        return True

    def _on_output(self, out: SeqOutput) -> Delta | None:
        skip = len(self.ids) - out.token_index  # duplicates from a resend
        new_ids = out.token_ids[max(skip, 0) :]
        if not new_ids and not out.finish:
            return None
        if out.token_index == 0 and out.token_ids:
            self._queue_ms, self._cached = out.queue_ms, out.cached_tokens
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()
        finish = FinishReason(out.finish) if out.finish else None
        first_index, parts, taken = len(self.ids), [], []
        for k, tid in enumerate(new_ids):
            taken.append(tid)
            is_eos = finish == FinishReason.EOS and k == len(new_ids) - 1 and tid == self._eos
            text, matched = self._stop.push("" if is_eos else self._detok.step(tid))
            parts.append(text)
            if matched:
                finish = FinishReason.STOP
                self._abort()
                break
        self.ids += taken
        if finish is not None and finish != FinishReason.STOP:
            text, matched = self._stop.push(self._detok.flush())
            parts.append(text if matched else text + self._stop.flush())
            finish = FinishReason.STOP if matched else finish
        return self._delta(first_index, "".join(parts), taken, finish)

    def _delta(self, index: int, text: str, ids: list[int], finish: FinishReason | None) -> Delta:
        if finish is None:
            return Delta(self.request_id, index, text, ids)
        self.finished = True
        self.router.unregister(self, self.client)
        if self.handoff is not None:
            self.handoff.finished()
        now = time.monotonic()
        ttft = ((self._first_token_at or now) - self._arrival) * 1e3
        return Delta(
            self.request_id, index, text, ids, finish,
            usage=Usage(len(self.prompt_ids), len(self.ids), self._cached),
            timings=Timings(self._queue_ms, ttft, (now - self._arrival) * 1e3),
            route=self._route(),
        )

    def _route(self) -> str:
        """The plan and the workers that served it: "gpu (gpu-0)", "gpu->cpu (gpu-0 -> cpu-1)"."""
        if self.handoff is not None:
            return self.handoff.route()
        return f"{self.client.kind} ({worker_name(self.client)})"


def _error_of(item) -> BaseException:
    if isinstance(item, WorkerDead):
        return UnavailableError(item.reason)
    if isinstance(item, RequestError):
        return WorkerRequestError(item.message)
    return item if isinstance(item, BaseException) else RuntimeError(f"unexpected stream item {item!r}")
