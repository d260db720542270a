"""The worker process: one ROUTER socket, an I/O thread, the engine loop on the main thread.

Workers bind; routers connect a DEALER with their own identity, so several
gateways can share a worker: outputs go back to the identity that sent the
request. The I/O thread alone touches the socket: it answers CONNECT with
HELLO (and READY once warm), queues requests for the engine, hands aborts to
it on a fast path (a locked list it reads before every step, not the request
queue), forwards the engine's outputs and sends a LOAD heartbeat every
`heartbeat_s`. No frame can end the I/O thread (`WorkerIO`); if it or the
engine loop dies anyway, the process exits so that it can be restarted.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from hybridgate import wire
from hybridgate.config import check_settings, setting
from hybridgate.keys import Transport, TransportConfig
from hybridgate.redisconf import RedisConfig, WorkerEntry
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
from hybridgate.workers.cpu.kvdtype import DEFAULT_KV_DTYPE, KV_DTYPES
from hybridgate.workers.engine import ClientCongested, ClientGone, EngineCore, EngineLoop, Inbox
from hybridgate.workers.guard import WireErrors
from hybridgate.workers.memory import parse_memory
from hybridgate.workers.handoff import DEFAULT_RESERVATION_TIMEOUT_S, HandoffConfig, HandoffIncoming
from hybridgate.workers.scheduler import SchedulerConfig
from hybridgate.workers.threads import EXIT_THREAD_DIED, exit_if_raises, worker_thread  # noqa: F401 (the exit code, re-exported)

log = logging.getLogger("hybridgate.worker")


def _check_memory(value: str) -> None:
    parse_memory(value, gpu=False)


def _check_bytes(value: str) -> None:
    try:
        size = parse_memory(value, gpu=False)
    except ValueError:
        size = 0
    if size <= 1:  # a fraction parses to <= 1: this setting takes bytes only
        raise ValueError(f"must be a size in bytes such as 256MiB, got {value!r}")


def _check_cpu_isa(value: str) -> None:
    """Refuse, before any worker starts, a path this CPU cannot run (a worker would only die of it)."""
    from hybridgate.workers.cpu import isa  # stdlib and llvmlite only: no Numba

    try:
        runnable = isa.best(isa.host_features())
    except ImportError:  # no llvmlite (no cpu extra): no CPU worker to start here either
        return
    if value in isa.ISAS and isa.ISAS.index(value) < isa.ISAS.index(runnable):
        raise ValueError(f"this CPU cannot run {value} (it runs at most {runnable})")


def _check_endpoint(value: str) -> None:
    if not value.startswith(("ipc://", "tcp://", "inproc://")):
        raise ValueError(f"must start with ipc://, tcp:// or inproc://, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How a worker's runner uses its device: the settings `build_runner` passes on."""

    threads: int | None = setting(
        None, "CPU threads per worker (default: all cores; under serve, the workers computing on the CPU split them)", low=1)
    device: str | None = setting(None, "torch device of the GPU worker (default: cuda if present, else cpu)")
    kv_cache_memory: str | None = setting(
        None, "KV cache size: bytes (e.g. 2GiB) or a fraction of free device memory after weights (GPU) "
              "or of available memory (CPU); default 0.9 on a GPU, 1GiB on a CPU", check=_check_memory)
    prefix_caching: bool = setting(True, "reuse the KV blocks of cached prompt prefixes")
    enforce_eager: bool = setting(False, "on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs")
    measure_rates: bool = setting(
        True, "before READY, time prefill steps of 32 and 256 tokens and decode steps of 1 and 8 "
              "sequences, so the router's cost model places the first requests on this worker's own figures "
              "(1-3 s on 2 cores); off: the first placements use no figures until real steps have run")
    cpu_isa: str | None = setting(
        None, "CPU worker: the instruction set its kernels are compiled for (default: the best this CPU runs)",
        choices=("avx512", "avx2", "generic"), check=_check_cpu_isa)
    cpu_activations: str = setting(
        "auto", "CPU worker: the activation format of the quantized matmuls: f32 (float32 activations times "
                "dequantized weights), i16 (activations quantized to int16 per 32-block, integer multiply-adds, "
                "about 2e-5 relative error), auto (the faster of the two per weight type on this ISA path)",
        choices=("auto", "f32", "i16"))
    kv_cache_dtype: str = setting(
        DEFAULT_KV_DTYPE, "CPU worker: the KV cache's element format; fp16 and bf16 round K and V to nearest even as they "
                "are stored and widen them to float32 as attention reads them, for half the bytes per token (twice "
                "the blocks in --kv-cache-memory) and less to read per step; fp32 stores them exactly. fp16 is the "
                "default: it held top-1 100% and mean KL 6e-7 against the fp32 reference (bf16: 99.8%, 4e-5) and "
                "decoded 1.4x faster than fp32 at 1,024 tokens of context. GPU workers ignore it: their cache has "
                "the compute dtype (bf16 on CUDA, fp32 on a CPU torch device)",
        choices=tuple(KV_DTYPES))

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

    advertise: str = setting(
        "", "with --redis-url: the endpoint routers on other hosts connect to, tcp://HOST:PORT (default: this "
            "host's name and the bound port for a tcp:// endpoint, the endpoint itself for ipc://)",
        flag="--advertise", check=lambda v: v and _check_endpoint(v))
    handoff_endpoint: str = setting(
        "", "CPU workers: where to bind the socket for incoming KV hand-offs (ipc://PATH or tcp://HOST:PORT); "
        "default: ENDPOINT.handoff for an ipc:// endpoint, none for tcp://", flag="--handoff-endpoint")
    handoff_buffer_memory: str = setting(
        "256MiB", "GPU workers: the pinned host slab KV hand-offs stream through (bytes, e.g. 256MiB); "
        "hand-offs larger than it stream layer by layer", flag="--handoff-buffer-memory", check=_check_bytes)
    cache_imported_kv: bool = setting(
        False, "CPU workers: register KV imported by hand-offs in the prefix cache (off: a worker's outputs "
        "never depend on which hand-offs came before)", flag="--cache-imported-kv")
    handoff_reservation_timeout_s: float = setting(
        DEFAULT_RESERVATION_TIMEOUT_S, "CPU workers: seconds a KV hand-off reservation waits for its KV",
        low=0, low_open=True)


    def __post_init__(self) -> None:
        check_settings(self)
        if self.handoff_endpoint and not self.handoff_endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"handoff_endpoint: must start with ipc://, tcp:// or inproc://, got "
                             f"{self.handoff_endpoint!r}")
        self.handoff_buffer_bytes  # raises on a bad size

    # The flat names of before the split into sections, for readers.
    max_num_seqs = property(lambda self: self.scheduler.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.scheduler.max_num_batched_tokens)
    threads = property(lambda self: self.engine.threads)
    device = property(lambda self: self.engine.device)
    kv_cache_memory = property(lambda self: self.engine.kv_cache_memory)
    prefix_caching = property(lambda self: self.engine.prefix_caching)
    enforce_eager = property(lambda self: self.engine.enforce_eager)
    measure_rates = property(lambda self: self.engine.measure_rates)

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
        return "" if not self.endpoint or self.endpoint.startswith("tcp://") else self.endpoint + ".handoff"


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
    from hybridgate.workers.cpu import isa

    isa.select(config.engine.cpu_isa)  # before the kernels (and Numba) are imported
    from hybridgate.workers.cpu.runner import NumbaRunner

    return NumbaRunner(model, kv_cache_memory=config.kv_cache_memory, threads=config.threads,
                       activations=config.engine.cpu_activations, kv_cache_dtype=config.engine.kv_cache_dtype), model


def max_frame_bytes(max_model_len: int) -> int:
    """The largest message body a worker accepts: 16 bytes per token of context plus 64 KiB.

    An ADD of a full-context prompt packs each id in at most 5 msgpack bytes
    (9 for any int), and its stop strings take at most 16 x 256 bytes; an ABORT
    of thousands of request ids fits. Anything larger is refused unread.
    """
    return 16 * max_model_len + (64 << 10)


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
                 wire_errors: WireErrors | None = None, send_hwm: int = 100_000, transport: Transport | None = None):
        self.max_frame_bytes = max_frame_bytes(hello.max_model_len)
        transport = transport or Transport(TransportConfig(insecure_tcp=True))  # tests' and benchmarks' sockets
        self.handoff_socket = None
        if hello.handoff_endpoint:  # CPU workers: KV hand-offs from GPU workers (header, then parts)
            self.handoff_socket = ctx.socket(zmq.ROUTER)
            self.handoff_socket.setsockopt(zmq.LINGER, 0)
            self.handoff_socket.setsockopt(zmq.RCVBUF, 4 << 20)  # fewer, larger kernel copies (capped by rmem_max)
            transport.server(self.handoff_socket, hello.handoff_endpoint, "--handoff-endpoint")
            self.handoff_socket.bind(hello.handoff_endpoint)
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

    def _on_add(self, client: bytes, msg: AddRequest) -> None:
        self.clients.add(client)
        if not self.inbox.offer_add(client, msg):  # the engine is far behind: another worker may take it
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
                try:
                    self.handoff_socket.send_multipart(frames, zmq.NOBLOCK)
                except (zmq.error.Again, zmq.error.ZMQError, AttributeError) as exc:
                    log.info("hand-off peer unreachable (%s)", exc)
                continue
            kind, body = frames
            if kind == MsgType.OVERLOAD.value:
                self._queue_overload(client, wire.decode([kind, body]))
            else:
                self._send(client, None, [kind, body])

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

    worker_thread(watch, "parent-watch", "parent watch").start()


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


def run_worker(config: WorkerConfig, build: Callable[[WorkerConfig], tuple] = build_runner,
               redis: RedisConfig | None = None, transport: TransportConfig | None = None) -> None:
    """Process entry point: load, bind, warm up, READY, then serve until SIGTERM.

    `build` returns (runner, model); benchmarks pass a runner that computes
    nothing (hybridgate.bench.instant) to measure the gateway alone. With
    `redis.url`, the worker registers itself once READY (`workers.registration`)
    and removes its entry on exit. `transport`: CURVE keys for tcp:// sockets (its
    request socket, a CPU worker's hand-off socket, a GPU worker's hand-off connections);
    a tcp:// endpoint without keys raises ValueError unless it allows insecure tcp."""
    _die_with_parent(config.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    stop = threading.Event()
    stop_signals: list[int] = []  # which signals asked us to stop, for the last log line

    def request_stop(signum, _frame) -> None:
        stop_signals.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    # Under `serve`, Ctrl-C reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN if config.parent_pid else request_stop)

    from hybridgate.models import model_fingerprint

    check_bindable(config.endpoint)  # before the model loads: a bad endpoint fails at once
    secure = Transport(transport)
    secure.check(config.endpoint, "--endpoint")
    if config.resolved_handoff_endpoint:
        secure.check(config.resolved_handoff_endpoint, "--handoff-endpoint")
    runner, model = build(config)
    fingerprint = model_fingerprint(model)
    del model  # the runners copy what they keep: the GGUF file can be unmapped
    ctx = zmq.Context()
    secure.authenticate(ctx)  # the ZAP handler admits only clients holding the deployment's key
    inbox = Inbox(config.scheduler.max_num_waiting)  # as many ADDs again as the scheduler queues
    wire_errors = WireErrors()  # counted by both threads, reported in every LOAD and OUTPUTS
    hello = Hello(kind=config.kind, fingerprint=fingerprint, max_num_seqs=config.max_num_seqs,
                  max_model_len=runner.max_model_len, pid=os.getpid(), ready=False,
                  boot_id=uuid.uuid4().hex, name=config.name,  # a new boot id on every start
                  handoff_endpoint=config.resolved_handoff_endpoint, cpu_isa=getattr(runner, "cpu_isa", ""),
                  kv_dtype=runner.kv_layout()[3] if hasattr(runner, "kv_layout") else "")
    try:
        io = WorkerIO(ctx, config.endpoint, hello, inbox, config.heartbeat_s, wire_errors, transport=secure)
    except zmq.ZMQError as exc:
        ctx.destroy(0)
        raise OSError(_bind_error(config.endpoint, exc)) from None
    io_thread = worker_thread(io.run, "worker-io", "I/O thread", io.stopping)
    io_thread.start()
    runner.warm_up()
    engine = EngineCore(runner, config.scheduler, hello.fingerprint, config.engine.prefix_caching, wire_errors,
                        HandoffConfig(config.cache_imported_kv, config.handoff_reservation_timeout_s))
    engine.refusals = inbox.refusals  # one count of the worker's queue refusals, in its LOAD reports
    if config.measure_rates:
        started = time.monotonic()
        engine.measure_rates()
        log.info("%s worker measured its rates in %.1f s: prefill tokens/s by step tokens %s, decode step s by "
                 "batch %s", config.kind, time.monotonic() - started,
                 {k: round(v) for k, v in engine.rates.prefill.medians.items()},
                 {k: round(v, 4) for k, v in engine.rates.decode.medians.items()})
    exporter = None
    if config.kind == "gpu":
        from hybridgate.workers.gpu.export import KVExporter

        exporter = engine.handoffs.exporter = KVExporter(
            runner, ctx, lambda ev: inbox.requests.put((b"", ev)), buffer_memory=config.handoff_buffer_bytes,
            transport=secure, refusals=inbox.refusals)
    loop = EngineLoop(engine, inbox, io.engine_sender(ctx), io.engine_handoff_sender())
    io.stats = engine.stats  # read by the heartbeat; the engine refreshes it every pass
    io.set_ready()  # the I/O thread sends READY on its next pass
    if config.parent_pid is None:  # standalone: the user's only sign of life at the default log level
        print(f"hybridgate worker: READY ({config.kind}, pid {os.getpid()}) on {config.endpoint}", flush=True)
    else:  # under serve, which prints its own READY line
        log.info("%s worker ready on %s (pid %d)", config.kind, config.endpoint, os.getpid())
    registration = None
    if redis is not None and redis.url:
        from hybridgate.workers.registration import Registration, advertised_endpoint

        registration = Registration(redis, WorkerEntry(
            endpoint=advertised_endpoint(config.endpoint, config.advertise), kind=config.kind, fingerprint=fingerprint,
            capacity=config.max_num_seqs, boot_id=hello.boot_id, name=config.name,
            handoff_endpoint=config.resolved_handoff_endpoint))
        registration.start()
    worker_thread(lambda: (stop.wait(), loop.stopping.set()), "stop-watch", "stop watch").start()
    exit_if_raises(loop.run, "engine loop")()
    log.info("%s worker on %s stopping (%s)", config.kind, config.endpoint,
             "signal " + ", ".join(signal.Signals(n).name for n in stop_signals) if stop.is_set()
             else "engine loop ended")
    if registration is not None:
        registration.stop()
    if exporter is not None:
        exporter.close()
    io.stopping.set()
    io_thread.join(timeout=2)
    io.close()
    secure.close()
    ctx.term()
    # The socket files this worker bound: a gateway started later must find no socket rather than one that
    # nobody listens on (the missing-socket check reads the file; a stale one would make it wait).
    for endpoint in (config.endpoint, config.resolved_handoff_endpoint):
        if endpoint and endpoint.startswith("ipc://"):
            Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
