"""The HTTP door's server: uvicorn on the gateway's own event loop, on a socket bound before anything starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn


class _NoSignals(uvicorn.Server):
    """uvicorn without its own signal handlers: `serve` drains both doors on SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn before 0.29
        pass


class HttpDoor:
    """An ASGI `app` on a socket bound at construction (port 0: a free one; `port` is the bound one).
    `close_s`: what requests still running at `stop` get (the gateway drains before it stops this).

    Raises OSError naming --host and --http-port when the address cannot be bound.
    """

    def __init__(self, app, host: str, port: int, close_s: float, reuse_port: bool = False,
                 tls: tuple[str, str, str | None] | None = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host, --http-port)") from None
        self.port = self.sock.getsockname()[1]
        # tls: (certificate chain, key, client CA or None), the gRPC port's --tls-cert, --tls-key, --tls-client-ca
        cert, key, client_ca = tls if tls is not None else (None, None, None)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=max(close_s, 0.1), loop="none",
                                http="auto",  # httptools (a dependency) where it imports, else h11
                                ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=client_ca,
                                ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE)
        self.server = _NoSignals(config)
        uvicorn_log = logging.getLogger("uvicorn.error")
        if uvicorn_log.level == logging.NOTSET:  # its start and stop lines say nothing serve does not
            uvicorn_log.setLevel(logging.WARNING)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise OSError("the HTTP server stopped while starting (--http-port)")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Close the listener and idle connections; requests in flight get `close_s` to finish."""
        if self._task is None:
            return
        self.server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)

