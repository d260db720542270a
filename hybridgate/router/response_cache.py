"""The streaming response cache, with single-flight (DESIGN.md, "Configuration, registry, response cache").

    cache = ResponseCache.from_config(settings.response_cache, settings.redis)   # None when off
    router = Router(model, workers, response_cache=cache)
    async with router.generate(chat, SamplingParams(temperature=0, max_tokens=64)) as stream: ...

What is cached: the answer of a deterministic request (temperature 0, or any
request with a seed), which the same model gives again for the same ids and
fields. Sampled requests without a seed are never cached: two runs differ by
design. The key is a SHA-256 over the model fingerprint, the prompt ids, every
field of `SamplingParams` (taken from the msgspec struct, so a field added
later is in the key without an edit here; `max_tokens` as resolved) and the
route asked for. The record holds each streamed message (token index, text,
ids), the finish reason and the token counts; a hit replays it message by
message, with `usage.cached_tokens` equal to the prompt tokens and route
`cache`. A hit returns the answer first generated for its key, whichever worker
kind generated it (a CPU worker's greedy text may differ from a GPU worker's in
late tokens). Only complete answers (stop, length, eos) are stored.

Single-flight: identical deterministic requests in flight in one router share
one generation (a `Flight`). Each request, the first one included, is a member
reading the flight's messages as they arrive; a member that leaves (cancel,
break, error) leaves only itself, and the generation is aborted on its worker
when the last member leaves.

Stores: `MemoryStore`, an in-process LRU bounded by bytes, and `RedisStore`,
shared by every gateway on one Redis, entries under `PREFIX:response:KEY` with
the TTL. A Redis call that fails (down, hung past `--redis-timeout`) marks
Redis down, logged once per outage: requests skip the cache (served all the
same, a hung Redis costs one request one timeout) while a probe pings every
`RETRY_S`, and the cache is used again once a ping succeeds.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import time
from typing import TYPE_CHECKING

import msgspec

from hybridgate.security.redisconf import RedisConfig, bounded, connect, redacted, redis_errors
from hybridgate.router.config import ResponseCacheConfig
from hybridgate.router.errors import UnavailableError
from hybridgate.router.deltas import Delta, Timings, Usage
from hybridgate.wire import FinishReason, SamplingParams

if TYPE_CHECKING:
    from hybridgate.router.stream import GenerationStream

log = logging.getLogger("hybridgate.router")

KEY_VERSION = 1  # bump when the record or key layout changes, so old Redis entries are never read
RETRY_S = 0.5  # while Redis is down, it is probed this often; requests meanwhile skip it


def deterministic(params: SamplingParams) -> bool:
    """Whether the same ids and fields give the same answer again: greedy, or seeded noise."""
    return params.temperature == 0 or params.seed is not None


def cache_key(fingerprint: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
              route: str) -> str:
    """Hex SHA-256 over the model fingerprint, the prompt ids, every `SamplingParams` field (max_tokens as
    resolved: unset means a length that depends on the prompt and the model) and the route."""
    fields = msgspec.structs.asdict(params)
    fields["max_tokens"] = max_tokens
    payload = msgspec.msgpack.encode([KEY_VERSION, fingerprint, prompt_ids, sorted(fields.items()), route])
    return hashlib.sha256(payload).hexdigest()


class Piece(msgspec.Struct, array_like=True, frozen=True):
    """One streamed message of a cached answer."""

    token_index: int
    text: str
    token_ids: list[int]


class Record(msgspec.Struct, array_like=True, frozen=True):
    """A cached answer: its messages in order, then how it ended (`FinishReason` value) and its token counts."""

    pieces: list[Piece]
    finish_reason: int
    prompt_tokens: int
    completion_tokens: int


class MemoryStore:
    """An in-process LRU of encoded records, at most `max_bytes` (an entry larger is not kept), each for `ttl_s`."""

    up = None  # no Redis here

    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic):
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self._entries: collections.OrderedDict[str, tuple[float, bytes]] = collections.OrderedDict()
        self.bytes = 0

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= self.clock():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry[1]

    async def put(self, key: str, blob: bytes) -> None:
        if len(blob) > self.max_bytes:
            return
        if key in self._entries:
            self._remove(key)
        self._entries[key] = (self.clock() + self.ttl_s, blob)
        self.bytes += len(blob)
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))

    def _remove(self, key: str) -> None:
        self.bytes -= len(self._entries.pop(key)[1])

    async def close(self) -> None:
        pass


class RedisStore:
    """Records in Redis under `PREFIX:response:KEY` with a TTL; every call bounded by `--redis-timeout`.

    `up`: whether the last call succeeded (None before the first). `bytes`:
    what this gateway wrote that has not expired yet (Redis holds what other
    gateways wrote too), counted in `WRITTEN_BINS` bins of expiry times per
    TTL: a write's bytes leave the count at most ttl/WRITTEN_BINS late, and the
    count's memory stays at most WRITTEN_BINS + 1 entries whatever the write rate
    and whether or not anything reads `bytes`.
    """

    WRITTEN_BINS = 64

    def __init__(self, redis: RedisConfig, max_bytes: int, ttl_s: float, clock=time.monotonic):
        if not redis.url:
            raise ValueError("--response-cache redis: needs --redis-url, a setting of `hybridgate gateway` (under "
                             "`serve`, use --response-cache memory)")
        self.redis, self.max_bytes, self.ttl_s, self.clock = redis, max_bytes, ttl_s, clock
        self.up: bool | None = None
        self._client = connect(redis)
        self._probe: asyncio.Task | None = None
        self._written: collections.deque[tuple[float, int]] = collections.deque()  # (expires, bytes)
        self._written_bytes = 0

    @property
    def bytes(self) -> int:
        self._forget_expired()
        return self._written_bytes

    def _forget_expired(self) -> None:
        now = self.clock()
        while self._written and self._written[0][0] <= now:
            self._written_bytes -= self._written.popleft()[1]

    def _count_written(self, size: int) -> None:
        """Adds a write's bytes to the bin of its expiry (rounded up to a bin's edge, so never early)."""
        self._forget_expired()
        width = self.ttl_s / self.WRITTEN_BINS
        expires = math.ceil((self.clock() + self.ttl_s) / width) * width
        if self._written and self._written[-1][0] >= expires:
            self._written[-1] = (self._written[-1][0], self._written[-1][1] + size)
        else:
            self._written.append((expires, size))
        self._written_bytes += size

    def _key(self, key: str) -> str:
        return f"{self.redis.prefix}:response:{key}"

    async def get(self, key: str) -> bytes | None:
        return await self._call(self._client.get(self._key(key)))

    async def put(self, key: str, blob: bytes) -> None:
        if len(blob) > self.max_bytes:
            return
        if await self._call(self._client.set(self._key(key), blob, px=max(1, int(self.ttl_s * 1e3)))):
            self._count_written(len(blob))

    async def _call(self, call):
        """One bounded Redis call; None when it failed, or while Redis is down (a probe watches for its return)."""
        if self.up is False:
            call.close()  # never awaited: no request waits on a Redis known to be down
            return None
        try:
            return await bounded(call, self.redis.timeout_s)
        except redis_errors() as exc:
            if self.up is not False:  # the first failure of an outage (calls in flight together fail together)
                log.warning("response cache: Redis at %s is unavailable (%s); serving without the cache until it "
                            "is back", redacted(self.redis.url), type(exc).__name__)
                self.up = False
                self._probe = asyncio.get_running_loop().create_task(self._wait_until_back())
            return None
        finally:
            if self.up is None:
                self.up = True

    async def _wait_until_back(self) -> None:
        while True:
            await asyncio.sleep(RETRY_S)
            try:
                await bounded(self._client.ping(), self.redis.timeout_s)
            except redis_errors():
                continue
            log.warning("response cache: Redis at %s is back", redacted(self.redis.url))
            self.up = True
            return

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        try:
            await bounded(self._client.aclose(), self.redis.timeout_s)
        except redis_errors():
            pass


class ResponseCache:
    """The router's cache and its flights; counters `hits`, `misses`, `coalesced` (requests that joined a
    generation in flight); `store.bytes` is what it holds."""

    def __init__(self, store: MemoryStore | RedisStore):
        self.store = store
        self.hits = self.misses = self.coalesced = 0
        self.flights: dict[str, Flight] = {}
        self._writes: set[asyncio.Task] = set()

    @classmethod
    def from_config(cls, config: ResponseCacheConfig, redis: RedisConfig | None = None) -> ResponseCache | None:
        """None when `config.mode` is off. Raises ValueError naming --redis-url for redis without a URL."""
        if config.mode == "off":
            return None
        if config.mode == "memory":
            return cls(MemoryStore(config.max_bytes, config.ttl_s))
        return cls(RedisStore(redis or RedisConfig(), config.max_bytes, config.ttl_s))

    @property
    def up(self) -> bool | None:
        return self.store.up

    def wrap(self, stream: GenerationStream) -> GenerationStream | CachedStream:
        """`stream` itself when its request is not deterministic (or asks for logprobs, which records do not
        hold), else a `CachedStream` around it."""
        cacheable = deterministic(stream.params) and stream.params.logprobs is None
        return CachedStream(self, stream) if cacheable else stream

    def finished(self, flight: Flight) -> None:
        """A flight ended: a complete answer is stored (joiners meanwhile replay it), anything else forgotten."""
        if flight.record is None:
            if self.flights.get(flight.key) is flight:
                del self.flights[flight.key]
            return
        task = asyncio.get_running_loop().create_task(self._store(flight))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _store(self, flight: Flight) -> None:
        try:
            await self.store.put(flight.key, msgspec.msgpack.encode(flight.record))
        finally:
            if self.flights.get(flight.key) is flight:
                del self.flights[flight.key]

    async def close(self) -> None:
        flights = list(self.flights.values())
        for flight in flights:
            flight.cancel()
        await asyncio.gather(*self._writes, *(f.task for f in flights if f.task is not None), return_exceptions=True)
        await self.store.close()


class Flight:
    """One generation shared by its members: `deltas` grows as the worker streams; `record` once complete."""

    def __init__(self, cache: ResponseCache, key: str, inner: GenerationStream):
        self.cache, self.key, self.inner = cache, key, inner
        self.deltas: list[Delta] = []
        self.error: BaseException | None = None
        self.record: Record | None = None
        self.done = False
        self.members = 0
        self.task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        """Send the request (errors on entry, such as no READY worker, raise here), then pump its deltas."""
        await self.inner.__aenter__()
        self.task = asyncio.get_running_loop().create_task(self._pump())
        # A callback, not a `finally`: a task cancelled before its first step never runs its body.
        self.task.add_done_callback(self._ended)

    async def _pump(self) -> None:
        try:
            async for delta in self.inner:
                self.deltas.append(delta)
                self._notify()
        except Exception as exc:  # the members raise it; the pump itself ends quietly
            self.error = exc
            return
        last = self.deltas[-1] if self.deltas else None
        if last is not None and last.finish_reason not in (None, FinishReason.ABORT):
            self.record = Record([Piece(d.token_index, d.text, d.token_ids) for d in self.deltas],
                                 int(last.finish_reason), last.usage.prompt_tokens, last.usage.completion_tokens)

    def _ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self.error = UnavailableError("the shared generation was aborted")
        self.inner.leave()  # aborts the request on its worker if it is unfinished
        self.done = True
        self._notify()
        self.cache.finished(self)

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def wait(self) -> None:
        """Until the next delta, the end, or an error."""
        await self._wake.wait()

    def leave(self) -> None:
        self.members -= 1
        if self.members == 0 and not self.done:
            self.cancel()

    def cancel(self) -> None:
        if self.cache.flights.get(self.key) is self:
            del self.cache.flights[self.key]  # a new identical request starts afresh, never joins an aborted one
        if self.task is not None:
            self.task.cancel()


class CachedStream:
    """What `Router.generate` returns for a deterministic request when the cache is on: the same interface
    as `GenerationStream` (async context manager, async iterator of `Delta`, `request_id`, `prompt_ids`,
    `ids`, `plan`, `placement`, `client`).

    On entry it is one of: a replay of a stored answer (`plan` "cache"), the
    first member of a new flight (the request is sent; `plan` and `placement`
    are the policy's), or a later member of a flight in progress (`plan`
    "coalesced"; its final message's route ends with ", shared").
    """

    def __init__(self, cache: ResponseCache, inner: GenerationStream):
        self.cache, self.inner = cache, inner
        self.request_id, self.plan, self.placement = inner.request_id, inner.plan, None
        self.prompt_ids: list[int] = []
        self.ids: list[int] = []
        self._replay: Record | None = None
        self._flight: Flight | None = None
        self._served_by: GenerationStream | None = None
        self._leader = False
        self._pos = 0
        self._finished = False
        self._arrival = self._first = 0.0

    @property
    def client(self):
        """The worker client of the shared generation (None for a replay)."""
        return self._served_by.client if self._served_by is not None else None

    async def __aenter__(self) -> CachedStream:
        self._arrival = time.monotonic()
        inner = self.inner
        await inner.prepare()
        self.prompt_ids = inner.prompt_ids
        key = cache_key(inner.router.fingerprint, inner.prompt_ids, inner.params, inner.max_tokens, inner.plan)
        flight = self.cache.flights.get(key)
        if flight is None:
            record = self._decode(await self.cache.store.get(key))
            if record is not None:
                return self._hit(record)
            flight = self.cache.flights.get(key)  # started by another request during the lookup
        if flight is not None and flight.record is not None:  # complete, being stored
            return self._hit(flight.record)
        if flight is None:
            flight = Flight(self.cache, key, inner)
            self.cache.flights[key] = flight
            try:
                await flight.start()
            except BaseException:
                flight.cancel()
                raise
            self.cache.misses += 1
            self._leader, self.placement = True, inner.placement
        else:
            self.cache.coalesced += 1
            self.plan = "coalesced"
        flight.members += 1
        self._flight, self._served_by = flight, flight.inner
        return self

    async def __aexit__(self, *exc) -> None:
        if self._flight is not None:
            self._flight.leave()
            self._flight = None

    def _hit(self, record: Record) -> CachedStream:
        self.cache.hits += 1
        self._replay, self.plan = record, "cache"
        return self

    @staticmethod
    def _decode(blob: bytes | None) -> Record | None:
        if blob is None:
            return None
        try:
            return msgspec.msgpack.decode(blob, type=Record)
        except msgspec.DecodeError:
            log.warning("response cache: dropping an entry that does not decode as a record")
            return None

    def __aiter__(self) -> CachedStream:
        return self

    async def __anext__(self) -> Delta:
        if self._finished:
            raise StopAsyncIteration
        delta = self._next_replayed() if self._replay is not None else await self._next_shared()
        self.ids += delta.token_ids
        if not self._first:
            self._first = time.monotonic()
        if delta.finish_reason is not None:
            self._finished = True
            delta = self._final(delta)
        return delta

    def _next_replayed(self) -> Delta:
        record, k = self._replay, self._pos
        self._pos += 1
        piece = record.pieces[k]
        if k < len(record.pieces) - 1:
            return Delta(self.request_id, piece.token_index, piece.text, piece.token_ids)
        return Delta(self.request_id, piece.token_index, piece.text, piece.token_ids,
                     FinishReason(record.finish_reason),
                     Usage(record.prompt_tokens, record.completion_tokens, record.prompt_tokens), route="cache")

    async def _next_shared(self) -> Delta:
        flight = self._flight
        while self._pos >= len(flight.deltas):
            if flight.error is not None:
                self._finished = True
                raise flight.error
            if flight.done:
                self._finished = True
                raise UnavailableError("the shared generation ended without a final message")
            await flight.wait()
        delta = flight.deltas[self._pos]
        self._pos += 1
        return msgspec.structs.replace(delta, request_id=self.request_id)

    def _final(self, delta: Delta) -> Delta:
        """This request's own timings (arrival to its first and last message); a member's route says so."""
        now = time.monotonic()
        queue_ms = delta.timings.queue_ms if delta.timings is not None else 0.0
        timings = Timings(queue_ms, (self._first - self._arrival) * 1e3, (now - self._arrival) * 1e3)
        route = delta.route if self._replay is not None or self._leader else f"{delta.route}, shared"
        return msgspec.structs.replace(delta, timings=timings, route=route)
