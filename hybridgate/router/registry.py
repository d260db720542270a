"""Workers found in Redis: routers add the new ones, drop the expired ones, and refuse other models.

Workers write `hybridgate.security.redisconf.WorkerEntry` under `PREFIX:worker:ENDPOINT`
with a TTL they renew (`hybridgate.workers.registration`). A router polls the
keys every `poll_s` and reconciles its clients with them:

    entry                                  action
    -------------------------------------  ---------------------------------------------------------------
    new endpoint, this router's model      a `ZmqWorkerClient` joins the router (its lifecycle takes over)
    new endpoint, another model            refused: never connected, logged once per boot (both fingerprints)
    new endpoint, a sibling model          skipped quietly: another router of this gateway serves it
    known endpoint, new boot id            kept: the client's lifecycle sees the new boot in HELLO (new
                                           socket, old sequences reported lost); probed at once
    known endpoint, entry gone (TTL/exit)  dropped: its streams get WorkerDead (resumed elsewhere), client closed
    Redis unavailable                      nothing changes: the last known workers stay; logged once, `up` False

Several routers (gateways on several hosts) read the same keys, so they share
one worker pool; each connects its own DEALER, and outputs go back to the
identity that sent the request. Every Redis call is bounded by `timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from hybridgate.security.redisconf import RedisConfig, WorkerEntry, bounded, connect, redacted, redis_errors, worker_pattern
from hybridgate.security.keys import Transport
from hybridgate.clients.interface import WorkerClient
from hybridgate.router.client import ZmqWorkerClient
from hybridgate.router.config import RouterConfig

if TYPE_CHECKING:
    from hybridgate.router.owner import Members

log = logging.getLogger("hybridgate.router")
POLL_S = 0.25  # a new worker is used at most this long (plus its HELLO) after it registers


class RedisRegistry:
    """The router's view of the Redis worker registry; `Router(..., registry=RedisRegistry(cfg))` runs it.

    `make_client(entry)` builds the client of a new worker (default: a
    `ZmqWorkerClient` on `entry.endpoint`, named `entry.name`). `up` is
    whether the last call to Redis succeeded (None before the first).
    `siblings`: fingerprints of the models this gateway's other routers serve (several models behind
    one gateway, each router with its own registry): their workers are theirs, not refused here.
    """

    def __init__(self, config: RedisConfig, *, dead_after_s: float = RouterConfig.dead_after_s, poll_s: float = POLL_S,
                 make_client: Callable[[WorkerEntry], WorkerClient] | None = None, transport: Transport | None = None):
        if not config.url:
            raise ValueError("--redis-url: the registry needs a Redis URL")
        self.config, self.poll_s = config, poll_s
        self.make_client = make_client or (lambda e: ZmqWorkerClient(e.endpoint, dead_after_s=dead_after_s,
                                                                     name=e.name, transport=transport))
        self.transport = transport
        self.up: bool | None = None
        self.siblings: frozenset[str] = frozenset()
        self.known: dict[str, tuple[WorkerClient, WorkerEntry]] = {}  # by endpoint
        self._refused: set[tuple[str, str]] = set()  # (endpoint, boot id) logged once, while in Redis
        self._router: Members | None = None
        self._redis = None
        self._task: asyncio.Task | None = None

    async def start(self, router: Members) -> None:
        """First reconciliation now (so workers already registered are connecting on return), then polls."""
        self._router = router
        self._redis = connect(self.config)
        await self.poll()
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._redis is not None:
            try:
                await bounded(self._redis.aclose(), self.config.timeout_s)
            except redis_errors():
                pass

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.poll()
            except Exception:  # a bug here must not end discovery for the gateway's lifetime
                log.exception("worker registry: reconciling failed; trying again")

    async def poll(self) -> None:
        """Read every entry and reconcile; on a Redis failure keep the known workers."""
        try:
            entries = await bounded(self._read(), self.config.timeout_s)
        except redis_errors() as exc:
            if self.up is not False:
                log.warning("Redis at %s is unavailable (%s): keeping the %d known workers until it is back",
                            redacted(self.config.url), type(exc).__name__ or exc, len(self.known))
            self.up = False
            return
        if self.up is False:
            log.warning("Redis at %s is back", redacted(self.config.url))
        self.up = True
        await self._reconcile(entries)

    async def _read(self) -> dict[str, WorkerEntry]:
        keys = [k async for k in self._redis.scan_iter(match=worker_pattern(self.config.prefix), count=1000)]
        values = await self._redis.mget(keys) if keys else []
        entries = {}
        for key, value in zip(keys, values):
            if value is None:  # expired between SCAN and MGET
                continue
            try:
                entry = msgspec.json.decode(value, type=WorkerEntry)
            except msgspec.DecodeError as exc:
                log.warning("worker registry: ignoring %r: not a worker entry (%s)", key[:200], exc)
                continue
            entries[entry.endpoint] = entry
        return entries

    async def _reconcile(self, entries: dict[str, WorkerEntry]) -> None:
        router = self._router
        for endpoint, entry in entries.items():
            if entry.fingerprint != router.fingerprint:
                if entry.fingerprint not in self.siblings and (endpoint, entry.boot_id) not in self._refused:
                    self._refused.add((endpoint, entry.boot_id))
                    log.error("refusing worker %s (registry): it serves model fingerprint %s, but this router's "
                              "model has fingerprint %s%s", endpoint, entry.fingerprint, router.fingerprint,
                              f" (its model: {entry.model})" if entry.model else "")
                if endpoint in self.known:
                    await self._drop(endpoint, "now serves another model")
                continue
            known = self.known.get(endpoint)
            if known is None and self.transport is not None:
                try:
                    self.transport.check(endpoint, "worker (registry)")
                except ValueError as exc:
                    if (endpoint, entry.boot_id) not in self._refused:
                        self._refused.add((endpoint, entry.boot_id))
                        log.error("refusing worker %s: %s", endpoint, exc)
                    continue
            if known is None:
                client = self.make_client(entry)
                self.known[endpoint] = (client, entry)
                log.info("worker registry: %s worker %s joined (boot %s)", entry.kind, endpoint, entry.boot_id[:8])
                await router.add_client(client)
            elif known[1].boot_id != entry.boot_id:
                client = known[0]
                self.known[endpoint] = (client, entry)
                log.warning("worker registry: worker %s restarted (boot %s → %s)", endpoint, known[1].boot_id[:8],
                            entry.boot_id[:8])
                lifecycle = getattr(client, "lifecycle", None)
                if lifecycle is not None:
                    lifecycle.next_probe_at = 0.0  # probe at the next tick; HELLO brings the new boot
        for endpoint in [e for e in self.known if e not in entries]:
            await self._drop(endpoint, "its registry entry expired or was removed")
        # Only entries still in Redis are remembered, so the set is bounded by the registry itself
        # (a stream of refused boots, each expiring, used to grow it for the gateway's lifetime).
        self._refused &= {(endpoint, entry.boot_id) for endpoint, entry in entries.items()}

    async def _drop(self, endpoint: str, why: str) -> None:
        client, entry = self.known.pop(endpoint)
        log.warning("worker registry: dropping %s worker %s: %s", entry.kind, endpoint, why)
        await self._router.drop_client(client, f"worker {endpoint} left the registry ({why})")
