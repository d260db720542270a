"""The response cache's parts without a worker: its key, what it takes, the memory LRU, the settings."""

from __future__ import annotations

import msgspec
import pytest

from hybridgate.router.response_cache import (
    CachedStream,
    MemoryStore,
    Piece,
    Record,
    ResponseCache,
    ResponseCacheConfig,
    cache_key,
    deterministic,
)
from hybridgate.wire import SamplingParams

FP = "ab" * 32
BASE = SamplingParams(temperature=0, max_tokens=16)


def _other(value, name: str):
    """A valid value of another field value, by its type (so a field added later is covered too)."""
    if name == "top_p":
        return 0.5
    if isinstance(value, bool):
        return not value
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, int):
        return value + 1
    if value is None:
        return 7
    if isinstance(value, tuple):
        return (*value, 7) if name == "stop_token_ids" else (*value, "x")
    raise AssertionError(f"SamplingParams.{name}: teach this test a second value of {type(value).__name__}")


@pytest.mark.parametrize("name", [f.name for f in msgspec.structs.fields(SamplingParams)])
def test_every_sampling_field_changes_the_key(name):
    base = cache_key(FP, [1, 2, 3], BASE, 16, "auto")
    changed = msgspec.structs.replace(BASE, **{name: _other(getattr(BASE, name), name)}).validate()
    max_tokens = changed.max_tokens if name == "max_tokens" else 16
    assert cache_key(FP, [1, 2, 3], changed, max_tokens, "auto") != base


def test_key_covers_model_prompt_route_and_resolved_length():
    base = cache_key(FP, [1, 2, 3], BASE, 16, "auto")
    assert cache_key(FP, [1, 2, 3], BASE, 16, "auto") == base  # stable
    assert cache_key("cd" * 32, [1, 2, 3], BASE, 16, "auto") != base
    assert cache_key(FP, [1, 2, 4], BASE, 16, "auto") != base
    assert cache_key(FP, [1, 2, 3], BASE, 16, "cpu") != base
    unset = SamplingParams(temperature=0)  # max_tokens resolved by the router: the resolved value is keyed
    assert cache_key(FP, [1, 2, 3], unset, 16, "auto") != cache_key(FP, [1, 2, 3], unset, 17, "auto")
    assert len(base) == 64 and int(base, 16) >= 0


def test_only_deterministic_requests_are_taken():
    assert deterministic(SamplingParams(temperature=0))
    assert deterministic(SamplingParams(temperature=0.8, seed=3))
    assert not deterministic(SamplingParams(temperature=0.8))
    assert not deterministic(SamplingParams())

    class Stream:  # only `params` is read to decide
        def __init__(self, params):
            self.params, self.request_id, self.plan = params, "r", "auto"

    cache = ResponseCache(MemoryStore(1 << 20, 60))
    sampled = Stream(SamplingParams(temperature=0.7))
    assert cache.wrap(sampled) is sampled
    assert isinstance(cache.wrap(Stream(SamplingParams(temperature=0.7, seed=1))), CachedStream)


async def test_memory_store_lru_by_bytes_and_ttl():
    now = [0.0]
    store = MemoryStore(max_bytes=250, ttl_s=10, clock=lambda: now[0])
    await store.put("a", b"x" * 100)
    await store.put("b", b"y" * 100)
    assert await store.get("a") == b"x" * 100  # a is now the most recently used
    await store.put("c", b"z" * 100)  # over 250 bytes: the least recently used (b) goes
    assert await store.get("b") is None and await store.get("a") is not None and store.bytes == 200
    await store.put("big", b"w" * 251)  # larger than the cap: never kept, nothing evicted for it
    assert await store.get("big") is None and store.bytes == 200
    now[0] = 10.0
    assert await store.get("a") is None and await store.get("c") is None and store.bytes == 0


def test_record_round_trip():
    record = Record([Piece(0, "Hi", [5]), Piece(1, "", [2])], 3, 10, 2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=Record) == record


def test_settings_flags_and_limits():
    from hybridgate.config import specs
    from hybridgate.settings import Settings

    by_path = {s.path: s for s in specs(Settings)}
    assert by_path["response_cache.mode"].flag == "--response-cache"
    assert by_path["response_cache.mode"].env == "HYBRIDGATE_RESPONSE_CACHE"
    assert by_path["response_cache.ttl_s"].flag == "--response-cache-ttl"
    assert by_path["response_cache.max_bytes"].flag == "--response-cache-max-bytes"
    assert ResponseCacheConfig().mode == "off"  # opt-in
    with pytest.raises(ValueError, match="mode"):
        ResponseCacheConfig(mode="disk")
    with pytest.raises(ValueError, match="redis-url"):
        ResponseCache.from_config(ResponseCacheConfig(mode="redis"))
    assert ResponseCache.from_config(ResponseCacheConfig()) is None


async def test_redis_store_written_count_stays_bounded_without_a_scrape(redis_server):
    """Every put forgets what expired and bins the rest, so nothing has to read `bytes` to keep memory bounded."""
    from hybridgate.security.redisconf import RedisConfig
    from hybridgate.router.response_cache import RedisStore

    now = [0.0]
    store = RedisStore(RedisConfig(url=redis_server.url), max_bytes=1 << 20, ttl_s=64, clock=lambda: now[0])
    try:
        for i in range(1000):  # 100 s of writes, 10 a second, against a TTL of 64 s
            now[0] = i / 10
            await store.put(f"k{i}", b"x" * 10)
            assert len(store._written) <= RedisStore.WRITTEN_BINS + 1
        unexpired = sum(10 for i in range(1000) if i / 10 + 64 > now[0])
        bin_s = 64 / RedisStore.WRITTEN_BINS  # a write leaves the count at most one bin late, never early
        assert unexpired <= store.bytes <= unexpired + 10 * (bin_s * 10 + 1)
        now[0] += 64 + bin_s
        assert store.bytes == 0 and not store._written
    finally:
        await store.close()
