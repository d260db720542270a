"""A worker's entry in the Redis registry: written once READY, renewed before its TTL runs out, deleted on exit.

The entry (`hybridgate.security.redisconf.WorkerEntry`, JSON) lives under
`PREFIX:worker:ENDPOINT` with a TTL of `registry_ttl_s` and is rewritten every
third of it, so a worker killed outright disappears from every gateway within
the TTL, and one that stops cleanly at once. The writes run on their own
thread with its own event loop (`redis.asyncio`), beside the I/O thread's
heartbeat; every call is bounded by `--redis-timeout`. Redis being away is
logged once (and once more when it is back); the worker serves on meanwhile,
since gateways keep the workers they already know.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import msgspec

from hybridgate.security.redisconf import RedisConfig, WorkerEntry, bounded, connect, redacted, redis_errors, worker_key
from hybridgate.workers.threads import worker_thread

log = logging.getLogger("hybridgate.worker")

_DELETE_IF_OURS = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def advertised_endpoint(endpoint: str, advertise: str) -> str:
    """Where routers reach this worker: `advertise` when given, else for `tcp://ADDR:PORT` the host
    name and the bound port (`tcp://HOSTNAME:PORT`, as other hosts and containers resolve it), else
    the bound endpoint itself (ipc:// is reachable only on this host)."""
    if advertise:
        return advertise
    if endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[1]
        return f"tcp://{socket.gethostname()}:{port}"
    return endpoint


_ANY_INTERFACE = ("0.0.0.0", "*", "[::]", "::")


def advertised_handoff_endpoint(handoff: str, advertised: str) -> str:
    """Where GPU workers on other hosts reach this CPU worker's hand-off socket, bound at `handoff`: the
    bound endpoint itself, unless it binds every interface (`tcp://0.0.0.0:PORT`, `tcp://*:PORT`,
    `tcp://[::]:PORT`); then the host of `advertised` (this worker's advertised request endpoint, see
    `advertised_endpoint`) with the hand-off's port, so both sockets are reached under one address."""
    if not handoff.startswith("tcp://"):
        return handoff
    host, port = handoff.removeprefix("tcp://").rsplit(":", 1)
    if host not in _ANY_INTERFACE:
        return handoff
    return f"tcp://{advertised.removeprefix('tcp://').rsplit(':', 1)[0]}:{port}"


class Registration:
    """Keeps `entry` in Redis while the worker runs: `start()` after READY, `stop()` before exit."""

    def __init__(self, config: RedisConfig, entry: WorkerEntry):
        self.config, self.entry = config, entry
        self.key = worker_key(config.prefix, entry.endpoint)
        self.period_s = config.registry_ttl_s / 3
        self.renewals = 0  # successful writes, for tests and logs
        self._stopping = threading.Event()
        self._thread = worker_thread(self._run, "worker-registry", "registration thread", self._stopping)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Delete the entry (best effort, bounded) and end the thread."""
        self._stopping.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        client = connect(self.config)
        value = msgspec.json.encode(self.entry)
        ttl_ms = int(self.config.registry_ttl_s * 1000)
        up: bool | None = None
        timeout = self.config.timeout_s
        try:
            while not self._stopping.is_set():
                try:
                    await bounded(client.set(self.key, value, px=ttl_ms), timeout)
                    self.renewals += 1
                    if up is not True:
                        log.info("registered as %s in Redis at %s (ttl %g s)", self.entry.endpoint,
                                 redacted(self.config.url), self.config.registry_ttl_s)
                    up = True
                except redis_errors() as exc:
                    if up is not False:
                        log.warning("Redis at %s is unavailable (%s); serving on, registering again when it is back",
                                    redacted(self.config.url), type(exc).__name__)
                    up = False
                await asyncio.to_thread(self._stopping.wait, self.period_s)
            try:  # only our own entry: a successor on the same endpoint may have written its own
                await bounded(client.eval(_DELETE_IF_OURS, 1, self.key, value), timeout)
            except redis_errors():
                pass  # the TTL removes it
        finally:
            try:
                await bounded(client.aclose(), timeout)
            except redis_errors():
                pass
