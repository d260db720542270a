"""`serve --gateways N`: N gateway processes on one port, sharing the workers.

The first gateway runs in the `serve` process; the others are spawned
children, each with its own router (its own DEALER identity, so outputs go
back to the gateway that sent the request) connected to the same workers.
They share the port through SO_REUSEPORT, and only among themselves:
`hold_port` binds it first *with* SO_REUSEPORT and keeps that socket bound
(never listening, so the kernel hands it no connection) for the life of
`serve`. A port another program already holds fails that bind, as a port in
use fails a single gateway; a program without SO_REUSEPORT cannot take it
afterwards. The kernel spreads incoming connections (not streams: a client's
streams share its connection) over the listening gateways by a hash of the
connection's addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridgate.settings import Settings

log = logging.getLogger("hybridgate")


def hold_port(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT, not listening; port 0 picks a free one.

    Raises OSError naming --host and `flag` when the address is in use or not this machine's.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host, {flag})") from None
    return sock


@contextlib.contextmanager
def gateway_group(config: Settings, pools: list, main: Callable[[Settings, list, int, int], None],
                  ) -> Iterator[tuple[Settings, ExtraGateways | None]]:
    """(the settings to serve with, the other gateways) for `config.layout.gateways`: with more than
    one, the port is held (and a port 0 resolved) before any gateway or worker starts, and on the way
    out the other gateways are drained and joined (they have drained already after a clean stop).
    `main(config, pools, index, parent_pid)` runs each other gateway in its spawned process."""
    if config.layout.gateways == 1:
        yield config, None
        return
    held = hold_port(config.gateway.host, config.gateway.port)
    config = replace(config, gateway=replace(config.gateway, port=held.getsockname()[1]))
    held_http = None  # the HTTP API's port is shared the same way
    if config.gateway.http_port is not None:
        held_http = hold_port(config.gateway.host, config.gateway.http_port, "--http-port")
        config = replace(config, gateway=replace(config.gateway, http_port=held_http.getsockname()[1]))
    extra = ExtraGateways(config, pools, config.gateway.port, main)
    try:
        yield config, extra
    finally:
        extra.drain()
        extra.join(5)
        held.close()
        if held_http is not None:
            held_http.close()


class ExtraGateways:
    """Gateways 1..N-1 as child processes: started, restarted when one exits (at most the
    workers' restart limits), told to drain on shutdown, and joined."""

    def __init__(self, config: Settings, pools: list, port: int,
                 main: Callable[[Settings, list, int, int], None]):
        count = config.layout.gateways - 1
        gw = config.gateway
        # The workers may still be loading: a gateway of serve waits for their sockets, never exits for them.
        router = replace(config.router, wait_for_workers=True)
        self.configs = [replace(config, router=router, gateway=replace(
            gw, port=port, metrics_port=None if gw.metrics_port is None else (gw.metrics_port and gw.metrics_port + i)))
            for i in range(1, count + 1)]
        self.pools = pools  # the models and their workers (serve.ModelPool)
        self.main = main  # main(config, pools, index, parent_pid) in a spawned process: serve.gateway_main
        self.procs: list[mp.Process | None] = [None] * count
        self.restarts: list[list[float]] = [[] for _ in range(count)]
        self.stopping = False
        self._ctx = mp.get_context("spawn")

    def start_all(self) -> None:
        for i in range(len(self.procs)):
            self._start(i)

    def _start(self, i: int) -> None:
        proc = self._ctx.Process(target=self.main, name=f"hybridgate-gateway-{i + 1}",
                                 args=(self.configs[i], self.pools, i + 1, os.getpid()))
        proc.start()
        self.procs[i] = proc

    async def watch(self, window_s: float, max_restarts: int) -> None:
        """Restart a gateway that exited while serving; one that exits too often stays down."""
        while not self.stopping:
            await asyncio.sleep(0.5)
            for i, proc in enumerate(self.procs):
                if self.stopping or proc is None or proc.is_alive():
                    continue
                now = time.monotonic()
                recent = self.restarts[i] = [t for t in self.restarts[i] if now - t < window_s] + [now]
                if len(recent) > max_restarts:
                    print(f"hybridgate: gateway {i + 1} exited ({proc.exitcode}) {len(recent)} times within "
                          f"{window_s:g} s; it stays down", file=sys.stderr, flush=True)
                    self.procs[i] = None
                    continue
                print(f"hybridgate: gateway {i + 1} exited ({proc.exitcode}); restarting it", file=sys.stderr,
                      flush=True)
                self._start(i)

    def drain(self) -> None:
        """Tell every gateway to drain (SIGTERM: health NOT_SERVING, its streams get the grace period)."""
        self.stopping = True
        for proc in self.procs:
            if proc is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def join(self, timeout_s: float) -> None:
        """Wait for the drained gateways; kill one still running after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            if proc is None:
                continue
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
