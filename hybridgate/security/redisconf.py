"""Redis settings shared by gateways (worker registry) and workers (registration), and the one way to connect.

    client = connect(settings.redis)          # a redis.asyncio.Redis with bounded timeouts
    await bounded(client.get("k"), settings.redis.timeout_s)
    log.info("registry at %s", redacted(settings.redis.url))   # never the password

The URL carries the password and TLS as Redis defines them
(`redis://:PASSWORD@HOST:6379/0`, `rediss://...` for TLS; redis-py's
`from_url`). It is a secret setting: `hybridgate config` shows only whether it
is set, and every log line goes through `redacted`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from hybridgate.config import check_settings, setting


def _check_url(value: str) -> None:
    if value and not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"must start with redis://, rediss:// (TLS) or unix://, got {redacted(value)!r}")


@dataclass(frozen=True)
class RedisConfig:
    """Where Redis is and how long anything may wait for it."""

    url: str = setting(
        "", "Redis URL (redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS): workers register in it and gateways "
            "(and serve) discover them there, and --response-cache redis keeps its answers there; empty: no "
            "registry (static --worker endpoints)", flag="--redis-url", secret=True,
        check=_check_url)
    timeout_s: float = setting(
        0.5, "seconds any one Redis call may take (connect, read, write) before it counts as failed; a hung Redis "
             "never stalls a request longer than this", flag="--redis-timeout", low=0, low_open=True, high=30)
    prefix: str = setting("hybridgate", "prefix of every Redis key this deployment uses (several deployments can "
                                        "share one Redis under different prefixes)", flag="--redis-prefix")
    registry_ttl_s: float = setting(
        3.0, "seconds a worker's registry entry lives without renewal (workers renew it every third of this); "
             "a worker killed outright is dropped by gateways within this time", flag="--registry-ttl",
        low=0.3, high=3600)

    def __repr__(self) -> str:  # the URL may hold a password
        return (f"RedisConfig(url={redacted(self.url)!r}, timeout_s={self.timeout_s}, prefix={self.prefix!r}, "
                f"registry_ttl_s={self.registry_ttl_s})")

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"prefix: must be non-empty without spaces, got {self.prefix!r}")


def redacted(url: str) -> str:
    """`url` with any password replaced by `***` (user names and hosts kept), for logs and errors."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable Redis URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def connect(config: RedisConfig) -> Any:
    """A `redis.asyncio.Redis` for `config.url` with every socket timeout at `timeout_s` and no retries
    (a retry would multiply the bound). `hiredis` is used by redis-py when installed.

    Raises ValueError (naming --redis-url, password redacted) when the URL does not parse.
    """
    import redis.asyncio as aioredis

    try:
        return aioredis.from_url(config.url, socket_timeout=config.timeout_s,
                                 socket_connect_timeout=config.timeout_s, retry_on_timeout=False,
                                 health_check_interval=0, decode_responses=False)
    except ValueError as exc:
        raise ValueError(f"--redis-url {redacted(config.url)}: {str(exc).replace(config.url, redacted(config.url))}") \
            from None


async def bounded(awaitable, timeout_s: float):
    """Await one Redis call for at most `timeout_s` (asyncio.TimeoutError past it), whatever the socket does."""
    return await asyncio.wait_for(awaitable, timeout_s)


def redis_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "Redis is unavailable now" (not a bug here): connection, timeout, OS errors."""
    import redis.exceptions as rexc

    return (rexc.RedisError, OSError, asyncio.TimeoutError)


# --- the worker registry's entries ----------------------------------------------------------------

class WorkerEntry(msgspec.Struct, frozen=True):
    """What a worker writes under `worker_key(prefix, endpoint)` (JSON, readable with redis-cli).

    `endpoint`: where routers connect (its advertised address); `handoff_endpoint`:
    its KV hand-off socket ("" = none); `fingerprint`: `models.model_fingerprint`
    (hex SHA-256); `capacity`: its max_num_seqs; `boot_id`: new on every start,
    so a restart under the same endpoint shows as a new entry; `model`: the served
    model's name (as in HELLO).
    """

    endpoint: str
    kind: str
    fingerprint: str
    capacity: int
    boot_id: str
    name: str = ""
    handoff_endpoint: str = ""
    model: str = ""


def worker_key(prefix: str, endpoint: str) -> str:
    return f"{prefix}:worker:{endpoint}"


def worker_pattern(prefix: str) -> str:
    return f"{prefix}:worker:*"
