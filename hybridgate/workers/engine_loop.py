"""The engine's loop: drain inputs, step the engine core, push outputs.

The loop is plain synchronous code in the worker's main thread (or a thread
of the in-process client); socket I/O happens elsewhere and reaches it through
`Inbox`. vLLM's v1 engine core has the same shape.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from hybridgate.wire import ERROR_QUEUE_FULL, Abort, AddRequest, Outputs, Overload, RequestError, SeqOutput
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.guard import Refusals
from hybridgate.workers.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientGone:
    """From the I/O thread: this router disconnected; its sequences end."""


@dataclass(frozen=True)
class ClientCongested:
    """From the I/O thread: this router's queue is full; its sequences end and it is told with OVERLOAD."""

    reason: str


class Inbox:
    """What the I/O side hands the engine: new requests on a queue, aborts on a fast path.

    The queue holds (client, AddRequest | ClientGone | ClientCongested | a hand-off
    message | an export event), or None to wake an idle engine. ADDs are bounded:
    at most `max_adds` wait in it (`offer_add` refuses one more, counted in
    `refusals` as "inbox"), so a router that sends faster than a busy engine takes
    cannot grow it without end; the other messages are bounded by what they
    answer (one per client, reservation or export).
    """

    def __init__(self, max_adds: int = 1024, refusals: Refusals | None = None) -> None:
        if max_adds < 1:
            raise ValueError(f"max_adds: must be >= 1, got {max_adds}")
        self.requests: queue.Queue = queue.Queue()
        self.max_adds, self.refusals = max_adds, refusals or Refusals()
        self._adds = 0  # ADDs in `requests`, not yet taken by the engine
        self._aborts: list[tuple[bytes, list[str]]] = []
        self._lock = threading.Lock()

    def offer_add(self, client: bytes, msg: AddRequest) -> bool:
        """Queue an ADD unless `max_adds` are waiting already (False: refused and counted)."""
        with self._lock:
            if self._adds >= self.max_adds:
                full = True
            else:
                full, self._adds = False, self._adds + 1
        if full:
            self.refusals.add("inbox", self.max_adds)
            return False
        self.requests.put((client, msg))
        return True

    def took_add(self) -> None:
        """The engine took an ADD (one put on `requests` directly, as tests do, was never counted)."""
        with self._lock:
            self._adds = max(0, self._adds - 1)

    def refusal(self, request_id: str) -> RequestError:
        """The answer to an ADD `offer_add` refused: queue_full, so the router places it elsewhere."""
        return RequestError(request_id, f"the worker's inbox holds {self.max_adds} requests not yet taken by its "
                            "engine (--max-num-waiting)", ERROR_QUEUE_FULL)

    def put_abort(self, client: bytes, msg: Abort) -> None:
        with self._lock:
            self._aborts.append((client, msg.request_ids))
        self.requests.put(None)  # wake an idle engine

    def take_aborts(self) -> list[tuple[bytes, list[str]]]:
        with self._lock:
            aborts, self._aborts = self._aborts, []
        return aborts


class EngineLoop:
    """The busy loop. `send(client, message)` delivers outputs and errors.

    Nothing one message or one sequence does ends the loop: a message whose
    handling raises is answered with a `RequestError` (when it names a request)
    and a failed step fails the sequences it is blamed on (`EngineCore.step`).
    """

    def __init__(self, engine: EngineCore, inbox: Inbox, send: Callable[[bytes, object], None],
                 send_handoff: Callable[[bytes, object], None] | None = None):
        self.engine = engine
        self.inbox = inbox
        self.send = send
        self.send_handoff = send_handoff  # replies on the hand-off socket (CPU worker)
        self.stopping = threading.Event()
        engine.constraints.on_compiled = lambda: inbox.requests.put(None)  # wake an idle loop
        self._handlers = {AddRequest: self._on_add, ClientGone: self._on_client_gone,
                          ClientCongested: self._on_client_congested}

    def run(self) -> None:
        while not self.stopping.is_set():
            # Sequences waiting only for their grammar do not spin the loop: the compile wakes it.
            self._drain(block=not self.engine.scheduler.has_work())
            self._apply_aborts(set())
            self.engine.handoffs.expire()
            self._flush_handoff_notices()
            self.engine.refresh_stats()  # the heartbeat reports the queue this step starts on
            if not self.engine.has_work():
                continue
            try:
                stepped = self.engine.step()
            except Exception as exc:  # outside the runner (scheduling, bookkeeping): no one to blame
                log.exception("engine step failed")
                self._fail_batch(exc)
                continue
            for seq, error in self.engine.take_failures():
                self.send(seq.client, error)
            self._apply_aborts({id(s) for s in stepped})
            self._push([s for s in stepped if s.status != SequenceStatus.FINISHED_ABORTED],
                       [s for s in self.engine.last_prefilled if not s.status.finished])
            self._flush_handoff_notices()

    def _flush_handoff_notices(self) -> None:
        notices, replies = self.engine.handoffs.take_notices()
        for client, msg in notices:
            self.send(client, msg)
        for peer, msg in replies:
            if self.send_handoff is not None:
                self.send_handoff(peer, msg)

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.requests.get(timeout=0.05) if block else self.inbox.requests.get_nowait()
            while True:
                if item is not None:
                    self._handle(*item)
                item = self.inbox.requests.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, client: bytes, msg: object) -> None:
        try:
            handler = self._handlers.get(type(msg))
            if handler is not None:
                handler(client, msg)
            elif self.engine.handoffs.handles(msg):  # the KV hand-off's messages (reserve, release, resume, ...)
                self._apply_aborts(set())  # an abort that overtook its reservation applies first, as for ADD
                self.engine.handoffs.handle(client, msg)
            else:
                log.error("the engine got a message it has no handler for: %s", type(msg).__name__)
        except Exception as exc:  # a bug met by one message must not end the loop
            log.exception("handling %s failed", type(msg).__name__)
            if isinstance(msg, AddRequest):
                self.engine.abort([msg.request_id], client)
                self.send(client, RequestError(msg.request_id, f"the worker failed to add the request: {exc}"))

    def _on_add(self, client: bytes, msg: AddRequest) -> None:
        self.inbox.took_add()
        # Aborts that arrived before this ADD apply first: a router that aborts a request and
        # sends it again under the same id (a resumed stream) must not meet its old sequence.
        self._apply_aborts(set())
        error = self.engine.add(msg, client)
        if error is not None:
            self.send(client, error)

    def _on_client_gone(self, client: bytes, msg: ClientGone) -> None:
        self.engine.abort_client(client)

    def _on_client_congested(self, client: bytes, msg: ClientCongested) -> None:
        ids = self.engine.abort_client(client)
        if ids:
            log.warning("router %r is not reading (%s); ending its %d requests and telling it", client, msg.reason,
                        len(ids))
            self.send(client, Overload(ids, msg.reason))

    def _apply_aborts(self, stepped: set[int]) -> None:
        for client, ids in self.inbox.take_aborts():
            for seq in self.engine.abort(ids, client):
                if id(seq) in stepped:  # sampled in the step during which its abort arrived
                    self.engine.stats.tokens_after_abort += len(seq.output_ids) - seq.sent

    def _push(self, stepped: list[Sequence], prefilled: list[Sequence] = ()) -> None:
        by_client: dict[bytes, list[SeqOutput]] = defaultdict(list)
        for seq in stepped:
            by_client[seq.client].append(output_of(seq))
        for seq in prefilled:  # progress only: no ids (the router's stall timer counts it)
            by_client[seq.client].append(SeqOutput(seq.request_id, seq.first_token_index + seq.sent, []))
        stats = self.engine.refresh_stats()
        for client, outputs in by_client.items():
            self.send(client, Outputs(outputs, stats))

    def _fail_batch(self, exc: Exception) -> None:
        seqs = list(self.engine.scheduler.running)
        self.engine.fail(seqs)
        for seq in seqs:
            self.send(seq.client, RequestError(seq.request_id, f"worker step failed: {exc}"))
