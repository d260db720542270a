"""The streamed answer of the OpenAI HTTP door: the response that writes server-sent events to the server
(`EventStream`), and the streams of one request's choices read as one (`Run`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

import anyio
from fastapi.responses import StreamingResponse

from hybridgate.gateway.http_guard import SERVER_SEND
from hybridgate.gateway.models import ServedModel
from hybridgate.gateway.openai_format import ChoiceState

if TYPE_CHECKING:
    from hybridgate.gateway.metrics import GatewayMetrics

log = logging.getLogger("hybridgate.gateway")
request_log = logging.getLogger("hybridgate.requests")
RUN_QUEUE_PER_CHOICE = 16  # deltas of one choice merged and not yet read by the client's response


class Door(Protocol):
    """What a `Run` reads of its door (`http.OpenAIApp`), named here so this module imports none of it."""

    metrics: GatewayMetrics
    log_requests: bool


class EventStream(StreamingResponse):
    """A StreamingResponse that runs `release` however it ends: also when the client went away before
    the body was first read (then the body's generator never started, so its `finally` cannot).
    Its chunks (bytes) go to the server's own `send` (http_guard.SERVER_SEND) when the scope has it: the
    response's start and end still go through the app's middleware, which notes only those."""

    def __init__(self, content, release, **kwargs):
        super().__init__(content, **kwargs)
        self._release = release
        self._server_send = None

    async def __call__(self, scope, receive, send) -> None:
        self._server_send = scope.get(SERVER_SEND)
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()

    async def stream_response(self, send) -> None:
        if self._server_send is None:
            await super().stream_response(send)
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        chunk_send = self._server_send
        async for chunk in self.body_iterator:
            await chunk_send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Run:
    """The streams of one HTTP request's choices: entered together, read as one merged sequence of deltas.

    The merged queue holds at most RUN_QUEUE_PER_CHOICE deltas per choice: a pump waits while it is full
    (the client reads slowly), leaving the rest in its stream, rather than copying it all here."""

    def __init__(self, door: Door, states: list[ChoiceState], served: ServedModel):
        self.door, self.states, self.served = door, states, served
        self.series = door.metrics.of(served.name)
        self.cost = (0, 0)  # admission's (max_tokens, slots), given back by `release` (streams)
        self._released = False
        self._queue: asyncio.Queue = asyncio.Queue(RUN_QUEUE_PER_CHOICE * len(states))
        self._tasks: list[asyncio.Task] = []

    async def release(self) -> None:
        """Close the streams and give the admission slot back, once. Starlette cancels a streamed body's
        task when the client disconnects, and its cancel scope cancels every await after that too:
        the aborts must go out all the same, so this is shielded."""
        if self._released:
            return
        self._released = True
        with anyio.CancelScope(shield=True):
            await self.close()
        self.served.admission.leave(*self.cost)

    async def enter(self) -> None:
        """Tokenize, check and place every choice; raise the first error (nothing is left running then).
        Several choices are read by one task each into a queue; a single one is read directly (no hop)."""
        for s in self.states:
            await s.stream.__aenter__()
            s.entered = True
        if len(self.states) > 1:
            self._tasks = [asyncio.create_task(self._pump(s)) for s in self.states]

    def observe(self, state: ChoiceState, delta) -> None:
        """`state`'s stream gave `delta`: the metrics and the admission's token rate see it."""
        series, now, n = self.series, time.monotonic(), len(delta.token_ids)
        last, state.last_at = state.last_at, now
        if state.first_at is None:
            state.first_at = now
            series.ttft.observe(now - state.started)
            series.first_token(len(state.stream.prompt_ids))
        elif last is not None and n:  # as the gRPC door observes it, per token of the delta
            series.itl.observe((now - last) / n)
        self.served.admission.streamed(n, now)
        series.streamed(n)
        if delta.finish_reason is not None:
            series.e2e.observe(now - state.started)
            series.finished(delta.finish_reason.name.lower(), len(state.stream.prompt_ids), len(state.stream.ids))

    async def _pump(self, state: ChoiceState) -> None:
        try:
            async for delta in state.stream:
                self.observe(state, delta)
                await self._queue.put((state, delta))
        except Exception as exc:  # a cancellation comes from `close` only: nobody reads any more
            await self._queue.put((state, exc))

    async def deltas(self):
        """(state, delta) of every choice as they come, until each has finished; raises a choice's error."""
        if not self._tasks:
            state = self.states[0]
            async for delta in state.stream:
                self.observe(state, delta)
                state.add(delta)
                yield state, delta
            return
        left = len(self.states)
        while left:
            state, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            state.add(item)
            if item.finish_reason is not None:
                left -= 1
            yield state, item

    async def finish(self) -> None:
        async for _ in self.deltas():
            pass

    async def close(self) -> None:
        """Cancel what still runs and leave every entered stream (which aborts it on its worker)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self.states:
            if s.entered:
                s.entered = False
                if s.finish is None:  # the client went away, or a sibling choice failed
                    self.series.finished("abort", len(s.stream.prompt_ids), len(s.stream.ids))
                if self.door.log_requests:
                    self._log(s)
                try:
                    await s.stream.__aexit__(None, None, None)
                except Exception as exc:  # the response has ended: said and counted, the other choices still closed
                    self.series.close_failed()
                    log.warning("request %s (choice %d): closing its stream failed (%s: %s); its abort may not "
                                "have reached its worker", s.stream.request_id, s.index, type(exc).__name__, exc)

    @staticmethod
    def _log(s: ChoiceState) -> None:
        stream, now = s.stream, time.monotonic()
        ttft = f"{(s.first_at - s.started) * 1e3:.1f}" if s.first_at is not None else "-"
        request_log.info("request id=%s label=%r door=http choice=%d prompt_tokens=%d completion_tokens=%d "
                         "ttft_ms=%s total_ms=%.1f finish_reason=%s", stream.request_id, s.label, s.index,
                         len(stream.prompt_ids), len(stream.ids), ttft, (now - s.started) * 1e3,
                         s.finish.name.lower() if s.finish is not None else "abort")
