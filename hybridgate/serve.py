"""`hybridgate serve` and `hybridgate gateway`: the gateway process, and under serve its supervised workers."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hybridgate.gateway.server import Gateway, GatewayConfig
from hybridgate.router import Router, RouterConfig, ZmqWorkerClient
from hybridgate.router.client import missing_ipc_socket
from hybridgate.supervise import Supervisor, SupervisorConfig
from hybridgate.wire import WorkerState
from hybridgate.workers.process import WorkerConfig

log = logging.getLogger("hybridgate")


@dataclass(frozen=True)
class ServeConfig:
    model_path: str
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    worker_endpoints: tuple[str, ...] = ()  # `gateway`: connect to these; `serve`: spawns its own
    gpu_workers: int | None = None  # `serve`: None → the default layout (`worker_layout`)
    cpu_workers: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    threads: int | None = None
    device: str | None = None
    kv_cache_memory: str | None = None
    prefix_caching: bool = True
    enforce_eager: bool = False
    dead_after_s: float = 1.0
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)


def cuda_present() -> bool:
    """Whether a CUDA device is usable; torch is imported only where an NVIDIA device node exists."""
    if not any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def worker_layout(config: ServeConfig) -> list[str]:
    """The kinds of the workers `serve` starts: by default one CPU worker without CUDA, one GPU
    worker and one CPU worker with it; --gpu-workers / --cpu-workers override either count.

    Raises ValueError naming the flag when a count is negative or both are zero.
    """
    gpu = config.gpu_workers if config.gpu_workers is not None else int(cuda_present())
    cpu = config.cpu_workers if config.cpu_workers is not None else 1
    for flag, n in (("--gpu-workers", gpu), ("--cpu-workers", cpu)):
        if n < 0:
            raise ValueError(f"{flag}: must be >= 0, got {n}")
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


async def run_gateway(config: ServeConfig, endpoints: list[str], supervisor: Supervisor | None = None) -> int:
    """Serve until SIGINT/SIGTERM. Under `serve`, `supervisor` starts its workers once the port is
    bound (so a port in use fails at once) and keeps them running; its slots name the clients."""
    names = [slot.name for slot in supervisor.slots] if supervisor is not None else [""] * len(endpoints)
    clients = [ZmqWorkerClient(ep, dead_after_s=config.dead_after_s, name=name) for ep, name in zip(endpoints, names)]
    router = Router(config.model_path, clients, config.router)
    gateway = Gateway(router, config.gateway)
    router.on_ready_change = gateway.on_ready_change
    await gateway.start()
    background = []
    if supervisor is not None:
        by_name = dict(zip(names, clients))
        supervisor.on_exit = lambda name, reason: by_name[name].worker_exited(reason)
        supervisor.start_all()
        gateway.metrics.registry.register(supervisor)
        background.append(asyncio.create_task(supervisor.run()))
    print(f"hybridgate: gRPC on {config.gateway.host}:{gateway.port} (health NOT_SERVING until a worker is up)",
          flush=True)
    if gateway.metrics_port is not None:
        print(f"hybridgate: metrics on http://{config.gateway.host}:{gateway.metrics_port}/metrics", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = 0

    def fail() -> None:
        nonlocal code
        code = 1
        stop.set()

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
        ready = [c.kind for c in clients if c.state == WorkerState.READY]
        for c in clients:
            if c.state != WorkerState.READY:
                print(f"hybridgate: warning: worker {c.name} ({c.endpoint}) is {c.state.name} (see its log above)",
                      file=sys.stderr, flush=True)
        print(f"hybridgate: READY ({', '.join(ready)} worker{'s' if len(ready) > 1 else ''}) — model "
              f"{config.model_path}", flush=True)
        await stop.wait()
    print("hybridgate: shutting down (health NOT_SERVING, in-flight streams get "
          f"{config.gateway.grace_s:g} s)", flush=True)
    if supervisor is not None:
        supervisor.stopping = True  # workers run on through the grace period, but are not restarted
    await gateway.stop()
    for task in (entered, waiter, *background):
        task.cancel()
    await router.close()
    return code


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


def serve(config: ServeConfig) -> int:
    """Gateway in this process, the workers of `worker_layout` in spawned children; exit 0 on
    SIGINT/SIGTERM, no child left."""
    kinds = worker_layout(config)
    threads = config.threads
    cpu_count = kinds.count("cpu")
    if threads is None and cpu_count > 1:  # CPU workers share the cores instead of each taking all
        threads = max(1, (os.cpu_count() or 1) // cpu_count)
    remove_stale_socket_dirs()
    private = tempfile.mkdtemp(prefix="hybridgate-")  # mode 0700: only this user reaches the ipc sockets
    Path(private, "serve.pid").write_text(str(os.getpid()))
    endpoints = [f"ipc://{private}/worker-{i}.sock" for i in range(len(kinds))]
    names = [f"{kind}-{kinds[:i].count(kind)}" for i, kind in enumerate(kinds)]  # gpu-0, cpu-0, cpu-1, ...
    configs = {name: WorkerConfig(
        model_path=config.model_path, endpoint=endpoint, kind=kind, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, threads=threads, device=config.device,
        kv_cache_memory=config.kv_cache_memory, prefix_caching=config.prefix_caching,
        enforce_eager=config.enforce_eager, parent_pid=os.getpid(), name=name,
    ) for name, kind, endpoint in zip(names, kinds, endpoints)}
    supervisor = Supervisor(configs, config.supervisor, private)  # its workers bind once loaded: no socket check
    try:
        return _run(run_gateway(config, endpoints, supervisor))
    finally:
        supervisor.stop_all()
        shutil.rmtree(private, ignore_errors=True)


def gateway_only(config: ServeConfig) -> int:
    return _run(run_gateway(config, list(config.worker_endpoints)))
