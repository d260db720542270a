"""Redis settings: the password never shows; the worker's advertised endpoint; a registry through an outage."""

from __future__ import annotations

import asyncio
import socket

import msgspec
import pytest

from hybridgate.cli import build_parser
from hybridgate.config import report, resolve
from hybridgate.security.redisconf import RedisConfig, WorkerEntry, redacted, worker_key
from hybridgate.workers.registration import advertised_endpoint, advertised_handoff_endpoint
from tests.conftest import TIME_FACTOR


def test_the_password_is_redacted_everywhere():
    url = "rediss://alice:s3cret@cache.example:6380/2"
    assert redacted(url) == "rediss://alice:***@cache.example:6380/2"
    assert redacted("redis://:pw@h/0") == "redis://:***@h/0"
    assert redacted("redis://h:1/0") == "redis://h:1/0"
    assert "s3cret" not in repr(RedisConfig(url=url))
    resolved = resolve(build_parser().parse_args(["gateway", "--redis-url", url]))
    assert resolved.settings.redis.url == url and "s3cret" not in report(resolved)
    with pytest.raises(ValueError, match=r"must start with redis://.*'http://u:\*\*\*@h'"):
        RedisConfig(url="http://u:pw@h")


def test_advertised_endpoint_defaults_to_the_host_name_and_bound_port():
    assert advertised_endpoint("tcp://0.0.0.0:5555", "") == f"tcp://{socket.gethostname()}:5555"
    assert advertised_endpoint("tcp://0.0.0.0:5555", "tcp://w1:6000") == "tcp://w1:6000"
    assert advertised_endpoint("ipc:///run/w.sock", "") == "ipc:///run/w.sock"


def test_a_handoff_socket_on_every_interface_is_advertised_under_the_workers_host():
    assert advertised_handoff_endpoint("tcp://0.0.0.0:5556", "tcp://10.1.2.3:5555") == "tcp://10.1.2.3:5556"
    assert advertised_handoff_endpoint("tcp://*:5556", "tcp://cpu-worker-1:5555") == "tcp://cpu-worker-1:5556"
    assert advertised_handoff_endpoint("tcp://[::]:5556", "tcp://[fd00::7]:5555") == "tcp://[fd00::7]:5556"
    assert advertised_handoff_endpoint("tcp://10.9.9.9:5556", "tcp://10.1.2.3:5555") == "tcp://10.9.9.9:5556"
    assert advertised_handoff_endpoint("ipc:///run/w.handoff", "ipc:///run/w") == "ipc:///run/w.handoff"
    assert advertised_handoff_endpoint("", "tcp://10.1.2.3:5555") == ""


class _FakeRouter:
    fingerprint = "f" * 64

    def __init__(self):
        self.added, self.dropped = [], []

    async def add_client(self, client):
        self.added.append(client)

    async def drop_client(self, client, reason):
        self.dropped.append(client)


async def test_registry_keeps_its_workers_through_an_outage_and_drops_expired_ones(redis_server):
    from hybridgate.router.registry import RedisRegistry

    cfg = RedisConfig(url=redis_server.url, timeout_s=0.2)
    entry = WorkerEntry(endpoint="tcp://w:1", kind="cpu", fingerprint="f" * 64, capacity=8, boot_id="b1")
    redis = redis_server.client()
    redis.set(worker_key(cfg.prefix, entry.endpoint), msgspec.json.encode(entry), px=60_000)
    router = _FakeRouter()
    registry = RedisRegistry(cfg, make_client=lambda e: e.endpoint, poll_s=3600)
    await registry.start(router)
    try:
        assert router.added == ["tcp://w:1"] and registry.up is True
        redis_server.stop()
        start = asyncio.get_running_loop().time()
        await registry.poll()
        # Bounded by timeout_s (0.2 s), not the OS's connect retries (seconds): 5x the bound, scaled for a
        # loaded machine, still tells the two apart.
        assert asyncio.get_running_loop().time() - start < 1.0 * TIME_FACTOR
        assert registry.up is False and router.dropped == []  # the last known worker stays
        redis_server.start()
        await registry.poll()  # the restarted Redis is empty: the entry is gone
        assert registry.up is True and router.dropped == ["tcp://w:1"]
    finally:
        await registry.close()


async def test_the_refused_workers_are_remembered_only_while_in_the_registry():
    """Each refused boot was kept for the gateway's lifetime: a crash-looping worker of another
    model (a new boot id every start) grew the set without end."""
    from hybridgate.router.registry import RedisRegistry

    registry = RedisRegistry(RedisConfig(url="redis://127.0.0.1:1"), make_client=lambda e: e.endpoint)
    registry._router = router = _FakeRouter()
    for boot in range(100):
        other = WorkerEntry(endpoint="tcp://w:1", kind="cpu", fingerprint="0" * 64, capacity=8, boot_id=str(boot))
        await registry._reconcile({other.endpoint: other})
        assert len(registry._refused) == 1
    await registry._reconcile({})
    assert registry._refused == set() and router.added == []
