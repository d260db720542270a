"""What a request stream hands its caller: `Delta`s (the last with `Usage`, `Timings` and the route),
or the error a worker's answer maps to (`error_of`); `poller` reads any stream of them without a
coroutine per delta where the stream allows it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from hybridgate.clients.interface import WorkerDead
from hybridgate.router.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ResourceExhaustedError,
    UnavailableError,
    WorkerRequestError,
)
from hybridgate.wire import (
    ERROR_DEADLINE_EXCEEDED,
    ERROR_INVALID_CONSTRAINT,
    ERROR_NO_KV_BLOCKS,
    ERROR_QUEUE_FULL,
    ERROR_RESOURCE_EXHAUSTED,
    FinishReason,
    RequestError,
    TokenLogprobs,
)

# Refusals that another worker may not give: its cache may be larger or emptier.
REPLACEABLE_CODES = frozenset({ERROR_NO_KV_BLOCKS, ERROR_RESOURCE_EXHAUSTED, ERROR_QUEUE_FULL})


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Timings(msgspec.Struct, frozen=True):
    queue_ms: float
    ttft_ms: float
    total_ms: float


class Delta(msgspec.Struct, frozen=True, gc=False):
    """New text and ids of one step; the last delta has finish_reason, usage, timings and route.
    `logprobs`: one per id of `token_ids` when the request asked for them (SamplingParams.logprobs), else empty.
    `tool_calls`: with tools, the calls' deltas (`toolparse.ToolCallDelta`); `text` is then the content only.
    `reasoning`: the reasoning a format with channels (harmony's analysis) writes, parsed out of `text`.
    A frozen msgspec Struct, not a dataclass: one is made per streamed message, and a frozen dataclass's
    __init__ costs several times as much (copy one with `msgspec.structs.replace`). Untracked by the cycle
    collector (gc=False): its fields hold ids, text and other Structs, never a cycle back to it."""

    request_id: str
    token_index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    route: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()
    tool_calls: tuple = ()  # ToolCallDelta of a request with tools (hybridgate.router.tools.ToolCallStream)
    reasoning: str = ""  # a chat in a format with a reasoning channel: its new text (never part of `text`)


def error_of(item) -> BaseException:
    """The exception the caller gets for a stream's last item (a worker's error, a loss, or an exception)."""
    if isinstance(item, WorkerDead):
        return UnavailableError(item.reason)
    if isinstance(item, RequestError):
        if item.code == ERROR_DEADLINE_EXCEEDED:
            return DeadlineExceededError(item.message)
        if item.code == ERROR_INVALID_CONSTRAINT:  # INVALID_ARGUMENT / 400 naming the field
            return InvalidRequestError("constraint", item.message.removeprefix("constraint: "))
        if item.code in REPLACEABLE_CODES:  # memory ran out, or the request needs more KV than any worker holds
            reason = "worker_queue_full" if item.code == ERROR_QUEUE_FULL else "worker_memory"
            return ResourceExhaustedError(item.message, reason)
        return WorkerRequestError(item.message)
    return item if isinstance(item, BaseException) else RuntimeError(f"unexpected stream item {item!r}")


class Poller:
    """`poll()` and `arrival()`, as `GenerationStream` has them, over any other stream of deltas (the response
    cache's, the tool-call parser's): `arrival()` reads the next delta, `poll()` hands it out (None before)."""

    __slots__ = ("_stream", "_next")

    def __init__(self, stream):
        self._stream, self._next = stream, None

    def poll(self) -> Delta | None:
        delta, self._next = self._next, None
        return delta

    async def arrival(self) -> None:
        self._next = await self._stream.__anext__()


def poller(stream) -> tuple[Callable[[], Delta | None], Callable[[], Awaitable]]:
    """(poll, arrival) of a request stream, for a door's loop: `delta = poll()`, and while it is None
    `await arrival()` and poll again; StopAsyncIteration (raised by either) ends the stream. A
    GenerationStream's own (its mailbox's future is awaited directly), else a `Poller`'s."""
    if hasattr(type(stream), "poll"):  # the class's: a wrapper's __getattr__ would hand out its inner stream's
        return stream.poll, stream.arrival
    wrapped = Poller(stream)
    return wrapped.poll, wrapped.arrival
