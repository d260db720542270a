"""The worker's I/O thread: the ROUTER socket, its guarded dispatch table, heartbeats and overload notices.

Workers bind; routers connect a DEALER with their own identity, so several
gateways can share a worker: outputs go back to the identity that sent the
request. This thread alone touches the socket: it answers CONNECT with HELLO
(and READY once warm), queues requests for the engine, hands aborts to it on a
fast path (a locked list it reads before every step, not the request queue),
forwards the engine's outputs and sends a LOAD heartbeat every `heartbeat_s`.
No frame can end it (`WorkerIO`).
"""

from __future__ import annotations

import errno
import logging
import threading
import time

import msgspec
import zmq

from hybridgate import wire
from hybridgate.security.keys import Transport, TransportConfig
from hybridgate.wire import (
    ERROR_INVALID_REQUEST,
    Abort,
    AddRequest,
    Connect,
    EngineStats,
    Hello,
    Load,
    MsgType,
    Overload,
    Ready,
    RequestError,
)
from hybridgate.workers.engine_loop import ClientCongested, ClientGone, Inbox
from hybridgate.workers.guard import WireErrors
from hybridgate.workers.handoff import HandoffIncoming

log = logging.getLogger("hybridgate.worker")
_MSG_TYPES = {t.value for t in MsgType}


def max_frame_bytes(max_model_len: int) -> int:
    """The largest message body a worker accepts: 16 bytes per token of context plus 64 KiB.

    An ADD of a full-context prompt packs each id in at most 5 msgpack bytes
    (9 for any int), and its stop strings take at most 16 x 256 bytes; an ABORT
    of thousands of request ids fits. Anything larger is refused unread.
    """
    return 16 * max_model_len + (64 << 10)


def handoff_frame_bytes(max_model_len: int, num_kv_heads: int, head_dim: int) -> int:
    """The largest frame a KV hand-off carries to this worker.

    A hand-off of at most `max_model_len` tokens sends one K or V frame of
    `[num_tokens, kv_heads, head_dim]` per layer (num_kv_heads and head_dim: the
    largest layer's, `KVLayout.largest`, where layers differ), in at most 4 bytes an element
    (float32, the widest of `wire.HANDOFF_DTYPES`); its header carries at most
    a context of ids and the request's fields, as an ADD does (`max_frame_bytes`).
    """
    return max(max_model_len * num_kv_heads * head_dim * 4, max_frame_bytes(max_model_len))


class WorkerIO:
    """The I/O thread: owns the ROUTER socket.

    Every frame received goes through `_on_frames`: one guarded table from the
    type byte to a (decoder, handler) pair. A message that is not exactly a
    type frame and a body, whose type a worker does not take, whose body is
    over `max_frame_bytes` or does not decode, is refused: counted in
    `wire_errors`, logged (rate-limited) and answered with a `RequestError`
    when it is an ADD whose request id can be read. Checks of an ADD's content
    happen in `EngineCore.add`, which knows the model.

    Sending to a router (`_send`), ROUTER_MANDATORY tells two failures apart:
    EHOSTUNREACH, the router is gone (a normal router shutdown, logged at INFO),
    and EAGAIN, its queue is full (it is not reading). Either way its sequences
    end; a congested router is told which with an OVERLOAD message, retried on
    every pass until it goes through or the router is gone.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, hello: Hello, inbox: Inbox, heartbeat_s: float,
                 wire_errors: WireErrors | None = None, send_hwm: int = 100_000, transport: Transport | None = None,
                 handoff_bind: str = "", handoff_max_frame_bytes: int = 0):
        self.max_frame_bytes = max_frame_bytes(hello.max_model_len)
        transport = transport or Transport(TransportConfig(insecure_tcp=True))  # tests' and benchmarks' sockets
        self.handoff_socket = None
        if hello.handoff_endpoint:  # CPU workers: KV hand-offs from GPU workers (header, then parts)
            if handoff_max_frame_bytes < 1:
                raise ValueError(f"handoff_max_frame_bytes {handoff_max_frame_bytes}: a worker with a hand-off "
                                 "endpoint needs its largest hand-off frame (`handoff_frame_bytes`), at least 1")
            self.handoff_socket = ctx.socket(zmq.ROUTER)
            self.handoff_socket.setsockopt(zmq.LINGER, 0)
            self.handoff_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone sender fails, counted
            self.handoff_socket.setsockopt(zmq.RCVBUF, 4 << 20)  # fewer, larger kernel copies (capped by rmem_max)
            # libzmq checks each frame against this and drops the connection of a peer sending a larger one,
            # unread: no frame past the largest a legitimate hand-off sends is ever buffered whole.
            self.handoff_socket.setsockopt(zmq.MAXMSGSIZE, handoff_max_frame_bytes)
            bind = handoff_bind or hello.handoff_endpoint  # HELLO carries the advertised endpoint
            transport.server(self.handoff_socket, bind, "--handoff-endpoint")
            self.handoff_socket.bind(bind)
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, send_hwm)  # messages queued per router before it counts as congested
        # Memory guard only: libzmq drops the connection of a peer sending a frame this large
        # (unseen, so uncounted); frames up to it are read and refused, counted, by `_on_frames`.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 16 * self.max_frame_bytes)
        transport.server(self.socket, endpoint)
        self.socket.bind(endpoint)
        self.from_engine = ctx.socket(zmq.PULL)
        self._engine_addr = f"inproc://engine-out-{id(self)}"
        self.from_engine.bind(self._engine_addr)
        self.hello, self.inbox, self.heartbeat_s = hello, inbox, heartbeat_s
        self.wire_errors = wire_errors or WireErrors()
        self.clients: set[bytes] = set()
        self.handoff_replies_lost = 0  # replies to hand-off senders that could not be sent (`_reply_to_handoff`)
        self.congested: set[bytes] = set()  # routers told (or to be told) to the engine as congested
        self._pending_overload: dict[bytes, Overload] = {}  # OVERLOAD messages not yet sent
        self.stats = EngineStats()
        self.stopping = threading.Event()
        self._ready = threading.Event()
        self._inbound = {
            MsgType.CONNECT.value: (msgspec.msgpack.Decoder(Connect), self._on_connect),
            MsgType.ADD.value: (msgspec.msgpack.Decoder(AddRequest), self._on_add),
            MsgType.ABORT.value: (msgspec.msgpack.Decoder(Abort), self._on_abort),
        }
        for kind in (MsgType.HANDOFF_RESERVE, MsgType.HANDOFF_RELEASE, MsgType.HANDOFF_RESUME):
            self._inbound[kind.value] = (msgspec.msgpack.Decoder(wire.MESSAGE_TYPES[kind]), self._on_add)

    def engine_sender(self, ctx: zmq.Context):
        """A send(client, message) for the engine thread (its own PUSH socket)."""
        push = self._engine_push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._engine_addr)

        def send(client: bytes, msg) -> None:
            push.send_multipart([client, *wire.encode(msg)], copy=False)

        return send

    def engine_handoff_sender(self):
        """A send(peer, message) for the engine thread's replies on the hand-off socket
        (after engine_sender: it shares that PUSH socket; an empty first frame marks them)."""

        def send(peer: bytes, msg) -> None:
            self._engine_push.send_multipart([b"", peer, *wire.encode(msg)], copy=False)

        return send

    def set_ready(self) -> None:
        """Called from the engine thread; the I/O thread sends READY on its next pass."""
        self._ready.set()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.from_engine, zmq.POLLIN)
        if self.handoff_socket is not None:
            poller.register(self.handoff_socket, zmq.POLLIN)
        next_beat = time.monotonic()
        while not self.stopping.is_set():
            events = dict(poller.poll(timeout=max(0.0, next_beat - time.monotonic()) * 1e3))
            if self._pending_overload:
                self._retry_overloads()
            if self.socket in events:
                self._recv_from_router()
            if self.from_engine in events:
                self._forward_engine_output()
            if self.handoff_socket is not None and self.handoff_socket in events:
                self._recv_handoff()
            if self._ready.is_set() and not self.hello.ready:
                self.hello = msgspec.structs.replace(self.hello, ready=True)
                for client in list(self.clients):
                    self._send(client, Ready(self.hello.kind))
            if time.monotonic() >= next_beat:
                self.stats.wire_decode_errors = self.wire_errors.total
                self.stats.handoff_replies_lost = self.handoff_replies_lost
                for client in list(self.clients):
                    self._send(client, Load(self.stats))
                next_beat = time.monotonic() + self.heartbeat_s

    def _recv_from_router(self) -> None:
        while True:
            try:
                client, *frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_frames(client.bytes, frames)

    def _on_frames(self, client: bytes, frames: list) -> None:
        """Decode and dispatch one message; refuse (count, log, maybe answer) anything else."""
        kind = frames[0].bytes if frames else b""
        entry = self._inbound.get(kind)
        try:
            if entry is None:
                raise _Refused("unknown type", f"type byte {kind[:8]!r} is not one a worker takes")
            if len(frames) != 2:
                raise _Refused("bad frames", f"{MsgType(kind).name} in {len(frames)} frames, expected 2")
            body = frames[1].buffer
            if len(body) > self.max_frame_bytes:
                raise _Refused("oversized", f"{MsgType(kind).name} body of {len(body)} bytes > "
                                            f"{self.max_frame_bytes} (16 bytes per token of context + 64 KiB)")
            decoder, handler = entry
            try:
                msg = decoder.decode(body)
            except (msgspec.DecodeError, ValueError) as exc:
                self._answer_bad_add(client, kind, body, exc)
                raise _Refused("undecodable", f"bad {MsgType(kind).name} body: {exc}") from None
            handler(client, msg)
        except _Refused as exc:
            self.wire_errors.record(exc.kind, f"from {client[:32]!r}: {exc.detail}")
        except Exception as exc:  # a handler's bug must not end the thread; count it as refused
            log.exception("handling a message from %r failed", client[:32])
            self.wire_errors.record("handler failed", f"from {client[:32]!r}: {type(exc).__name__}: {exc}")

    def _answer_bad_add(self, client: bytes, kind: bytes, body, exc: Exception) -> None:
        if kind != MsgType.ADD.value:
            return
        try:
            rid = _ADD_ID_DECODER.decode(body).request_id
        except (msgspec.DecodeError, ValueError):
            return
        self._send(client, RequestError(rid, f"the worker could not decode the request: {exc}",
                                        ERROR_INVALID_REQUEST))

    def _recv_handoff(self) -> None:
        """KV hand-off messages, frames not copied, to the engine (which checks and imports them)."""
        while True:
            try:
                peer, *frames = self.handoff_socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            kind = frames[0].bytes if frames else b""
            if kind not in (MsgType.HANDOFF_KV.value, MsgType.HANDOFF_KV_PART.value) or len(frames) < 2:
                log.warning("dropping a message of type %r on the hand-off socket", kind)
                continue
            self.inbox.requests.put((peer.bytes, HandoffIncoming(kind, frames[1].buffer, frames[2:])))

    def _on_connect(self, client: bytes, msg: Connect) -> None:
        self.clients.add(client)
        self.congested.discard(client)
        self._send(client, self.hello)
        if self.hello.ready:
            self._send(client, Ready(self.hello.kind))

    def _on_add(self, client: bytes, msg) -> None:
        """An ADD (bounded: past the inbox's bound it is refused, for another worker to take), or a
        hand-off message (bounded by the reservations it answers)."""
        self.clients.add(client)
        if not isinstance(msg, AddRequest):
            self.inbox.requests.put((client, msg))
        elif not self.inbox.offer_add(client, msg):  # the engine is far behind: another worker may take it
            self._send(client, self.inbox.refusal(msg.request_id))

    def _on_abort(self, client: bytes, msg: Abort) -> None:
        self.inbox.put_abort(client, msg)  # the fast path: the engine applies it before its next step

    def _forward_engine_output(self) -> None:
        while True:
            try:
                client, *frames = self.from_engine.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not client:  # a reply on the hand-off socket: [b"", peer, kind, body]
                self._reply_to_handoff(frames)
                continue
            kind, body = frames
            if kind == MsgType.OVERLOAD.value:
                self._queue_overload(client, wire.decode([kind, body]))
            else:
                self._send(client, None, [kind, body])

    def _reply_to_handoff(self, frames: list[bytes]) -> None:
        """Send the engine's reply [peer, kind, body] to a hand-off sender; one that cannot go (the sender
        is gone or not reading, or this worker has no hand-off socket) is said and counted."""
        try:
            if self.handoff_socket is None:
                raise zmq.ZMQError(errno.ENOTSUP, "this worker has no hand-off socket")
            self.handoff_socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # zmq.Again included
            self.handoff_replies_lost += 1
            self.stats.handoff_replies_lost = self.handoff_replies_lost
            kind = MsgType(frames[1]).name if len(frames) > 1 and frames[1] in _MSG_TYPES else "?"
            log.warning("hand-off reply %s to %r lost: %s", kind, frames[0][:32], exc)

    def _queue_overload(self, client: bytes, msg: Overload) -> None:
        old = self._pending_overload.get(client)
        if old is not None:
            msg = Overload(old.request_ids + msg.request_ids, msg.reason)
        self._pending_overload[client] = msg
        self._retry_overloads()

    def _retry_overloads(self) -> None:
        for client, msg in list(self._pending_overload.items()):
            if self._send(client, msg, overload=True) != "again":
                del self._pending_overload[client]

    def _send(self, client: bytes, msg, frames: list | None = None, overload: bool = False) -> str:
        """Send to a router; "sent", "gone" (it disconnected) or "again" (its queue is full)."""
        try:
            self.socket.send_multipart([client, *(frames or wire.encode(msg))], zmq.NOBLOCK)
        except zmq.Again:
            if not overload and client not in self.congested:
                self.congested.add(client)
                self.inbox.requests.put((client, ClientCongested("its queue to this worker is full")))
            return "again"
        except zmq.ZMQError as exc:
            if client in self.clients and exc.errno == errno.EHOSTUNREACH:
                # The router closed its socket: a normal shutdown, or a crash its supervisor reports.
                log.info("router %r disconnected; ending its requests", client[:32])
            elif client in self.clients:
                log.warning("cannot send to router %r (%s); ending its requests", client[:32], exc)
            self.clients.discard(client)
            self.congested.discard(client)
            self._pending_overload.pop(client, None)
            self.inbox.requests.put((client, ClientGone()))
            return "gone"
        self.congested.discard(client)
        return "sent"

    def close(self) -> None:
        if hasattr(self, "_engine_push"):
            self._engine_push.close(0)
        self.socket.close(0)
        self.from_engine.close(0)
        if self.handoff_socket is not None:
            self.handoff_socket.close(0)


class _Refused(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class _RequestId(msgspec.Struct):
    request_id: str


_ADD_ID_DECODER = msgspec.msgpack.Decoder(_RequestId)  # reads the id of an ADD whose body does not decode
