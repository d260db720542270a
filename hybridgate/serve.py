"""`hybridgate serve` and `hybridgate gateway`: the gateway process, and under serve its worker."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field

from hybridgate.gateway.server import Gateway, GatewayConfig
from hybridgate.router import Router, RouterConfig, ZmqWorkerClient
from hybridgate.workers.process import WorkerConfig, run_worker

log = logging.getLogger("hybridgate")


@dataclass(frozen=True)
class ServeConfig:
    model_path: str
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    worker_endpoints: tuple[str, ...] = ()  # `gateway`: connect to these; `serve`: spawn one worker
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    threads: int | None = None
    device: str | None = None
    kv_cache_memory: str | None = None
    prefix_caching: bool = True
    enforce_eager: bool = False
    dead_after_s: float = 1.0


def spawn_worker(config: WorkerConfig) -> multiprocessing.Process:
    """A worker process started with `spawn` (Numba's OpenMP and gRPC do not survive fork)."""
    proc = multiprocessing.get_context("spawn").Process(target=run_worker, args=(config,), name="hybridgate-worker")
    proc.daemon = True
    proc.start()
    return proc


async def run_gateway(config: ServeConfig, endpoints: list[str]) -> int:
    clients = [ZmqWorkerClient(ep, dead_after_s=config.dead_after_s) for ep in endpoints]
    router = Router(config.model_path, clients, config.router)
    gateway = Gateway(router, config.gateway)
    router.on_ready_change = gateway.on_ready_change
    await gateway.start()
    print(f"hybridgate: gRPC on {config.gateway.host}:{gateway.port} (health NOT_SERVING until a worker is up)",
          flush=True)
    if gateway.metrics_port is not None:
        print(f"hybridgate: metrics on http://{config.gateway.host}:{gateway.metrics_port}/metrics", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    entered = asyncio.create_task(router.__aenter__())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({entered, waiter}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if entered.done() and entered.exception() is not None:
        print(f"hybridgate: error: {entered.exception()}", file=sys.stderr, flush=True)
        code = 1
    elif entered.done():
        print(f"hybridgate: READY ({', '.join(c.kind or '?' for c in clients)} worker) — model "
              f"{config.model_path}", flush=True)
        await stop.wait()
    print("hybridgate: shutting down (health NOT_SERVING, in-flight streams get "
          f"{config.gateway.grace_s:g} s)", flush=True)
    await gateway.stop()
    entered.cancel()
    waiter.cancel()
    await router.close()
    return code


def _run(coro) -> int:
    try:
        import uvloop
    except ImportError:  # the gateway works on the default loop too
        return asyncio.run(coro)
    return uvloop.run(coro)


def serve(config: ServeConfig) -> int:
    """Gateway in this process, one worker in a spawned child; exit 0 on SIGINT/SIGTERM, no child left."""
    private = tempfile.mkdtemp(prefix="hybridgate-")  # mode 0700: only this user reaches the ipc socket
    endpoint = f"ipc://{private}/worker-0.sock"
    worker = spawn_worker(WorkerConfig(
        model_path=config.model_path, endpoint=endpoint, kind="gpu", max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, threads=config.threads, device=config.device,
        kv_cache_memory=config.kv_cache_memory, prefix_caching=config.prefix_caching,
        enforce_eager=config.enforce_eager, parent_pid=os.getpid(),
    ))
    try:
        return _run(run_gateway(config, [endpoint]))
    finally:
        worker.terminate()
        worker.join(5)
        if worker.is_alive():
            worker.kill()
            worker.join()
        shutil.rmtree(private, ignore_errors=True)


def gateway_only(config: ServeConfig) -> int:
    return _run(run_gateway(config, list(config.worker_endpoints)))
