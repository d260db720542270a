"""The worker process: the I/O thread (`workers.io_thread`) on its sockets, the engine loop on the main thread.

`run_worker` is the sequence of start-up steps: check the endpoints, load the
model, bind and start the I/O thread, warm up, measure the rates, READY, serve
until a signal, then shut down in reverse. If the I/O thread or the engine
loop dies, the process exits so that it can be restarted.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import zmq

from hybridgate.run.children import die_with_parent
from hybridgate.security.keys import Transport, TransportConfig
from hybridgate.security.redisconf import RedisConfig, WorkerEntry
from hybridgate.wire import Hello
from hybridgate.workers.config import WorkerConfig
from hybridgate.workers.engine import EngineCore, default_constraints
from hybridgate.workers.engine_loop import EngineLoop, Inbox
from hybridgate.workers.guard import WireErrors
from hybridgate.workers.handoff import HandoffConfig
from hybridgate.workers.io_thread import WorkerIO, handoff_frame_bytes
from hybridgate.workers.threads import exit_if_raises, worker_thread

log = logging.getLogger("hybridgate.worker")


def build_runner(config: WorkerConfig):
    """The model runner of `config.kind` (torch imported only here), its threads pinned to
    --cpu-cores / --numa-node first (`affinity.pin`: before any compute thread starts or weight page is read);
    threads default to the number of those cores."""
    from hybridgate.models import load_gguf
    from hybridgate.workers import affinity

    threads = affinity.pin_engine(config.engine)
    model = load_gguf(config.model_path)
    if config.kind == "gpu":
        import torch

        from hybridgate.workers.gpu.runner import TorchRunner
        from hybridgate.workers.gpu.sizing import InjectedMemory

        if threads:
            torch.set_num_threads(threads)
        device = torch.device(config.device) if config.device else None
        return TorchRunner(model, device, kv_cache_memory=config.kv_cache_memory, enforce_eager=config.enforce_eager,
                           max_num_seqs=config.max_num_seqs, attention=config.engine.gpu_attention,
                           max_model_len=config.max_model_len,
                           gpu_memory_utilization=config.engine.gpu_memory_utilization,
                           max_num_batched_tokens=config.max_num_batched_tokens,
                           memory=InjectedMemory.from_env()), model
    from hybridgate.workers.cpu import isa, threadwait

    isa.select(config.engine.cpu_isa, config.engine.cpu_amx)  # before the kernels (and Numba) are imported
    threadwait.select(config.engine.cpu_thread_wait)  # before Numba's threads start
    from hybridgate.workers.cpu.runner import NumbaRunner

    return NumbaRunner(model, kv_cache_memory=config.kv_cache_memory, threads=threads,
                       activations=config.engine.cpu_activations, kv_cache_dtype=config.engine.kv_cache_dtype,
                       thread_fallback=config.engine.cpu_thread_fallback, max_num_seqs=config.max_num_seqs,
                       max_num_batched_tokens=config.max_num_batched_tokens), model


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
               redis: RedisConfig | None = None, transport: TransportConfig | None = None,
               metrics_port: int | None = None) -> None:
    """Process entry point: load, bind, warm up, READY, then serve until SIGTERM.

    `build` returns (runner, model); benchmarks pass a runner that computes
    nothing (hybridgate.bench.instant) to measure the gateway alone. With
    `redis.url`, the worker registers itself once READY (`workers.registration`)
    and removes its entry on exit. `transport`: CURVE keys for tcp:// sockets (its
    request socket, a CPU worker's hand-off socket, a GPU worker's hand-off connections);
    a tcp:// endpoint without keys raises ValueError unless it allows insecure tcp. `metrics_port`: serve the
    engine's figures under vLLM's names there (`workers.metrics`; None: off)."""
    die_with_parent(config.parent_pid)
    logging.basicConfig(level=logging.INFO, format=log_format(config))
    stop, stop_signals = _stop_on_signals(config)
    secure = _checked_transport(config, transport)
    runner, model = build(config)
    hello = _hello(config, runner, model)
    del model  # the runners copy what they keep: the GGUF file can be unmapped
    ctx = zmq.Context()
    secure.authenticate(ctx)  # the ZAP handler admits only clients holding the deployment's key
    inbox = Inbox(config.scheduler.max_num_waiting)  # as many ADDs again as the scheduler queues
    wire_errors = WireErrors()  # counted by both threads, reported in every LOAD and OUTPUTS
    io, io_thread = _start_io(ctx, config, hello, inbox, wire_errors, secure, _handoff_frame_bytes(runner))
    runner.warm_up()
    engine = _engine(config, runner, hello, wire_errors)
    engine.refusals = inbox.refusals  # one count of the worker's queue refusals, in its LOAD reports
    exporter = _exporter(config, engine, runner, ctx, inbox, secure)
    loop = EngineLoop(engine, inbox, io.engine_sender(ctx), io.engine_handoff_sender())
    io.stats = engine.stats  # read by the heartbeat; the engine refreshes it every pass
    io.set_ready()  # the I/O thread sends READY on its next pass
    metrics = _serve_metrics(config, hello, engine, metrics_port)
    _say_ready(config)
    registration = _register(config, redis, hello)
    worker_thread(lambda: (stop.wait(), loop.stopping.set()), "stop-watch", "stop watch").start()
    exit_if_raises(loop.run, "engine loop")()
    log.info("%s worker on %s stopping (%s)", config.kind, config.endpoint, _stop_reason(config, stop, stop_signals))
    if registration is not None:
        registration.stop()
    if metrics is not None:
        metrics.shutdown()
    if exporter is not None:
        exporter.close()
    io.stopping.set()
    io_thread.join(timeout=2)
    io.close()
    secure.close()
    ctx.term()
    _unlink_sockets(config)


def _stop_on_signals(config: WorkerConfig) -> tuple[threading.Event, list[int]]:
    """An event SIGTERM sets (and SIGINT, unless under `serve`), and which signals asked to stop."""
    stop = threading.Event()
    stop_signals: list[int] = []  # which signals asked us to stop, for the last log line

    def request_stop(signum, _frame) -> None:
        stop_signals.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    # Under `serve`, Ctrl-C reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN if config.parent_pid else request_stop)
    return stop, stop_signals


def _stop_reason(config: WorkerConfig, stop: threading.Event, stop_signals: list[int]) -> str:
    """Why the worker stops, for its last log line. Under `serve` the parent's SIGTERM is how a Ctrl-C (or
    the parent's own SIGTERM) reaches a worker, so it reads as the server shutting down, not as a signal
    the operator did not send."""
    if not stop.is_set():
        return "engine loop ended"
    if config.parent_pid and set(stop_signals) == {signal.SIGTERM}:
        return "the server is shutting down"
    return "signal " + ", ".join(signal.Signals(n).name for n in stop_signals)


def _checked_transport(config: WorkerConfig, transport: TransportConfig | None) -> Transport:
    """The endpoints checked before the model loads: a bad one fails at once (OSError or ValueError)."""
    check_bindable(config.endpoint)
    secure = Transport(transport)
    secure.check(config.endpoint, "--endpoint")
    if config.resolved_handoff_endpoint:
        secure.check(config.resolved_handoff_endpoint, "--handoff-endpoint")
    return secure


def _hello(config: WorkerConfig, runner, model) -> Hello:
    """What this worker tells each router on CONNECT; a new boot id on every start. Its hand-off
    endpoint is the advertised one (`advertised_handoff_endpoint`): GPU workers connect to it."""
    from hybridgate.models import model_fingerprint, model_name
    from hybridgate.workers.registration import advertised_endpoint, advertised_handoff_endpoint

    handoff = advertised_handoff_endpoint(config.resolved_handoff_endpoint,
                                          advertised_endpoint(config.endpoint, config.advertise))

    return Hello(kind=config.kind, fingerprint=model_fingerprint(model), max_num_seqs=config.max_num_seqs,
                 max_model_len=runner.max_model_len, pid=os.getpid(), ready=False,
                 boot_id=uuid.uuid4().hex, name=config.name,
                 handoff_endpoint=handoff, cpu_isa=getattr(runner, "cpu_isa", ""),
                 kv_dtype=runner.kv_layout().dtype if hasattr(runner, "kv_layout") else "",
                 model=config.model_name or model_name(model))


def _handoff_frame_bytes(runner) -> int:
    """The hand-off socket's frame cap: a runner without a KV layout takes no KV (its engine refuses every
    reservation), so only a header can come legitimately."""
    layout = getattr(runner, "kv_layout", None)
    return handoff_frame_bytes(runner.max_model_len, *(layout().largest if layout is not None else (0, 0)))


def _start_io(ctx: zmq.Context, config: WorkerConfig, hello: Hello, inbox: Inbox, wire_errors: WireErrors,
              secure: Transport, handoff_max_frame_bytes: int) -> tuple[WorkerIO, threading.Thread]:
    """The I/O thread, started on its bound sockets (OSError naming --endpoint if a bind fails)."""
    try:
        io = WorkerIO(ctx, config.endpoint, hello, inbox, config.heartbeat_s, wire_errors, transport=secure,
                      handoff_bind=config.resolved_handoff_endpoint, handoff_max_frame_bytes=handoff_max_frame_bytes)
    except zmq.ZMQError as exc:
        ctx.destroy(0)
        raise OSError(_bind_error(config.endpoint, exc)) from None
    io_thread = worker_thread(io.run, "worker-io", "I/O thread", io.stopping)
    io_thread.start()
    return io, io_thread


def _engine(config: WorkerConfig, runner, hello: Hello, wire_errors: WireErrors) -> EngineCore:
    """The engine core over the warm runner, its rates measured unless --no-measure-rates."""
    engine = EngineCore(runner, config.scheduler, hello.fingerprint, config.engine.prefix_caching, wire_errors,
                        HandoffConfig(config.cache_imported_kv, config.handoff_reservation_timeout_s),
                        default_constraints(runner, config.engine.grammar_cache_size,
                                            config.engine.grammar_compile_threads))
    if config.measure_rates:
        started = time.monotonic()
        engine.measure_rates()
        log.info("%s worker measured its rates in %.1f s: prefill tokens/s by step tokens %s, decode step s by "
                 "batch %s", config.kind, time.monotonic() - started,
                 {k: round(v) for k, v in engine.rates.prefill.medians.items()},
                 {k: round(v, 4) for k, v in engine.rates.decode.medians.items()})
    return engine


def _exporter(config: WorkerConfig, engine: EngineCore, runner, ctx: zmq.Context, inbox: Inbox, secure: Transport):
    """GPU workers: the KV exporter of hand-offs (None on CPU workers)."""
    if config.kind != "gpu":
        return None
    from hybridgate.workers.gpu.export import KVExporter

    exporter = engine.handoffs.exporter = KVExporter(
        runner, ctx, lambda ev: inbox.requests.put((b"", ev)), buffer_memory=config.handoff_buffer_bytes,
        transport=secure, refusals=inbox.refusals)
    return exporter


def _serve_metrics(config: WorkerConfig, hello: Hello, engine: EngineCore, port: int | None):
    """With a metrics port, the worker's metrics server (None without); its port is said in the log."""
    if port is None:
        return None
    from hybridgate.workers.metrics import metrics_host, serve_metrics

    httpd = serve_metrics(port, config.endpoint, hello.model, config.kind, lambda: engine.stats)
    where = f"http://{metrics_host(config.endpoint)}:{httpd.server_port}/metrics"
    if config.parent_pid is None:
        print(f"hybridgate worker: metrics on {where}", flush=True)
    else:
        log.info("%s worker metrics on %s", config.kind, where)
    return httpd


def log_format(config: WorkerConfig) -> str:
    """The worker's log line format: its name (its kind without one) and its served model's name, so that the
    lines of a fleet's workers, which share serve's stderr, say whose they are ("worker chat-cpu-0 (chat) INFO ...")."""
    who = config.name or config.kind
    if config.model_name:
        who += f" ({config.model_name})"
    return "%(asctime)s worker " + who.replace("%", "%%") + " %(levelname)s %(message)s"


def _say_ready(config: WorkerConfig) -> None:
    if config.parent_pid is None:  # standalone: the user's only sign of life at the default log level
        print(f"hybridgate worker: READY ({config.kind}, pid {os.getpid()}) on {config.endpoint}", flush=True)
    else:  # under serve, which prints its own READY line
        log.info("%s worker ready on %s (pid %d)", config.kind, config.endpoint, os.getpid())


def _register(config: WorkerConfig, redis: RedisConfig | None, hello: Hello):
    """With --redis-url, this worker's registry entry, renewed until stopped (None without)."""
    if redis is None or not redis.url:
        return None
    from hybridgate.workers.registration import Registration, advertised_endpoint

    registration = Registration(redis, WorkerEntry(
        endpoint=advertised_endpoint(config.endpoint, config.advertise), kind=config.kind,
        fingerprint=hello.fingerprint, capacity=config.max_num_seqs, boot_id=hello.boot_id, name=config.name,
        handoff_endpoint=hello.handoff_endpoint, model=hello.model))
    registration.start()
    return registration


def _unlink_sockets(config: WorkerConfig) -> None:
    # The socket files this worker bound: a gateway started later must find no socket rather than one that
    # nobody listens on (the missing-socket check reads the file; a stale one would make it wait).
    for endpoint in (config.endpoint, config.resolved_handoff_endpoint):
        if endpoint and endpoint.startswith("ipc://"):
            Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
