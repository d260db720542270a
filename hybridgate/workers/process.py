"""The worker process: one ROUTER socket, an I/O thread, the engine loop on the main thread.

Workers bind; routers connect a DEALER with their own identity, so several
gateways can share a worker: outputs go back to the identity that sent the
request. The I/O thread alone touches the socket: it answers CONNECT with
HELLO (and READY once warm), queues requests for the engine, takes aborts on a
fast path (dispatched on the type byte before decoding), forwards the engine's
outputs and sends a LOAD heartbeat every `heartbeat_s`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from hybridgate import wire
from hybridgate.config import setting
from hybridgate.wire import Connect, EngineStats, Hello, Load, MsgType, Ready
from hybridgate.workers.engine import EngineCore, EngineLoop, Inbox
from hybridgate.workers.handoff import DEFAULT_RESERVATION_TIMEOUT_S, HandoffConfig, HandoffIncoming
from hybridgate.workers.scheduler import SchedulerConfig

log = logging.getLogger("hybridgate.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs; plain values, so it crosses `spawn`."""

    model_path: str
    endpoint: str
    kind: str = "gpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    threads: int | None = None
    device: str | None = None
    kv_cache_memory: str | None = None  # bytes ("2GiB") or a fraction; see TorchRunner
    prefix_caching: bool = True
    enforce_eager: bool = False
    heartbeat_s: float = 0.1
    parent_pid: int | None = None  # exit when this process dies
    handoff_endpoint: str = setting(
        "", "CPU workers: where to bind the socket for incoming KV hand-offs (ipc://PATH or tcp://HOST:PORT); "
        "default: ENDPOINT.handoff for an ipc:// endpoint, none for tcp://", flag="--handoff-endpoint")
    handoff_buffer_memory: str = setting(
        "256MiB", "GPU workers: the pinned host slab KV hand-offs stream through (bytes, e.g. 256MiB); "
        "hand-offs larger than it stream layer by layer", flag="--handoff-buffer-memory")
    cache_imported_kv: bool = setting(
        False, "CPU workers: register KV imported by hand-offs in the prefix cache (off: a worker's outputs "
        "never depend on which hand-offs came before)", flag="--cache-imported-kv")
    handoff_reservation_timeout_s: float = setting(
        DEFAULT_RESERVATION_TIMEOUT_S, "CPU workers: seconds a KV hand-off reservation waits for its KV",
        low=0, low_open=True)

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"kind must be 'gpu' or 'cpu', got {self.kind!r}")
        if not self.endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"endpoint must start with ipc://, tcp:// or inproc://, got {self.endpoint!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.handoff_endpoint and not self.handoff_endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"handoff_endpoint must start with ipc://, tcp:// or inproc://, got "
                             f"{self.handoff_endpoint!r}")
        if self.handoff_reservation_timeout_s <= 0:
            raise ValueError(f"handoff_reservation_timeout_s must be > 0, got {self.handoff_reservation_timeout_s}")
        self.handoff_buffer_bytes  # raises on a bad size

    @property
    def handoff_buffer_bytes(self) -> int:
        from hybridgate.workers.memory import parse_memory

        value = parse_memory(self.handoff_buffer_memory, gpu=False)
        if value <= 1:
            raise ValueError(f"handoff_buffer_memory: expected bytes (e.g. 256MiB), got {self.handoff_buffer_memory!r}")
        return int(value)

    @property
    def resolved_handoff_endpoint(self) -> str:
        """CPU workers: the hand-off socket's endpoint ("" = none): the setting, else derived from `endpoint`."""
        if self.kind != "cpu":
            return ""
        if self.handoff_endpoint:
            return self.handoff_endpoint
        return "" if self.endpoint.startswith("tcp://") else self.endpoint + ".handoff"


def build_runner(config: WorkerConfig):
    """The model runner of `config.kind` (torch imported only here)."""
    from hybridgate.models import load_gguf

    model = load_gguf(config.model_path)
    if config.kind == "gpu":
        import torch

        from hybridgate.workers.gpu.runner import TorchRunner

        if config.threads:
            torch.set_num_threads(config.threads)
        device = torch.device(config.device) if config.device else None
        return TorchRunner(model, device, kv_cache_memory=config.kv_cache_memory, enforce_eager=config.enforce_eager,
                           max_num_seqs=config.max_num_seqs), model
    from hybridgate.workers.cpu.runner import NumbaRunner

    return NumbaRunner(model, kv_cache_memory=config.kv_cache_memory, threads=config.threads), model


class WorkerIO:
    """The I/O thread: owns the ROUTER socket."""

    def __init__(self, ctx: zmq.Context, endpoint: str, hello: Hello, inbox: Inbox, heartbeat_s: float):
        self.handoff_socket = None
        if hello.handoff_endpoint:  # CPU workers: KV hand-offs from GPU workers (header, then parts)
            self.handoff_socket = ctx.socket(zmq.ROUTER)
            self.handoff_socket.setsockopt(zmq.LINGER, 0)
            self.handoff_socket.setsockopt(zmq.RCVBUF, 4 << 20)  # fewer, larger kernel copies (capped by rmem_max)
            self.handoff_socket.bind(hello.handoff_endpoint)
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self.socket.bind(endpoint)
        self.from_engine = ctx.socket(zmq.PULL)
        self._engine_addr = f"inproc://engine-out-{id(self)}"
        self.from_engine.bind(self._engine_addr)
        self.hello, self.inbox, self.heartbeat_s = hello, inbox, heartbeat_s
        self.clients: set[bytes] = set()
        self.stats = EngineStats()
        self.stopping = threading.Event()
        self._ready = threading.Event()
        self._handlers = {MsgType.CONNECT: self._on_connect, MsgType.ADD: self._on_add,
                          MsgType.HANDOFF_RESERVE: self._on_add, MsgType.HANDOFF_RELEASE: self._on_add,
                          MsgType.HANDOFF_RESUME: self._on_add}

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
                for client in list(self.clients):
                    self._send(client, Load(self.stats))
                next_beat = time.monotonic() + self.heartbeat_s

    def _recv_from_router(self) -> None:
        while True:
            try:
                client, *frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = bytes(frames[0]) if frames else b""
            if kind == MsgType.ABORT.value:  # fast path: straight to the engine's abort list
                self.inbox.put_abort(client, wire.decode(frames))
                continue
            try:
                msg = wire.decode(frames)
                self._handlers[MsgType(kind)](client, msg)
            except (ValueError, KeyError) as exc:
                log.warning("dropping a bad message from %r: %s", client, exc)

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
        self._send(client, self.hello)
        if self.hello.ready:
            self._send(client, Ready(self.hello.kind))

    def _on_add(self, client: bytes, msg) -> None:
        self.clients.add(client)
        self.inbox.requests.put((client, msg))

    def _forward_engine_output(self) -> None:
        while True:
            try:
                client, *frames = self.from_engine.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not client:  # a reply on the hand-off socket: [b"", peer, kind, body]
                try:
                    self.handoff_socket.send_multipart(frames, zmq.NOBLOCK)
                except (zmq.error.Again, zmq.error.ZMQError, AttributeError) as exc:
                    log.info("hand-off peer unreachable (%s)", exc)
                continue
            self._send(client, None, frames)

    def _send(self, client: bytes, msg, frames: list | None = None) -> None:
        try:
            self.socket.send_multipart([client, *(frames or wire.encode(msg))], zmq.NOBLOCK)
        except (zmq.error.Again, zmq.error.ZMQError) as exc:
            # ROUTER_MANDATORY: the router is gone (or stalled); free its sequences.
            log.info("router %r unreachable (%s); aborting its requests", client, exc)
            self.clients.discard(client)
            self.inbox.requests.put((client, "client-gone"))

    def close(self) -> None:
        if hasattr(self, "_engine_push"):
            self._engine_push.close(0)
        self.socket.close(0)
        self.from_engine.close(0)
        if self.handoff_socket is not None:
            self.handoff_socket.close(0)


def _die_with_parent(parent_pid: int | None) -> None:
    """Exit when the parent dies: PR_SET_PDEATHSIG on Linux, and a poll everywhere."""
    if parent_pid is None:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(0.2)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_worker(config: WorkerConfig) -> None:
    """Process entry point: load, bind, warm up, READY, then serve until SIGTERM."""
    _die_with_parent(config.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Under `serve`, Ctrl-C reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN if config.parent_pid else (lambda *_: stop.set()))

    from hybridgate.models import model_fingerprint

    runner, model = build_runner(config)
    fingerprint = model_fingerprint(model)
    del model  # the runners copy what they keep: the GGUF file can be unmapped
    ctx = zmq.Context()
    inbox = Inbox()
    hello = Hello(kind=config.kind, fingerprint=fingerprint, max_num_seqs=config.max_num_seqs,
                  max_model_len=runner.max_model_len, pid=os.getpid(), ready=False,
                  handoff_endpoint=config.resolved_handoff_endpoint)
    io = WorkerIO(ctx, config.endpoint, hello, inbox, config.heartbeat_s)
    io_thread = threading.Thread(target=io.run, name="worker-io", daemon=True)
    io_thread.start()
    runner.warm_up()
    engine = EngineCore(runner, SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
                        hello.fingerprint, config.prefix_caching,
                        HandoffConfig(config.cache_imported_kv, config.handoff_reservation_timeout_s))
    exporter = None
    if config.kind == "gpu":
        from hybridgate.workers.gpu.export import KVExporter

        exporter = engine.handoffs.exporter = KVExporter(
            runner, ctx, lambda ev: inbox.requests.put((b"", ev)), buffer_memory=config.handoff_buffer_bytes)
    loop = EngineLoop(engine, inbox, io.engine_sender(ctx), io.engine_handoff_sender())
    io.stats = engine.stats  # read by the heartbeat; the engine refreshes it every pass
    io.set_ready()  # the I/O thread sends READY on its next pass
    log.info("%s worker ready on %s (pid %d)", config.kind, config.endpoint, os.getpid())
    threading.Thread(target=lambda: (stop.wait(), loop.stopping.set()), daemon=True).start()
    loop.run()
    if exporter is not None:
        exporter.close()
    io.stopping.set()
    io_thread.join(timeout=2)
    io.close()
    ctx.term()
