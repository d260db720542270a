"""`hybridgate serve` and `hybridgate gateway`: the gateway process, and under serve its supervised workers."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hybridgate.run.children import die_with_parent
from hybridgate.cpuset import available_cores, format_cpulist, split, worker_cores
from hybridgate.gateway.admission import Admission
from hybridgate.gateway.models import ModelTable, ServedModel
from hybridgate.gateway.server import Gateway
from hybridgate.security.keys import Transport
from hybridgate.models import model_names
from hybridgate.security.redisconf import redacted
from hybridgate.router import Router, ZmqWorkerClient
from hybridgate.router.client import missing_ipc_socket
from hybridgate.run.scaleout import ExtraGateways, gateway_group
from hybridgate.run.config import LayoutConfig
from hybridgate.run.supervise import Supervisor
from hybridgate.wire import WorkerState
from hybridgate.workers.config import EngineConfig, WorkerConfig

if TYPE_CHECKING:
    from hybridgate.models import GGUFModel
    from hybridgate.settings import Settings

log = logging.getLogger("hybridgate")


def cuda_present() -> bool:
    """Whether a CUDA device is usable; torch is imported only where an NVIDIA device node exists."""
    if not any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def worker_layout(layout: LayoutConfig, model: str = "") -> list[str]:
    """The kinds of the workers `serve` starts for one model (`layout`: that model's, `Settings.model_settings`):
    by default one CPU worker without CUDA, one GPU worker and one CPU worker with it; --gpu-workers /
    --cpu-workers (or the model's own gpu-workers=N, cpu-workers=N) override either count.

    Raises ValueError naming the settings (and `model`, when named) when both counts are zero
    (LayoutConfig refuses negatives).
    """
    gpu = layout.gpu_workers if layout.gpu_workers is not None else int(cuda_present())
    cpu = layout.cpu_workers
    if gpu + cpu == 0:
        where = f" of model {model}" if model else ""
        raise ValueError(f"--gpu-workers, --cpu-workers: at least one worker is needed{where} (both are 0)")
    return ["gpu"] * gpu + ["cpu"] * cpu


@dataclass(frozen=True)
class ModelPool:
    """One served model as the gateway runs it: its name ("": the GGUF's own, `models.model_names`), its
    GGUF path, and its workers' endpoints and names (empty names: the workers' own, from HELLO)."""

    name: str
    path: str
    endpoints: tuple[str, ...]
    worker_names: tuple[str, ...] = ()


def static_pools(config: Settings) -> list[ModelPool]:
    """`gateway`'s models and their workers: each --worker ENDPOINT serves the default (first) model, a
    --worker NAME=ENDPOINT the model of that name; with --redis-url, workers are also found in the registry
    (by their model's fingerprint). Raises ValueError naming --worker for a NAME that is not a --model."""
    from hybridgate.settings import resolved_path

    specs = config.models
    by_name: dict[str, list[str]] = {spec.name: [] for spec in specs}
    for value in config.layout.worker_endpoints:
        name, sep, endpoint = value.partition("=")
        if not sep or "://" in name:
            name, endpoint = specs[0].name, value
        if name not in by_name:
            raise ValueError(f"--worker: {value!r} names model {name!r}, which no --model NAME=PATH serves "
                             f"(served: {', '.join(s.name for s in specs if s.name) or 'one unnamed model'})")
        by_name[name].append(endpoint)
    return [ModelPool(spec.name, resolved_path(spec), tuple(by_name[spec.name])) for spec in specs]


SOCKET_CHECK_S = 3.0  # `gateway`: when to say that nothing listens on an ipc endpoint


async def check_sockets(clients: list[ZmqWorkerClient], wait: bool, fail) -> None:
    """After SOCKET_CHECK_S, name each ipc endpoint with no socket file (and no READY worker);
    `fail()` unless `wait` (--wait-for-workers)."""
    await asyncio.sleep(SOCKET_CHECK_S)
    missing = [c.endpoint for c in clients if c.state != WorkerState.READY and missing_ipc_socket(c.endpoint)]
    for endpoint in missing:
        then = "waiting for a worker to bind it (--wait-for-workers)" if wait else \
            "start the worker first, or pass --wait-for-workers to wait for it"
        print(f"hybridgate: nothing is listening on {endpoint} (no socket file); {then}", file=sys.stderr, flush=True)
    if missing and not wait:
        fail()


def served_names(name: str, aliases: Sequence[str], model: GGUFModel) -> tuple[str, ...]:
    """The names one model answers to, its name first: `name` (a fleet's --model NAME=PATH) and the
    `aliases` (--served-model-name) as the operator gives them; where they give none, the model's own
    (`models.model_names`: its file's stem, then its GGUF general.name as an alias)."""
    served = ((name,) if name else ()) + tuple(a for a in aliases if a != name)
    return served or model_names(model)


def build_models(config: Settings, pools: Sequence[ModelPool], transport: Transport) -> ModelTable:
    """A router per model pool (its own clients, registry and response cache: placement, hand-offs, prefix
    hashes and cached answers stay within a model), as the gateway's table of served models."""
    from hybridgate.router.response_cache import ResponseCache

    rows = []
    index = {spec.name: i for i, spec in enumerate(config.models)}
    for pool in pools:
        own = config.model_settings(index[pool.name])  # the model's chat template, aliases, max model length
        names = pool.worker_names or ("",) * len(pool.endpoints)
        clients = [ZmqWorkerClient(ep, dead_after_s=config.router.dead_after_s, name=name, transport=transport)
                   for ep, name in zip(pool.endpoints, names)]
        registry = None
        if config.redis.url:
            from hybridgate.router.registry import RedisRegistry

            registry = RedisRegistry(config.redis, dead_after_s=config.router.dead_after_s, transport=transport)
        cache = ResponseCache.from_config(config.response_cache, config.redis)
        router = Router(pool.path, clients, own.router, registry=registry, response_cache=cache)
        operator_named = bool(pool.name or own.gateway.served_model_name)
        rows.append(ServedModel(served_names(pool.name, own.gateway.served_model_name, router.model), router,
                                Admission(config.gateway.max_inflight_requests), list_aliases=operator_named))
    fingerprints = {row.router.fingerprint for row in rows}
    for row in rows:
        if row.router.registry is not None:
            row.router.registry.siblings = frozenset(fingerprints - {row.router.fingerprint})
    return ModelTable(rows)


def _ready_line(models: ModelTable) -> str:
    """READY's account of the workers: `cpu, gpu workers`, or per model with several."""
    def workers(router: Router) -> str:
        ready = [c.kind for c in router.clients if c.state == WorkerState.READY]
        return f"{', '.join(ready)} worker{'s' if len(ready) > 1 else ''}" if ready else "no worker yet"

    if len(models) == 1:
        return workers(models.default.router)
    return "; ".join(f"{m.name}: {workers(m.router)}" for m in models)


async def run_gateway(config: Settings, pools: Sequence[ModelPool], supervisor: Supervisor | None = None,
                      extra: ExtraGateways | None = None, reuse_port: bool = False, index: int = 0) -> int:
    """Serve until SIGINT/SIGTERM. Under `serve`, `supervisor` starts its workers once the port is
    bound (so a port in use fails at once) and keeps them running; the pools name the clients.
    `extra`: the other gateways of `serve --gateways N`, started once this one listens and drained
    with it; such a gateway runs this with `reuse_port` and its `index` (it prints no READY line).
    Returns the exit status: 1 when a router could not come up or a worker or gateway failed for good."""
    transport = Transport(config.transport)
    for pool in pools:  # before anything starts: a tcp worker without keys is refused here
        for endpoint in pool.endpoints:
            transport.check(endpoint, "--worker")
    models = build_models(config, pools, transport)
    routers = [m.router for m in models]
    clients = [c for r in routers for c in r.clients]
    gateway = Gateway(models, config.gateway, reuse_port=reuse_port)
    for router in routers:
        router.on_ready_change = gateway.on_ready_change
    await gateway.start()
    stop, failures = asyncio.Event(), []

    def fail() -> None:
        failures.append(1)
        stop.set()

    background = []
    if supervisor is not None:
        by_name = {c.name: c for c in clients}
        supervisor.on_exit = lambda name, reason: by_name[name].worker_exited(reason)
        supervisor.start_all()
        gateway.metrics.registry.register(supervisor)
        background.append(asyncio.create_task(supervise(supervisor, fail)))
    say = (lambda line: print(f"hybridgate: {line}", flush=True)) if index == 0 else \
        (lambda line: log.info("gateway %d: %s", index, line))
    _say_listening(config, gateway, index, say)
    if extra is not None:
        extra.start_all()
        background.append(asyncio.create_task(extra.watch(config.supervisor.restart_window_s,
                                                          config.supervisor.max_restarts)))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if supervisor is None:
        background.append(asyncio.create_task(check_sockets(clients, config.router.wait_for_workers, fail)))
    # Each model's router must come up (a worker READY within startup_timeout_s); later, one model's pool
    # going down leaves the others serving.
    entered = asyncio.create_task(_enter_all(routers))
    waiter = asyncio.create_task(stop.wait())
    code = await _serve_until_stopped(config, models, extra, entered, waiter, say)
    say(f"shutting down (health NOT_SERVING, in-flight streams get {config.gateway.grace_s:g} s)")
    if supervisor is not None:
        supervisor.stopping = True  # workers run on through the grace period, but are not restarted
    if extra is not None:
        extra.drain()  # they drain beside this one; the workers serve them until all are done
    await gateway.stop()
    if extra is not None:
        await asyncio.to_thread(extra.join, config.gateway.grace_s + 5)
    for task in (entered, waiter, *background):
        task.cancel()
    await asyncio.gather(*(r.close() for r in routers), return_exceptions=True)
    return 1 if failures else code


def _say_listening(config: Settings, gateway: Gateway, index: int, say: Callable[[str], None]) -> None:
    """The doors this gateway listens on (gRPC, HTTP, metrics), each with what it answers before a worker is up."""
    say(f"gRPC on {config.gateway.host}:{gateway.port} (health NOT_SERVING until a worker is up)")
    if gateway.http_port is not None:
        scheme = "https" if config.gateway.tls_cert else "http"
        say(f"OpenAI-compatible HTTP on {scheme}://{config.gateway.host}:{gateway.http_port}/v1 "
            "(/health 503 until a worker is up)")
    if gateway.metrics_port is not None:
        where = f"http://{config.gateway.host}:{gateway.metrics_port}/metrics"
        print(f"hybridgate: metrics on {where}" if index == 0 else f"hybridgate: gateway {index} metrics on {where}",
              flush=True)


async def _serve_until_stopped(config: Settings, models: Sequence, extra: ExtraGateways | None,
                               entered: asyncio.Task, waiter: asyncio.Task, say: Callable[[str], None]) -> int:
    """Waits for the routers to come up (`entered`), says READY, and serves until `waiter` (the stop event)
    ends; returns 1 when a router failed to come up (its error printed), else 0."""
    routers = [m.router for m in models]
    await asyncio.wait({entered, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if not entered.done():
        return 0
    if entered.exception() is not None:
        print(f"hybridgate: error: {entered.exception()}", file=sys.stderr, flush=True)
        return 1
    # What startup made (imports, the models' tables, the apps) lives as long as the process: out of the
    # collector's sight, a full collection walks only what serving made since. Measured under `bench gateway`
    # (64 streams): a full collection over the ~100,000 startup objects held the loop 60 ms, 1.8 µs a message
    # of the HTTP door's CPU.
    gc.freeze()
    # Serving already (health is SERVING with one READY worker); the line waits for the rest.
    settled = asyncio.gather(*(r.wait_settled(config.router.startup_timeout_s) for r in routers))
    await asyncio.wait({settled, waiter}, return_when=asyncio.FIRST_COMPLETED)
    settled.cancel()
    for c in (c for r in routers for c in r.clients):
        if c.state != WorkerState.READY:
            print(f"hybridgate: warning: worker {c.name} ({c.endpoint}) is {c.state.name} (see its log above)",
                  file=sys.stderr, flush=True)
    gateways = f", {len(extra.procs) + 1} gateways" if extra is not None else ""
    found = f", workers from Redis at {redacted(config.redis.url)}" if config.redis.url else ""
    served = f"model {routers[0].model.path}" if len(models) == 1 else \
        "models " + ", ".join(f"{m.name}={m.router.model.path}" for m in models)
    say(f"READY ({_ready_line(models)}{gateways}{found}) — {served}")
    await waiter
    return 0


async def _enter_all(routers: Sequence[Router]) -> None:
    """Enter every router (each waits for a READY worker); the first failure is raised."""
    await asyncio.gather(*(r.__aenter__() for r in routers))


async def supervise(supervisor: Supervisor, fail: Callable[[], None]) -> None:
    """Run the supervisor; once every worker stays down after its restarts, say why and `fail()`
    (serve exits 1) rather than answer 503 forever."""
    await supervisor.run()
    reason = supervisor.gave_up()
    if reason is not None:
        print(f"hybridgate: error: every worker stays down after its restarts (--worker-max-restarts); {reason}",
              file=sys.stderr, flush=True)
        fail()


def _run(coro) -> int:
    try:
        import uvloop
    except ImportError:  # the gateway works on the default loop too
        return asyncio.run(coro)
    return uvloop.run(coro)


def remove_stale_socket_dirs() -> list[str]:
    """Remove this user's hybridgate-* socket folders left by a `serve` that was killed (its
    serve.pid names a process that no longer runs); returns the removed paths."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob("hybridgate-*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            pid = int((folder / "serve.pid").read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
        except PermissionError:  # alive, another user's
            pass
    return removed


def cpu_engines(engine: EngineConfig, kinds: Sequence[str], cuda: bool,
                available: tuple[int, ...]) -> list[EngineConfig]:
    """Each worker's engine settings, in `kinds`' order: the workers computing on the CPU (CPU workers, and
    GPU workers too without CUDA: their torch device is the CPU) share its cores instead of each taking all.

    Each gets its own contiguous slice of --cpu-cores (default: `available`, or --numa-node's cores among
    them), and threads (unless --threads) as many as its slice's cores. A lone such worker is left
    unpinned unless --cpu-cores or --numa-node names its cores; GPU workers on CUDA get no --cpu-cores (only
    --numa-node's cores). With fewer cores than such workers there
    are no disjoint slices: they share the cores (--cpu-cores'; by default unpinned), a warning says so,
    and the threads are split as evenly as they go.
    """
    on_cpu = [kind == "cpu" or not cuda for kind in kinds]
    count = sum(on_cpu)
    named = worker_cores(engine.cpu_cores, engine.numa_node, available)
    others = replace(engine, cpu_cores="")  # GPU workers on CUDA: --numa-node's cores at most
    if count == 0 or (count == 1 and named is None):
        return [engine if computes else others for computes in on_cpu]
    cores = named or available
    slices = split(cores, count)
    if slices is None:
        log.warning("%d cores (%s) for %d workers computing on the CPU: fewer cores than workers, so they are not "
                    "pinned to disjoint cores%s", len(cores), format_cpulist(cores), count,
                    " (each runs on all of --cpu-cores)" if engine.cpu_cores else "")
        shared = replace(engine, threads=engine.threads or max(1, len(cores) // count))
        placed = iter([shared] * count)
    else:
        placed = iter(replace(engine, cpu_cores=format_cpulist(part), threads=engine.threads or len(part))
                      for part in slices)
    return [next(placed) if computes else others for computes in on_cpu]


def fleet_workers(config: Settings, private: str,
                  available: tuple[int, ...]) -> tuple[list[ModelPool], dict[str, WorkerConfig]]:
    """The pools `serve` runs and each worker's settings by name: each model's workers (`worker_layout` of its
    own settings) with its own engine, KV cache and max model length, on ipc endpoints in `private`; the
    workers computing on the CPU split `available` cores across every model's (`cpu_engines`).
    Raises ValueError naming the setting (and the model) as worker_layout and the settings do."""
    from hybridgate.settings import resolved_path

    specs = config.models
    owns = [config.model_settings(i) for i in range(len(specs))]  # each model's own settings
    layouts = [worker_layout(own.layout, spec.name) for spec, own in zip(specs, owns)]
    kinds = [kind for layout in layouts for kind in layout]
    placed = iter(cpu_engines(config.worker.engine, kinds, "gpu" in kinds and cuda_present(), available))
    pools, configs = [], {}
    for spec, own, layout in zip(specs, owns, layouts):
        path = resolved_path(spec)
        prefix = f"{spec.name}-" if len(specs) > 1 else ""  # gpu-0, cpu-0, ...; with several models chat-cpu-0
        names = [f"{prefix}{kind}-{layout[:i].count(kind)}" for i, kind in enumerate(layout)]
        endpoints = [f"ipc://{private}/worker-{len(configs) + i}.sock" for i in range(len(layout))]
        for name, kind, endpoint in zip(names, layout, endpoints):
            cores = next(placed)  # the cores and threads of this worker; the rest of its engine is its model's
            engine = replace(own.worker.engine, cpu_cores=cores.cpu_cores, threads=cores.threads)
            configs[name] = replace(own.worker, model_path=path, model_name=spec.name, endpoint=endpoint,
                                    kind=kind, engine=engine, parent_pid=os.getpid(), name=name,
                                    max_model_len=own.worker.max_model_len or own.router.max_model_len)
        pools.append(ModelPool(spec.name, path, tuple(endpoints), tuple(names)))
    return pools, configs


def serve(config: Settings) -> int:
    """Gateway in this process, each model's workers (`fleet_workers`) in spawned children; exit 0 on
    SIGINT/SIGTERM, no child left."""
    remove_stale_socket_dirs()
    private = tempfile.mkdtemp(prefix="hybridgate-")  # mode 0700: only this user reaches the ipc sockets
    Path(private, "serve.pid").write_text(str(os.getpid()))
    try:
        pools, configs = fleet_workers(config, private, available_cores())
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    supervisor = Supervisor(configs, config.supervisor, private)  # its workers bind once loaded: no socket check
    try:
        with gateway_group(config, pools, gateway_main) as (config, extra):
            return _run(run_gateway(config, pools, supervisor, extra, reuse_port=extra is not None))
    finally:
        supervisor.stop_all()
        shutil.rmtree(private, ignore_errors=True)


def gateway_main(config: Settings, pools: list[ModelPool], index: int, parent_pid: int) -> None:
    """Entry of gateway `index` >= 1 (spawned by scaleout.ExtraGateways): serve until SIGTERM/SIGINT;
    exit with `serve`."""
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s gateway-{index} %(levelname)s %(message)s")
    sys.exit(_run(run_gateway(config, pools, reuse_port=True, index=index)))


def gateway_only(config: Settings) -> int:
    if not config.layout.worker_endpoints and not config.redis.url:
        raise ValueError("--worker: give at least one worker endpoint (ipc://... or tcp://...), "
                         "or --redis-url to find workers in the registry")
    pools = static_pools(config)
    with gateway_group(config, pools, gateway_main) as (config, extra):
        return _run(run_gateway(config, pools, extra=extra, reuse_port=extra is not None))
