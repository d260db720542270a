"""One request's stream: worker outputs in, text deltas out (detokenizer and stop strings here)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from hybridgate.models import IncrementalDetokenizer
from hybridgate.clients.interface import WorkerClient, WorkerDead
from hybridgate.router.deltas import REPLACEABLE_CODES, Delta, Timings, Usage, error_of
from hybridgate.router.errors import DeadlineExceededError, UnavailableError
from hybridgate.router.handoff import Handoff, worker_name
from hybridgate.router.mailbox import Mailbox
from hybridgate.router.stop import StopMatcher, cut_text
from hybridgate.router.streamstate import StreamAction as A
from hybridgate.router.streamstate import (
    MAX_MOVES,
    Stalled,
    StreamEvent,
    StreamFacts,
    StreamState,
    WorkerAvailable,
    transition,
)
from hybridgate.wire import AddRequest, FinishReason, Overload, RequestError, SamplingParams, SeqOutput, TokenLogprobs

__all__ = ["GenerationStream", "Stalled", "WorkerAvailable"]

if TYPE_CHECKING:
    from hybridgate.router.owner import StreamOwner
    from hybridgate.router.prompts import Prompt

log = logging.getLogger("hybridgate.router")

# `put_output` carries out this row itself rather than through `_fire` (a transition and an action lookup
# per streamed token); the row must stay what it inlines.
_RUNNING_OUTPUT = transition(StreamState.RUNNING, StreamEvent.OUTPUT)
if _RUNNING_OUTPUT != (StreamState.RUNNING, A.QUEUE):
    raise ImportError(f"streamstate's RUNNING/OUTPUT row is {_RUNNING_OUTPUT}; GenerationStream inlines "
                      "(RUNNING, QUEUE)")
# Read once: an enum class's attribute lookup costs hundreds of instructions (EnumType.__getattr__'s slot).
_RUNNING, _DONE, _CLOSED = StreamState.RUNNING, StreamState.DONE, StreamState.CLOSED


class GenerationStream:
    """Async context manager and async iterator of `Delta`s for one request.

    Two halves: the router's output pump calls `put()` with every event for this
    request (synchronously, on the event loop), and the caller iterates the
    deltas that `put()` queued. Where the request runs is decided in `put()`, so a
    stream is moved at once even while its caller is slow to read.

    Its state is a `StreamState`, changed only by `streamstate.transition` (the
    table of states, events and actions is in hybridgate/router/streamstate.py):
    `put()` and the caller's side turn what happens into a `StreamEvent`, and
    `_fire` carries out the action the table gives. A move (a lost worker, a
    refusal for lack of KV blocks or a full queue, an Overload, a stall) places
    the request again through the router's policy (`Router.plan`), resumed after
    the ids already received (prompt + those ids, same seed, next token index).
    Each placement uses its own worker-side request id (`request_id.hop`), so a
    late output of an earlier placement is dropped as unknown and an ADD to the
    same worker is never a duplicate.
    """

    def __init__(self, router: StreamOwner[GenerationStream], prompt: Prompt, params: SamplingParams, label: str,
                 request_id: str, route: str = "auto", deadline_s: float | None = None):
        self.router, self.prompt, self.params, self.label = router, prompt, params, label
        self.deadline_s = deadline_s  # seconds from entry; None: none
        self.request_id, self.plan = request_id, route  # the route asked for: auto, gpu, cpu or gpu->cpu
        self.worker_request_id = request_id  # this placement's id on its worker
        self.client = None
        self.handoff: Handoff | None = None  # a gpu->cpu request's hand-off (hybridgate/router/handoff.py)
        self.pooling = 0  # AddRequest.pooling: 0 a generation; an embedding request's PoolingType (never handed off)
        self._handoff_route = ""  # the hand-off's part of the route, once the request moved on from it
        self.prompt_ids: list[int] = []
        self.template_tools: list | None = None  # the chat template's `tools` (hybridgate.router.tools)
        self._prepared = False
        self.ids: list[int] = []  # ids handed to the caller
        self.received: list[int] = []  # ids accepted from workers (the caller may not have read them yet)
        self.state = StreamState.NEW
        self._cause: StreamEvent | None = None  # the event that began the current move
        self.last_progress = time.monotonic()
        self.placement = None  # the policy's Placement of a route="auto" request (hybridgate/router/placement.py)
        self.uncached_tokens = 0  # prompt tokens its worker is expected to compute (for the router's load record)
        self._hops: list[tuple[str, int, WorkerClient]] = []  # (how, first token index, worker) of each placement
        self._refused: list[WorkerClient] = []
        self._queue = Mailbox(router.config.queue_size)
        self._held = None  # an item taken off the queue by `_join_queued` or `poll` and not yet handled
        self._filled: list[Delta] = []  # deltas `poll` holds until they carry the stream interval's ids
        self.arrival = self._queue.arrival  # `await stream.arrival()`: an item is queued (`poll`)
        # What a message carries (RouterConfig.stream_coalesce and stream_interval).
        self._coalesce, self._interval = router.config.stream_coalesce, router.config.stream_interval
        self._detok = IncrementalDetokenizer(router.tokenizer, params.skip_special_tokens)
        self._stop = StopMatcher(params.stop)
        self._no_stops = not self._stop.stops  # no stop string can cut a delta (most requests)
        self._eos = router.tokenizer.eos_token_id
        self._arrival = time.monotonic()
        self._first_token_at: float | None = None
        self._queue_ms = 0.0
        self._cached = 0
        self._events = {SeqOutput: self._on_output_event, WorkerDead: self._on_worker_dead,
                        RequestError: self._on_request_error, Overload: self._on_overload,
                        Stalled: self._on_stalled, WorkerAvailable: self._on_worker_available}
        self._actions = {
            A.NONE: lambda item, reason: None, A.QUEUE: lambda item, reason: self._queue.put_nowait(item),
            A.ANSWER: lambda item, reason: self._answer(item), A.MOVE: self._move,
            A.MOVE_ELSEWHERE: self._move_elsewhere, A.ABORT_AND_MOVE: self._abort_and_move,
            A.PLACE: self._place_again, A.WAIT: self._wait, A.FAIL: self._fail,
            A.ABORT_AND_FAIL: lambda item, reason: (self._abort(), self._fail(item, reason)),
            A.ABORT: lambda item, reason: self._abort(), A.FINISH: self._finish,
            A.ABORT_AND_FORGET: lambda item, reason: (self._abort(), self.router.unregister(self, self.client)),
        }

    @property
    def done(self) -> bool:
        """The pump queued the last item: nothing more moves this stream."""
        return self.state >= _DONE

    @property
    def finished(self) -> bool:
        """The caller read the end, or left."""
        return self.state == _CLOSED

    def _fire(self, event: StreamEvent, item=None, reason: str = "") -> None:
        """One event: the table's next state, then its action (`item`: the output or error it is about)."""
        self.state, action = transition(self.state, event, self._facts)
        if self.state == StreamState.MOVING and event != StreamEvent.NO_WORKER:
            self._cause = event
        self._actions[action](item, reason)

    def _facts(self) -> StreamFacts:
        return StreamFacts(bool(self.received), self.router.config.resume_on_worker_loss, len(self._hops) < MAX_MOVES,
                           self._cause)

    async def __aenter__(self) -> GenerationStream:
        await self.prepare()
        self._first_placement()
        self._fire(StreamEvent.PLACED)
        return self

    async def prepare(self) -> None:
        """Check the output constraint (it compiles, or InvalidRequestError naming the feature), tokenize, and
        resolve max_tokens and the seed (once; the response cache keys on them before entry)."""
        if self._prepared:
            return
        self._prepared = True
        self._arrival = time.monotonic()
        constraint = self.params.constraint
        await self.router.constraints.check(constraint, "tools" if constraint is not None and
                                            constraint.kind == "tools" else "constraint")
        ids = await self.router.prompts.encode(self.prompt, tools=self.template_tools)  # a large one off the loop
        # An array of ids is converted only when it can run: resolve() refuses a longer one by its length.
        self.prompt_ids = ids if isinstance(ids, list) or len(ids) >= self.router.max_model_len else ids.tolist()
        self.max_tokens, self.seed = self.router.resolve(self.prompt_ids, self.params)

    async def __aexit__(self, *exc) -> None:
        self.leave()

    def leave(self) -> None:
        """What leaving the `async with` does: abort the request on its worker if unfinished, forget it."""
        self._fire(StreamEvent.LEFT)

    def _submit(self, client: WorkerClient, how: str, exclude=()) -> None:
        """Send this request to `client`: in full, or resumed after the ids already received. A send
        that fails (the worker is not connected) goes to the policy's next READY worker not in `exclude`.

        Raises UnavailableError when no READY worker is left.
        """
        tried = list(exclude)
        while True:
            k = len(self.received)
            self.client, self.last_progress = client, time.monotonic()
            self.router.register(self, client)
            left = self._time_left()
            sent = client.add(AddRequest(self.worker_request_id, self.prompt_ids + self.received, self.params,
                                         self.seed, self.max_tokens - k, self._eos, first_token_index=k,
                                         deadline_s=max(left, 1e-3) if left is not None and not k else 0.0,
                                         pooling=self.pooling))
            if sent is not False:
                self._hops.append((how, k, client))
                return
            self.router.unregister(self, client)
            self.client = None
            tried.append(client)
            client = self._place(tried)

    def _time_left(self) -> float | None:
        """Seconds left of the caller's deadline (None: no deadline)."""
        if self.deadline_s is None:
            return None
        return self.deadline_s - (time.monotonic() - self._arrival)

    def _place(self, exclude) -> WorkerClient:
        """The policy's worker for a placement on one worker (an explicit route's, or any later one),
        leaving out `exclude`, for the prompt plus the ids already received.

        Raises UnavailableError when no READY worker is left.
        """
        placement = self.router.plan(self.prompt_ids, self.max_tokens, self._time_left(), exclude=exclude,
                                     streamed=self.received, kind=self._kind(), handoff=False)
        self.uncached_tokens = placement.uncached_tokens
        return placement.clients[0]

    def _kind(self) -> str | None:
        """The worker kind a placement must have: a one-kind route keeps it through retries and resumes."""
        return self.plan if self.plan in ("gpu", "cpu") else None

    def _first_placement(self) -> None:
        """By the route: one worker, or a KV hand-off from a GPU worker's prefill to a CPU worker's decode."""
        self.uncached_tokens = len(self.prompt_ids)
        if self.plan == "auto":
            left = self._time_left()
            self.placement = self.router.plan(self.prompt_ids, self.max_tokens, left, handoff=not self.pooling)
            self.uncached_tokens = self.placement.uncached_tokens
            if left is not None and left < self.placement.fastest_ttft_s:
                raise DeadlineExceededError(
                    f"the deadline ({left * 1e3:.0f} ms left) is shorter than every plan's predicted TTFT "
                    f"(the fastest: {self.placement.fastest_ttft_s * 1e3:.0f} ms); nothing was run")
            if self.placement.route != "gpu->cpu":
                self._submit(self.placement.clients[0], "placed", ())
                return
            gpu, cpu = self.placement.clients
        elif self.plan != "gpu->cpu":
            self._submit(self._place(()), "placed", ())
            return
        else:
            gpu = self.router.plan(self.prompt_ids, self.max_tokens, kind="gpu", handoff=False).clients[0]
            cpu = self.router.plan(self.prompt_ids, self.max_tokens, kind="cpu", handoff=False).clients[0]
        request = AddRequest(self.request_id, self.prompt_ids, self.params, self.seed, self.max_tokens, self._eos)
        self.client, self.last_progress = gpu, time.monotonic()
        self.router.register(self, gpu)
        self._hops.append(("placed", 0, gpu))
        self.handoff = Handoff(self, request, gpu, cpu, self.router.handoff_metrics, self.router.handoff_pause,
                               self.router.config.handoff_stall_s, self.router.config.handoff_answer_s)
        self.handoff.start()

    def _abort(self) -> None:
        if self.handoff is not None and self.handoff.active:
            self.handoff.abort()
        elif self.client is not None:
            self.client.abort([self.worker_request_id])

    def moved(self, old, new) -> None:
        """The hand-off's import moved the sequence to the CPU worker (called by `Handoff`)."""
        self.router.reassign(self, old, new)
        self.client = new

    # --- fed by the router's output pump ------------------------------------

    def put(self, item) -> None:
        """One event for this request (a wire message from its worker or a synthetic event)."""
        if self.state < _DONE:
            self._events[type(item)](item)

    def put_output(self, out: SeqOutput, now: float) -> None:
        """`put(out)` of an output from its worker at `now` (the pump's time.monotonic(), once per step); the
        table's RUNNING/OUTPUT row inline for the next ids of a running stream, almost every output."""
        if self.state is not _RUNNING or out.finish or out.token_index != len(self.received) or not out.token_ids \
                or out.request_id != self.request_id:
            if self.state < _DONE:
                self._on_output_event(out, now)
            return
        self.last_progress = now
        try:
            self._queue.put_nowait(out)
        except asyncio.QueueFull:
            self._read_too_slowly()
            return
        self.received += out.token_ids

    def fail(self, exc: BaseException) -> None:
        """End the stream with `exc` now (the router shuts down, or could not move it)."""
        self._fire(StreamEvent.SHUT_DOWN, exc)

    def _on_output_event(self, out: SeqOutput, now: float | None = None) -> None:
        self.last_progress = time.monotonic() if now is None else now
        if out.token_index != len(self.received) or out.request_id != self.request_id:
            skip = len(self.received) - out.token_index  # duplicates from a resend
            if skip < 0:
                log.warning("request %s: output at token %d after %d ids; dropped", self.request_id,
                            out.token_index, len(self.received))
                return  # numbered as the caller sees it (an output as sent is):
            out = msgspec.structs.replace(out, request_id=self.request_id, token_index=len(self.received),
                                          token_ids=out.token_ids[skip:], logprobs=out.logprobs[skip:])
        if not out.token_ids and not out.finish:
            return  # progress only (a prefill chunk) or a duplicate
        if self._queue.full():
            self._read_too_slowly()
            return
        self.received += out.token_ids
        self._fire(StreamEvent.LAST_OUTPUT if out.finish else StreamEvent.OUTPUT, out)

    def _read_too_slowly(self) -> None:
        self._fire(StreamEvent.READ_TOO_SLOWLY, reason=f"the client read too slowly: over {self._queue.maxsize} "
                                                       "steps buffered")

    def _on_worker_dead(self, event: WorkerDead) -> None:
        self._fire(StreamEvent.WORKER_LOST, reason=event.reason)

    def _on_request_error(self, error: RequestError) -> None:
        if error.code not in REPLACEABLE_CODES:
            self._fire(StreamEvent.FAILED, error)
            return
        self._refused.append(self.client)
        self._fire(StreamEvent.REFUSED, error, error.message)

    def _on_overload(self, event: Overload) -> None:
        self._fire(StreamEvent.DROPPED, reason=f"worker {worker_name(self.client)} dropped the request: {event.reason}")

    def _on_stalled(self, event: Stalled) -> None:
        self._fire(StreamEvent.STALLED, reason=event.reason)

    def _on_worker_available(self, event: WorkerAvailable) -> None:
        self._fire(StreamEvent.WORKER_AVAILABLE, reason="no worker is ready")

    # --- the table's actions --------------------------------------------------

    def _answer(self, item) -> None:
        """The worker's error is the answer (after the outputs queued before it)."""
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self._abort()
            self._fail(None, f"the client read too slowly: over {self._queue.maxsize} steps buffered")

    def _fail(self, item, reason: str) -> None:
        """The caller gets `item` (an exception) or UNAVAILABLE with `reason`, before anything still queued."""
        if len(self._hops) >= MAX_MOVES and not isinstance(item, BaseException):
            reason += f" (moved {len(self._hops) - 1} times already)"
        self._held = None
        self._queue.clear()
        self._queue.put_nowait(item if isinstance(item, BaseException) else UnavailableError(reason))

    def _finish(self, item, reason: str) -> None:
        self.router.unregister(self, self.client)
        if self.handoff is not None:
            self.handoff.finished()

    def _move(self, item, reason: str) -> None:
        self._relocate(reason, [self._refused], item)

    def _move_elsewhere(self, item, reason: str) -> None:
        # The worker could not send to this router: placing it there again would only repeat that.
        self._relocate(reason, [self._refused + [self.client]], item)

    def _abort_and_move(self, item, reason: str) -> None:
        # A stalled worker is still READY: tried last.
        self.client.abort([self.worker_request_id])
        self._relocate(reason, [self._refused + [self.client], self._refused], item)

    def _relocate(self, reason: str, excludes: list[list[WorkerClient]], item=None) -> None:
        """The request left its worker (`reason`): place it again, resumed after the ids received,
        leaving out each of `excludes` in turn; PLACED or NO_WORKER follows."""
        log.info("request %s: %s; %s", self.request_id, reason,
                 "resuming after %d ids" % len(self.received) if self.received else "placing it again")
        self.router.unregister(self, self.client)
        if self.handoff is not None:  # the hand-off handed its stream over as lost: it is over
            self._handoff_route, self.handoff = self.handoff.route(), None
        self.client = None
        self.worker_request_id = f"{self.request_id}.{len(self._hops)}"
        self._try_placing(excludes, item, f"{reason}; no other worker is ready")

    def _try_placing(self, excludes: list[list[WorkerClient]], item, reason: str) -> None:
        for exclude in excludes:
            try:
                self._submit(self._place(exclude), "resumed" if self.received else "retried", exclude)
            except UnavailableError:
                continue
            self._fire(StreamEvent.PLACED)
            return
        self._fire(StreamEvent.NO_WORKER, item, reason)

    def _wait(self, item, reason: str) -> None:
        """No worker to go to now: wait for one (the router wakes us; its stall timer bounds the wait)."""
        self.last_progress = time.monotonic()
        self.router.register(self, None)
        log.info("request %s waits for a READY worker (%s)", self.request_id, reason)

    def _place_again(self, item, reason: str) -> None:
        self.router.unregister(self, None)
        self._try_placing([self._refused], None, reason)

    # --- consumed by the caller ---------------------------------------------

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Delta:
        while (delta := self.poll()) is None:
            await self.arrival()
        return delta

    def poll(self) -> Delta | None:
        """The next delta if the queued outputs make one, else None: then `await stream.arrival()` (the
        mailbox's own future) and poll again; `__anext__` without a coroutine per message, for a door's hot
        loop. Raises the stream's error, and StopAsyncIteration once it ended. Under a stream interval a
        delta of fewer ids waits in `_filled` for the next (each output detokenized and matched against the
        stop strings as it arrives); an error after them is raised on the call after the one returning them."""
        items = self._queue.items
        while self.state != _CLOSED:
            if self._held is not None:
                item, self._held = self._held, None
            elif items:
                item = items.popleft()
            else:
                return None
            if type(item) is not SeqOutput:
                if self._filled:
                    self._held = item
                    return self._take_filled()
                self._fire(StreamEvent.READ_ERROR)
                raise error_of(item)
            want = self._interval if self.ids else 1  # the first message goes at once (TTFT)
            if self._coalesce and items and not item.finish:
                item = self._join_queued(item)
            delta = self._on_output(item)
            if delta is None:
                continue
            if not self._filled and (len(delta.token_ids) >= want or delta.finish_reason is not None):
                return delta
            self._filled.append(delta)
            if sum(len(d.token_ids) for d in self._filled) >= want or delta.finish_reason is not None:
                return self._take_filled()
        raise StopAsyncIteration

    def _join_queued(self, out: SeqOutput) -> SeqOutput:
        """`out` joined with the outputs queued behind it: a reader that fell behind gets one delta for all
        of them, one that keeps up one per step (queued contiguous, numbered by `_on_output_event`)."""
        if self._queue.empty() or out.finish:
            return out
        ids, finish, logprobs = list(out.token_ids), 0, list(out.logprobs)
        while not finish and not self._queue.empty():
            item = self._queue.get_nowait()
            if type(item) is not SeqOutput:
                self._held = item  # an error after the outputs: read on the next call
                break
            ids += item.token_ids
            logprobs += item.logprobs
            finish = item.finish
        return SeqOutput(out.request_id, out.token_index, ids, finish, out.queue_ms, out.cached_tokens, logprobs)

    def _take_filled(self) -> Delta:
        """The deltas `poll` held for the stream interval, as one (the last one's finish, usage and route)."""
        parts, self._filled = self._filled, []
        return msgspec.structs.replace(parts[-1], token_index=parts[0].token_index,
                                       text="".join(d.text for d in parts),
                                       token_ids=[i for d in parts for i in d.token_ids],
                                       logprobs=tuple(lp for d in parts for lp in d.logprobs))

    def _on_output(self, out: SeqOutput) -> Delta | None:
        first_index, new_ids = len(self.ids), out.token_ids
        if out.token_index == first_index and first_index and new_ids and not out.finish and self._no_stops \
                and not out.logprobs:  # most messages: ids after those handed out, all their text at once
            self.ids += new_ids
            return Delta(self.request_id, first_index, self._detok.steps(new_ids), new_ids)
        skip = max(len(self.ids) - out.token_index, 0)  # duplicates from a resend
        new_ids = out.token_ids[skip:] if skip else out.token_ids
        new_logprobs = out.logprobs[skip:]
        if not new_ids and not out.finish:
            return None
        if out.token_index == 0 and out.token_ids:
            self._queue_ms, self._cached = out.queue_ms, out.cached_tokens
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()
        first_index = len(self.ids)
        if not out.finish and not self._stop.stops:  # most messages: every id's text at once, nothing to cut
            self.ids += new_ids
            return Delta(self.request_id, first_index, self._detok.steps(new_ids), new_ids,
                         logprobs=tuple(new_logprobs[: len(new_ids)]))
        finish = FinishReason(out.finish) if out.finish else None
        text, taken, finish, stopped = cut_text(self._detok, self._stop, new_ids, finish, self._eos)
        if stopped:
            self._fire(StreamEvent.STOPPED)
        self.ids += taken
        return self._delta(first_index, text, taken, finish, tuple(new_logprobs[: len(taken)]))

    def _delta(self, index: int, text: str, ids: list[int], finish: FinishReason | None,
               logprobs: tuple[TokenLogprobs, ...] = ()) -> Delta:
        if finish is None:
            return Delta(self.request_id, index, text, ids, logprobs=logprobs)
        self._fire(StreamEvent.READ_LAST)
        now = time.monotonic()
        ttft = ((self._first_token_at or now) - self._arrival) * 1e3
        usage = Usage(len(self.prompt_ids), len(self.ids), self._cached)
        return Delta(self.request_id, index, text, ids, finish, usage,
                     Timings(self._queue_ms, ttft, (now - self._arrival) * 1e3), self.route, logprobs)

    @property
    def route(self) -> str:
        """The plan and the workers that served it: "gpu (gpu-0)", "gpu->cpu (gpu-0 -> cpu-1)"; after a
        move each placement: "gpu (gpu-0), resumed at token 12 on cpu (cpu-1)" ("retried" when no token
        had been streamed)."""
        first = self._handoff_route or (self.handoff.route() if self.handoff is not None else
                                        f"{self._hops[0][2].kind} ({worker_name(self._hops[0][2])})")
        return ", ".join([first] + [f"{how} at token {k} on {c.kind} ({worker_name(c)})"
                                    for how, k, c in self._hops[1:]])
