"""`hybridgate serve` and `hybridgate gateway`: the gateway process, and under serve its supervised workers."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hybridgate.children import die_with_parent
from hybridgate.gateway.server import Gateway
from hybridgate.keys import Transport
from hybridgate.redisconf import redacted
from hybridgate.router import Router, ZmqWorkerClient
from hybridgate.router.client import missing_ipc_socket
from hybridgate.scaleout import ExtraGateways, gateway_group
from hybridgate.serveconf import LayoutConfig
from hybridgate.supervise import Supervisor
from hybridgate.wire import WorkerState
from hybridgate.workerconf import WorkerConfig

if TYPE_CHECKING:
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


def worker_layout(layout: LayoutConfig) -> list[str]:
    """The kinds of the workers `serve` starts: by default one CPU worker without CUDA, one GPU
    worker and one CPU worker with it; --gpu-workers / --cpu-workers override either count.

    Raises ValueError naming the flags when both counts are zero (LayoutConfig refuses negatives).
    """
    gpu = layout.gpu_workers if layout.gpu_workers is not None else int(cuda_present())
    cpu = layout.cpu_workers
    if gpu + cpu == 0:
        raise ValueError("--gpu-workers, --cpu-workers: at least one worker is needed (both are 0)")
    return ["gpu"] * gpu + ["cpu"] * cpu


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


async def run_gateway(config: Settings, endpoints: list[str], supervisor: Supervisor | None = None,
                      extra: ExtraGateways | None = None, reuse_port: bool = False, index: int = 0) -> int:
    """Serve until SIGINT/SIGTERM. Under `serve`, `supervisor` starts its workers once the port is
    bound (so a port in use fails at once) and keeps them running; its slots name the clients.
    `extra`: the other gateways of `serve --gateways N`, started once this one listens and drained
    with it; such a gateway runs this with `reuse_port` and its `index` (it prints no READY line)."""
    names = [slot.name for slot in supervisor.slots] if supervisor is not None else [""] * len(endpoints)
    transport = Transport(config.transport)
    for endpoint in endpoints:  # before anything starts: a tcp worker without keys is refused here
        transport.check(endpoint, "--worker")
    clients = [ZmqWorkerClient(ep, dead_after_s=config.router.dead_after_s, name=name, transport=transport)
               for ep, name in zip(endpoints, names)]
    registry = None
    if config.redis.url:
        from hybridgate.router.registry import RedisRegistry

        registry = RedisRegistry(config.redis, dead_after_s=config.router.dead_after_s, transport=transport)
    from hybridgate.router.response_cache import ResponseCache

    cache = ResponseCache.from_config(config.response_cache, config.redis)
    router = Router(config.model_path, clients, config.router, registry=registry, response_cache=cache)
    gateway = Gateway(router, config.gateway, reuse_port=reuse_port)
    router.on_ready_change = gateway.on_ready_change
    await gateway.start()
    background = []
    stop = asyncio.Event()
    code = 0

    def fail() -> None:
        nonlocal code
        code = 1
        stop.set()

    if supervisor is not None:
        by_name = dict(zip(names, clients))
        supervisor.on_exit = lambda name, reason: by_name[name].worker_exited(reason)
        supervisor.start_all()
        gateway.metrics.registry.register(supervisor)
        background.append(asyncio.create_task(supervise(supervisor, fail)))
    say = (lambda line: print(f"hybridgate: {line}", flush=True)) if index == 0 else \
        (lambda line: log.info("gateway %d: %s", index, line))
    say(f"gRPC on {config.gateway.host}:{gateway.port} (health NOT_SERVING until a worker is up)")
    if gateway.http_port is not None:
        scheme = "https" if config.gateway.tls_cert else "http"
        say(f"OpenAI-compatible HTTP on {scheme}://{config.gateway.host}:{gateway.http_port}/v1 "
            "(/health 503 until a worker is up)")
    if gateway.metrics_port is not None:
        where = f"http://{config.gateway.host}:{gateway.metrics_port}/metrics"
        print(f"hybridgate: metrics on {where}" if index == 0 else f"hybridgate: gateway {index} metrics on {where}",
              flush=True)
    if extra is not None:
        extra.start_all()
        background.append(asyncio.create_task(extra.watch(config.supervisor.restart_window_s,
                                                          config.supervisor.max_restarts)))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if supervisor is None:
        background.append(asyncio.create_task(check_sockets(clients, config.router.wait_for_workers, fail)))
    entered = asyncio.create_task(router.__aenter__())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({entered, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if entered.done() and entered.exception() is not None:
        print(f"hybridgate: error: {entered.exception()}", file=sys.stderr, flush=True)
        code = 1
    elif entered.done():
        # Serving already (health is SERVING with one READY worker); the line waits for the rest.
        settled = asyncio.create_task(router.wait_settled(config.router.startup_timeout_s))
        await asyncio.wait({settled, waiter}, return_when=asyncio.FIRST_COMPLETED)
        settled.cancel()
        ready = [c.kind for c in router.clients if c.state == WorkerState.READY]
        for c in router.clients:
            if c.state != WorkerState.READY:
                print(f"hybridgate: warning: worker {c.name} ({c.endpoint}) is {c.state.name} (see its log above)",
                      file=sys.stderr, flush=True)
        gateways = f", {len(extra.procs) + 1} gateways" if extra is not None else ""
        workers = f"{', '.join(ready)} worker{'s' if len(ready) > 1 else ''}" if ready else "no worker yet"
        found = f", workers from Redis at {redacted(config.redis.url)}" if registry is not None else ""
        say(f"READY ({workers}{gateways}{found}) — model {config.model_path}")
        await stop.wait()
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
    await router.close()
    return code


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


def serve(config: Settings) -> int:
    """Gateway in this process, the workers of `worker_layout` in spawned children; exit 0 on
    SIGINT/SIGTERM, no child left."""
    kinds = worker_layout(config.layout)
    threads = config.worker.engine.threads
    # The workers that compute on the CPU share its cores instead of each taking all: the CPU workers,
    # and the GPU workers too where there is no CUDA (their torch device is the CPU).
    on_cpu = kinds.count("cpu") + (kinds.count("gpu") if "gpu" in kinds and not cuda_present() else 0)
    if threads is None and on_cpu > 1:
        threads = max(1, (os.cpu_count() or 1) // on_cpu)
    remove_stale_socket_dirs()
    private = tempfile.mkdtemp(prefix="hybridgate-")  # mode 0700: only this user reaches the ipc sockets
    Path(private, "serve.pid").write_text(str(os.getpid()))
    endpoints = [f"ipc://{private}/worker-{i}.sock" for i in range(len(kinds))]
    names = [f"{kind}-{kinds[:i].count(kind)}" for i, kind in enumerate(kinds)]  # gpu-0, cpu-0, cpu-1, ...
    engine = replace(config.worker.engine, threads=threads)
    configs = {name: replace(config.worker, model_path=config.model_path, endpoint=endpoint, kind=kind, engine=engine,
                             parent_pid=os.getpid(), name=name)
               for name, kind, endpoint in zip(names, kinds, endpoints)}
    supervisor = Supervisor(configs, config.supervisor, private)  # its workers bind once loaded: no socket check
    try:
        with gateway_group(config, endpoints, gateway_main) as (config, extra):
            return _run(run_gateway(config, endpoints, supervisor, extra, reuse_port=extra is not None))
    finally:
        supervisor.stop_all()
        shutil.rmtree(private, ignore_errors=True)


def gateway_main(config: Settings, endpoints: list[str], index: int, parent_pid: int) -> None:
    """Entry of gateway `index` >= 1 (spawned by scaleout.ExtraGateways): serve until SIGTERM/SIGINT;
    exit with `serve`."""
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s gateway-{index} %(levelname)s %(message)s")
    sys.exit(_run(run_gateway(config, endpoints, reuse_port=True, index=index)))


def gateway_only(config: Settings) -> int:
    if not config.layout.worker_endpoints and not config.redis.url:
        raise ValueError("--worker: give at least one worker endpoint (ipc://... or tcp://...), "
                         "or --redis-url to find workers in the registry")
    endpoints = list(config.layout.worker_endpoints)
    with gateway_group(config, endpoints, gateway_main) as (config, extra):
        return _run(run_gateway(config, endpoints, extra=extra, reuse_port=extra is not None))
