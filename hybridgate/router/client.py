"""Worker clients as the router sees them: one interface, a ZeroMQ implementation here.

The in-process implementation lives in `hybridgate.workers.inprocess` (it owns
an engine); the router only sees this interface, so it never imports workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from hybridgate import wire
from hybridgate.wire import Abort, AddRequest, Connect, EngineStats, Hello, Load, WorkerState

log = logging.getLogger("hybridgate.router")


class WorkerDead(msgspec.Struct, frozen=True):
    """Synthetic event: the worker went silent past the liveness timeout."""

    reason: str


# on_message(client, message): message is a wire Struct or WorkerDead.
MessageHandler = Callable[["WorkerClient", msgspec.Struct], None]


class WorkerClient(Protocol):
    endpoint: str
    kind: str | None
    state: WorkerState
    stats: EngineStats
    hello: Hello | None

    async def start(self, on_message: MessageHandler) -> None: ...

    def add(self, request: AddRequest) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def send(self, msg: msgspec.Struct) -> None: ...  # KV hand-off messages (HandoffReserve, Release, Resume)

    async def close(self) -> None: ...


class ZmqWorkerClient:
    """A DEALER with its own identity, connected to one worker's ROUTER.

    Liveness: every message from the worker counts; one silent for
    `dead_after_s` (its heartbeat is 0.1 s) is reported dead with `WorkerDead`.
    """

    def __init__(self, endpoint: str, *, dead_after_s: float = 1.0, ctx: zmq.asyncio.Context | None = None):
        self.endpoint = endpoint
        self.kind: str | None = None
        self.state = WorkerState.CONNECTING
        self.stats = EngineStats()
        self.hello: Hello | None = None
        self.dead_after_s = dead_after_s
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_seen = 0.0
        self._on_message: MessageHandler | None = None

    async def start(self, on_message: MessageHandler) -> None:
        self._on_message = on_message
        sock = self._socket = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"router-{uuid.uuid4().hex[:12]}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(self.endpoint)
        self._send(Connect(router_id=sock.getsockopt(zmq.IDENTITY).decode()))
        self._last_seen = time.monotonic()
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watchdog())]

    def add(self, request: AddRequest) -> None:
        self._send(request)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.state != WorkerState.DEAD:
            self._send(Abort(request_ids))

    def send(self, msg: msgspec.Struct) -> None:
        """Any router → worker message; the KV hand-off's (HandoffReserve, HandoffRelease, HandoffResume)."""
        self._send(msg)

    def _send(self, msg: msgspec.Struct) -> None:
        if self._socket is not None:
            self._socket.send_multipart(wire.encode(msg), flags=zmq.NOBLOCK)

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            self._last_seen = time.monotonic()
            try:
                msg = wire.decode(frames)
            except ValueError as exc:
                log.warning("worker %s sent a bad message: %s", self.endpoint, exc)
                continue
            if isinstance(msg, (Load, wire.Outputs)):
                self.stats = msg.stats
            if isinstance(msg, Hello):
                self.hello, self.kind = msg, msg.kind
            if not isinstance(msg, Load):
                self._on_message(self, msg)

    async def _watchdog(self) -> None:
        # Before HELLO the worker may still be loading its model: wait for it
        # without a liveness limit (the router's startup timeout covers it).
        while self.state in (WorkerState.CONNECTING, WorkerState.READY):
            await asyncio.sleep(self.dead_after_s / 10)
            silent = time.monotonic() - self._last_seen
            if self.hello is not None and silent > self.dead_after_s:
                self._on_message(self, WorkerDead(f"worker {self.endpoint} silent for {silent:.1f} s"))
                return

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None
