"""The ZeroMQ worker client: one implementation of `hybridgate.clients.interface.WorkerClient`.

The in-process implementation lives in `hybridgate.workers.inprocess` (it owns
an engine); the router only sees the interface, so it never imports workers.

Each `ZmqWorkerClient` runs its worker's lifecycle as the explicit state
machine `hybridgate.clients.lifecycle.Lifecycle` (its table of states and
events is in that module's docstring) and carries out the actions it returns.
The DEALER sets `ZMQ_IMMEDIATE`, so nothing queues for a worker that is not
connected; a send then fails (`add` returns False) instead of reaching a
successor on the same ipc path, and the socket is recreated on a new boot id
for the same reason.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from hybridgate import wire
from hybridgate.clients.interface import MessageHandler, StateChange, WorkerDead
from hybridgate.security.keys import Transport
from hybridgate.router.config import RouterConfig
from hybridgate.clients.lifecycle import (
    PROBE_FIRST_S,
    Exited,
    HelloSeen,
    Lifecycle,
    LifecycleEvent,
    MessageSeen,
    NewSocket,
    ProbeDue,
    ReadySeen,
    Refused,
    ReportDead,
    SendAbort,
    SendConnect,
    SendFailed,
    Silence,
)
from hybridgate.wire import (
    Abort,
    HandoffExported,
    HandoffExportFailed,
    HandoffImported,
    HandoffRefused,
    HandoffReservation,
    AddRequest,
    Connect,
    EngineStats,
    Hello,
    Load,
    Outputs,
    Overload,
    Ready,
    RequestError,
    WorkerState,
)

log = logging.getLogger("hybridgate.router")
DRAIN_BATCH = 256  # messages read in one go before the event loop runs other tasks


# --- helpers ------------------------------------------------------------------------------------

class RateLimitedLog:
    """A warning at most every `interval_s`, saying how many were suppressed in between."""

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0):
        self.logger, self.interval_s = logger, interval_s
        self._last = -float("inf")
        self._suppressed = 0

    def warning(self, fmt: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return
        if self._suppressed:
            fmt += f" ({self._suppressed} more suppressed in the last {self.interval_s:g} s)"
        self._last, self._suppressed = now, 0
        self.logger.warning(fmt, *args)


def missing_ipc_socket(endpoint: str) -> str | None:
    """The socket path of an `ipc://` endpoint when no file is there (nothing can be listening)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint.removeprefix("ipc://")
    return None if os.path.exists(path) else path


# --- the ZeroMQ client --------------------------------------------------------------------------

class ZmqWorkerClient:
    """A DEALER with its own identity, connected to one worker's ROUTER; its states are `lifecycle`.

    Liveness: every valid message from the worker counts (its heartbeat is
    0.1 s); silence moves it to SUSPECT after `suspect_after_s` (default half
    of `dead_after_s`) and to DEAD after `dead_after_s`. Every received frame
    goes through `_dispatch`: what does not decode, is not meant for a router,
    or makes a handler raise is dropped, counted in `wire_errors` and logged
    (rate-limited); the receive task never dies of what a worker sends.

    `name`: the label of this worker in metrics until its HELLO names it. `transport`: CURVE on
    a tcp:// endpoint (hybridgate.security.keys.Transport; None: plain sockets, the embedder's choice).
    """

    def __init__(self, endpoint: str, *, dead_after_s: float = RouterConfig.dead_after_s,
                 suspect_after_s: float | None = None, name: str = "", ctx: zmq.asyncio.Context | None = None, transport: Transport | None = None):
        self.endpoint = endpoint
        self.transport = transport
        self.kind: str | None = None
        self.stats = EngineStats()
        self.hello: Hello | None = None
        self.dead_after_s = dead_after_s
        self.lifecycle = Lifecycle(name or endpoint, dead_after_s=dead_after_s, suspect_after_s=suspect_after_s)
        self.wire_errors = 0  # frames dropped by _dispatch
        self.sends_lost = 0  # messages queued for sending that then failed (`_deferred_send_done`)
        self._name = name
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._plain: zmq.Socket | None = None  # a plain view of _socket, for `_drain`
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._last_seen = 0.0
        self._on_message: MessageHandler | None = None
        self._drop_log = RateLimitedLog(log)
        self._receivers = {Hello: self._on_hello, Ready: self._on_ready, Load: self._on_load, Outputs: self._on_outputs,
                           RequestError: self._on_request_error, Overload: self._on_overload,
                           **{t: self._on_handoff for t in (HandoffReservation, HandoffExported, HandoffExportFailed,
                                                             HandoffImported, HandoffRefused)}}
        self._actions = {SendConnect: self._do_connect, SendAbort: self._do_abort, NewSocket: self._do_new_socket,
                         ReportDead: self._do_report_dead}

    @property
    def state(self) -> WorkerState:
        return self.lifecycle.state

    @state.setter
    def state(self, state: WorkerState) -> None:
        # The router decides one thing itself: a worker serving another model is refused.
        if state != WorkerState.REFUSED:
            raise ValueError(f"only REFUSED is set from outside the lifecycle, got {state.name}")
        self._event(Refused())

    @property
    def name(self) -> str:
        """Stable label: the worker's own name (HELLO), else the one given here, else the endpoint."""
        return (self.hello.name if self.hello is not None and self.hello.name else "") or self._name or self.endpoint

    async def start(self, on_message: MessageHandler) -> None:
        self._on_message = on_message
        self._open_socket()
        self._last_seen = time.monotonic()
        self._tasks = [self._spawn(self._recv_loop), self._spawn(self._ticker)]

    def add(self, request: AddRequest) -> bool:
        """Send a request; False when it could not be sent now (place it elsewhere or fail it)."""
        if self.state not in (WorkerState.READY, WorkerState.SUSPECT) or not self._send(request):
            return False
        self.lifecycle.started(request.request_id)
        return True

    def abort(self, request_ids: list[str]) -> None:
        """Best effort, whatever the state: a worker thought dead may still be running them."""
        for rid in request_ids:
            self.lifecycle.finished(rid)
        if request_ids and self.state != WorkerState.REFUSED:
            self._send(Abort(list(request_ids)))

    def worker_exited(self, reason: str) -> None:
        """Its process is known to have ended (serve's supervisor saw it): dead now, not after the timeout."""
        self._event(Exited(reason))

    def send(self, msg: msgspec.Struct) -> bool:
        """Any router → worker message, such as the KV hand-off's (HandoffReserve, HandoffRelease,
        HandoffResume); False when it could not be sent."""
        return self._send(msg)

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(0)
            self._socket, self._plain = None, None

    # --- sockets ---

    def _open_socket(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"router-{uuid.uuid4().hex[:12]}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        if self.transport is not None:
            self.transport.client(sock, self.endpoint)
        sock.connect(self.endpoint)
        self._socket, self._plain = sock, zmq.Socket.shadow(sock.underlying)

    def _send(self, msg: msgspec.Struct) -> bool:
        """Never raises: a full or unconnected pipe (EAGAIN) is a failed send, reported to the lifecycle."""
        if self._socket is None:
            return False
        try:
            # zmq.asyncio: a NOBLOCK send is tried at once; its failure comes back in the future
            # (only behind an earlier blocking send, which this client never makes, would it wait).
            sent = self._socket.send_multipart(wire.encode(msg), flags=zmq.NOBLOCK)
            if not sent.done():
                sent.add_done_callback(functools.partial(self._deferred_send_done, type(msg).__name__))
                return True
            sent.result()
            return True
        except zmq.Again:
            if not isinstance(msg, Connect):  # probes fail routinely while nothing listens
                self._event(SendFailed(f"{type(msg).__name__} not sent: no connected worker, or its queue is full"))
            return False
        except zmq.ZMQError as exc:
            log.warning("worker %s: sending %s failed: %s", self.name, type(msg).__name__, exc)
            return False

    def _deferred_send_done(self, what: str, sent: asyncio.Future) -> None:
        """A send that went out after `_send` returned True; its failure is said and counted here, since
        no caller waits for it (cancelled: this client closed or replaced its socket, which ends its work)."""
        if sent.cancelled() or sent.exception() is None:
            return
        self.sends_lost += 1
        log.warning("worker %s: a queued %s was not sent (%s: %s); it is lost", self.name, what,
                    type(sent.exception()).__name__, sent.exception())

    # --- receiving ---

    def _spawn(self, run) -> asyncio.Task:
        """A task that, should it ever end by itself, is said loudly and restarted."""
        task = asyncio.create_task(run())

        def ended(task: asyncio.Task) -> None:
            # _dispatch catches everything a worker can cause; this is for what it cannot (a bug
            # here): never a silent end of all traffic from, or all probes to, this worker.
            if task.cancelled() or self._closing:
                return
            log.error("worker %s: task %s ended (%r); restarting it", self.name, run.__name__, task.exception(),
                      exc_info=task.exception())
            self._tasks = [t for t in self._tasks if t is not task]
            asyncio.get_running_loop().call_later(0.1, lambda: self._closing or self._tasks.append(self._spawn(run)))

        task.add_done_callback(ended)
        return task

    async def _recv_loop(self) -> None:
        while True:
            sock = self._socket
            try:
                frames = await sock.recv_multipart()
                self._dispatch(frames)
                self._drain(sock)
            except zmq.ZMQError:
                if self._socket is not sock:  # replaced under us (new boot id): read the new one
                    continue
                raise

    def _drain(self, sock: zmq.asyncio.Socket) -> None:
        """Read what else has arrived, without a future per message.

        zmq.asyncio's future, poller event and flag checks cost more than the
        decode and dispatch of an output message (the gateway's largest CPU
        cost per streamed token, measured by `bench gateway`); a plain socket
        sharing the same underlying one reads the rest at once. At most
        DRAIN_BATCH messages, so that the streams' tasks run between batches.
        """
        plain = self._plain
        for _ in range(DRAIN_BATCH):
            if self._socket is not sock:  # a message replaced the socket (new boot id): read the new one next
                return
            try:
                frames = plain.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(frames)

    def _dispatch(self, frames: list[bytes]) -> None:
        """The one entry of every frame from the worker: decode, type → handler, guard."""
        try:
            msg = wire.decode(frames)
        except Exception as exc:  # ValueError from wire.decode; anything else would be a decoder bug
            return self._drop(f"undecodable message: {exc}")
        receiver = self._receivers.get(type(msg))
        if receiver is None:
            return self._drop(f"{type(msg).__name__} is not a message a worker sends")
        self._last_seen = time.monotonic()
        try:
            receiver(msg)
        except Exception as exc:
            log.exception("worker %s: handling %s failed", self.name, type(msg).__name__)
            self._drop(f"handling {type(msg).__name__} failed: {exc!r}")

    def _drop(self, why: str) -> None:
        self.wire_errors += 1
        self._drop_log.warning("worker %s: dropped a frame: %s", self.name, why)

    def _on_hello(self, msg: Hello) -> None:
        self.hello, self.kind = msg, msg.kind
        self._on_message(self, msg)  # first: the router refuses a worker with another model
        self._event(HelloSeen(msg.boot_id, msg.ready))

    def _on_ready(self, msg: Ready) -> None:
        self._event(ReadySeen())
        self._on_message(self, msg)

    def _on_load(self, msg: Load) -> None:
        self.stats = msg.stats
        self._event(MessageSeen())

    def _on_outputs(self, msg: Outputs) -> None:
        self.stats = msg.stats
        for out in msg.outputs:
            if out.finish:
                self.lifecycle.finished(out.request_id)
        self._event(MessageSeen())
        self._on_message(self, msg)

    def _on_request_error(self, msg: RequestError) -> None:
        self.lifecycle.finished(msg.request_id)
        self._event(MessageSeen())
        self._on_message(self, msg)

    def _on_handoff(self, msg: msgspec.Struct) -> None:
        """The KV hand-off's worker → router messages: the router's hand-off state machine takes them."""
        self._event(MessageSeen())
        self._on_message(self, msg)

    def _on_overload(self, msg: Overload) -> None:
        for rid in msg.request_ids:
            self.lifecycle.finished(rid)
        self._event(MessageSeen())
        self._on_message(self, msg)

    # --- the lifecycle's events and actions ---

    async def _ticker(self) -> None:
        period = min(self.dead_after_s / 10, PROBE_FIRST_S)
        tick = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            # Time this event loop was busy elsewhere is not the worker's silence: its messages may
            # be waiting unread. (Never peek at the socket here: reading ZMQ_EVENTS outside the
            # asyncio wrapper eats the edge its pending recv waits for.)
            self._last_seen += max(0.0, now - tick - 2 * period)
            tick = now
            self._event(Silence(now - self._last_seen), now)
            if self.lifecycle.probing and now >= self.lifecycle.next_probe_at:
                self._event(ProbeDue(), now)

    def _event(self, event: LifecycleEvent, now: float | None = None) -> None:
        old = self.state
        for action in self.lifecycle.on(event, time.monotonic() if now is None else now):
            self._actions[type(action)](action)
        if self.state != old and self._on_message is not None:
            self._on_message(self, StateChange(old, self.state))

    def _do_connect(self, action: SendConnect) -> None:
        if self._socket is not None:
            self._send(Connect(router_id=self._socket.getsockopt(zmq.IDENTITY).decode()))

    def _do_abort(self, action: SendAbort) -> None:
        log.info("worker %s is back (same boot): aborting the %d sequences given up on", self.name,
                 len(action.request_ids))
        self._send(Abort(list(action.request_ids)))

    def _do_new_socket(self, action: NewSocket) -> None:
        # Anything queued for the old worker dies with the old socket; the new one starts empty.
        if self._socket is not None:
            self._socket.close(0)
        self._open_socket()
        self._last_seen = time.monotonic()
        self.stats = EngineStats()  # a new worker's counters start at zero

    def _do_report_dead(self, action: ReportDead) -> None:
        self._on_message(self, WorkerDead(action.reason, action.boot_id))
