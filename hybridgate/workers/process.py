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
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from hybridgate import wire
from hybridgate.config import check_settings, setting
from hybridgate.wire import Connect, EngineStats, Hello, Load, MsgType, Ready
from hybridgate.workers.engine import EngineCore, EngineLoop, Inbox
from hybridgate.workers.memory import parse_memory
from hybridgate.workers.scheduler import SchedulerConfig

log = logging.getLogger("hybridgate.worker")


def _check_memory(value: str) -> None:
    parse_memory(value, gpu=False)


def _check_endpoint(value: str) -> None:
    if not value.startswith(("ipc://", "tcp://", "inproc://")):
        raise ValueError(f"must start with ipc://, tcp:// or inproc://, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How a worker's runner uses its device: the settings `build_runner` passes on."""

    threads: int | None = setting(
        None, "CPU threads per worker (default: all cores; under serve, several CPU workers split them)", low=1)
    device: str | None = setting(None, "torch device of the GPU worker (default: cuda if present, else cpu)")
    kv_cache_memory: str | None = setting(
        None, "KV cache size: bytes (e.g. 2GiB) or a fraction of free device memory after weights (GPU) "
              "or of available memory (CPU); default 0.9 on a GPU, 1GiB on a CPU", check=_check_memory)
    prefix_caching: bool = setting(True, "reuse the KV blocks of cached prompt prefixes")
    enforce_eager: bool = setting(False, "on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs; plain values, so it crosses `spawn`."""

    model_path: str = setting("", "GGUF file (set from --model)", cli=False)
    endpoint: str | None = setting(None, "where to bind: ipc://PATH or tcp://127.0.0.1:PORT", check=_check_endpoint)
    kind: str = setting("cpu", "cpu: the Numba runner on the GGUF blocks; gpu: the PyTorch runner "
                               "(on a CPU torch device without CUDA)", choices=("cpu", "gpu"))
    heartbeat_s: float = setting(0.1, "seconds between LOAD heartbeats", low=0, low_open=True, cli=False)
    parent_pid: int | None = setting(None, "exit when this process dies (set by serve)", cli=False)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    name: str = setting("", "this worker's stable name in the gateway's metrics (default: its endpoint; "
                            "serve names its workers kind-index, e.g. gpu-0)", flag="--worker-name")

    def __post_init__(self) -> None:
        check_settings(self)

    # The flat names of before the split into sections, for readers.
    max_num_seqs = property(lambda self: self.scheduler.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.scheduler.max_num_batched_tokens)
    threads = property(lambda self: self.engine.threads)
    device = property(lambda self: self.engine.device)
    kv_cache_memory = property(lambda self: self.engine.kv_cache_memory)
    prefix_caching = property(lambda self: self.engine.prefix_caching)
    enforce_eager = property(lambda self: self.engine.enforce_eager)


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
        self._handlers = {MsgType.CONNECT: self._on_connect, MsgType.ADD: self._on_add}

    def engine_sender(self, ctx: zmq.Context):
        """A send(client, message) for the engine thread (its own PUSH socket)."""
        push = self._engine_push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._engine_addr)

        def send(client: bytes, msg) -> None:
            push.send_multipart([client, *wire.encode(msg)], copy=False)

        return send

    def set_ready(self) -> None:
        """Called from the engine thread; the I/O thread sends READY on its next pass."""
        self._ready.set()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.from_engine, zmq.POLLIN)
        next_beat = time.monotonic()
        while not self.stopping.is_set():
            events = dict(poller.poll(timeout=max(0.0, next_beat - time.monotonic()) * 1e3))
            if self.socket in events:
                self._recv_from_router()
            if self.from_engine in events:
                self._forward_engine_output()
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
                client, kind, body = self.from_engine.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._send(client, None, [kind, body])

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


def check_bindable(endpoint: str) -> None:
    """Bind `endpoint` once and let it go, so a bad one fails before the model loads.

    Raises:
        OSError: one line naming --endpoint and why (an ipc folder that does not
            exist, a malformed address, a port in use).
    """
    if endpoint.startswith("ipc://"):
        folder = Path(endpoint.removeprefix("ipc://")).parent
        if not folder.is_dir():
            raise OSError(f"--endpoint {endpoint}: cannot bind: the folder {folder} does not exist")
    ctx = zmq.Context()
    try:
        probe = ctx.socket(zmq.ROUTER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.bind(endpoint)
        probe.close(0)
    except zmq.ZMQError as exc:
        raise OSError(_bind_error(endpoint, exc)) from None
    finally:
        ctx.destroy(0)


def _bind_error(endpoint: str, exc: zmq.ZMQError) -> str:
    return f"--endpoint {endpoint}: cannot bind: {zmq.strerror(exc.errno)} (give ipc://PATH or tcp://HOST:PORT)"


def run_worker(config: WorkerConfig) -> None:
    """Process entry point: load, bind, warm up, READY, then serve until SIGTERM."""
    _die_with_parent(config.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Under `serve`, Ctrl-C reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN if config.parent_pid else (lambda *_: stop.set()))

    from hybridgate.models import model_fingerprint

    check_bindable(config.endpoint)  # before the model loads: a bad endpoint fails at once
    runner, model = build_runner(config)
    fingerprint = model_fingerprint(model)
    del model  # the runners copy what they keep: the GGUF file can be unmapped
    ctx = zmq.Context()
    inbox = Inbox()
    hello = Hello(kind=config.kind, fingerprint=fingerprint, max_num_seqs=config.max_num_seqs,
                  max_model_len=runner.max_model_len, pid=os.getpid(), ready=False,
                  boot_id=uuid.uuid4().hex, name=config.name)  # a new boot id on every start
    try:
        io = WorkerIO(ctx, config.endpoint, hello, inbox, config.heartbeat_s)
    except zmq.ZMQError as exc:
        ctx.destroy(0)
        raise OSError(_bind_error(config.endpoint, exc)) from None
    io_thread = threading.Thread(target=io.run, name="worker-io", daemon=True)
    io_thread.start()
    runner.warm_up()
    engine = EngineCore(runner, config.scheduler, hello.fingerprint, config.engine.prefix_caching)
    loop = EngineLoop(engine, inbox, io.engine_sender(ctx))
    io.stats = engine.stats  # read by the heartbeat; the engine refreshes it every pass
    io.set_ready()  # the I/O thread sends READY on its next pass
    if config.parent_pid is None:  # standalone: the user's only sign of life at the default log level
        print(f"hybridgate worker: READY ({config.kind}, pid {os.getpid()}) on {config.endpoint}", flush=True)
    else:  # under serve, which prints its own READY line
        log.info("%s worker ready on %s (pid %d)", config.kind, config.endpoint, os.getpid())
    threading.Thread(target=lambda: (stop.wait(), loop.stopping.set()), daemon=True).start()
    loop.run()
    io.stopping.set()
    io_thread.join(timeout=2)
    io.close()
    ctx.term()
