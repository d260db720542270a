"""The router's side of resume, over scripted workers: a stream whose worker dies, stalls, drops it
(Overload) or refuses it for lack of KV blocks moves to another worker, and the caller sees one
contiguous stream. The scripted workers all replay the same ids, indexed by token index, as
real workers of one kind would (tests/component/test_resume_engine.py shows the engine does)."""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import TIME_FACTOR
from hybridgate.models import model_fingerprint
from hybridgate.router import ResourceExhaustedError, Router, RouterConfig, UnavailableError, WorkerRequestError
from hybridgate.wire import (
    EngineStats,
    FinishReason,
    Outputs,
    Overload,
    RequestError,
    SamplingParams,
    SeqOutput,
    WorkerState,
)
from scripted import ScriptedClient

pytestmark = pytest.mark.asyncio
SCRIPT = list(range(300, 316))  # 16 ids that decode to text
PARAMS = SamplingParams(max_tokens=len(SCRIPT), seed=5)


class Worker(ScriptedClient):
    """Replays SCRIPT from the request's first_token_index. `die_after`/`hang_after`/`overload_after`:
    after that many tokens of the first request it dies, goes silent (heartbeats go on: READY) or
    sends Overload; `refuse`: answers every ADD with a RequestError of that code."""

    def __init__(self, fp, name, *, hang_after=None, overload_after=None, refuse=None, **kw):
        super().__init__(fp, SCRIPT, **kw)
        self.endpoint = name
        self.hang_after, self.overload_after, self.refuse = hang_after, overload_after, refuse
        self.late: list[SeqOutput] = []

    async def _play(self, request) -> None:
        first = len(self.requests) == 1
        if self.refuse:
            self._on_message(self, RequestError(request.request_id, "needs more KV blocks than the cache holds",
                                                code=self.refuse))
            return
        for i in range(request.first_token_index, len(self.script)):
            await asyncio.sleep(0)
            n = i - request.first_token_index
            if first and self.die_after is not None and n >= self.die_after:
                self.late.append(SeqOutput(request.request_id, i, [self.script[i]]))
                self.lost("killed by signal SIGKILL")
                return
            if first and self.hang_after is not None and n >= self.hang_after:
                return
            if first and self.overload_after is not None and n >= self.overload_after:
                self._on_message(self, Overload([request.request_id], "send queue full"))
                return
            if request.request_id in self.aborted:
                return
            last = i == len(self.script) - 1
            out = SeqOutput(request.request_id, i, [self.script[i]], finish=int(self.finish) if last else 0)
            self._on_message(self, Outputs([out, out], self.stats))  # each twice: duplicates are dropped


async def collect(router, params=PARAMS):
    async with router.generate("x", params) as stream:
        return [d async for d in stream]


def assert_one_contiguous_stream(deltas, ids=SCRIPT):
    assert [t for d in deltas for t in d.token_ids] == ids
    assert [d.token_index for d in deltas] == [sum(len(e.token_ids) for e in deltas[:i]) for i in range(len(deltas))]
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [FinishReason.LENGTH]


@pytest.fixture
def fp(gguf_model):
    return model_fingerprint(gguf_model)


async def test_death_mid_stream_resumes_on_another_worker(gguf_model, fp):
    a, b = Worker(fp, "a", die_after=3), Worker(fp, "b", kind="cpu")
    async with Router(gguf_model, [a, b]) as router:
        deltas = await collect(router)
        assert_one_contiguous_stream(deltas)
        assert deltas[-1].route == "gpu (a), resumed at token 3 on cpu (b)"
        resumed = b.requests[0]
        first = a.requests[0]
        assert resumed.prompt_ids == first.prompt_ids + SCRIPT[:3] and resumed.first_token_index == 3
        assert (resumed.seed, resumed.max_tokens, resumed.params) == (first.seed, len(SCRIPT) - 3, first.params)
        assert resumed.request_id != first.request_id  # the old placement's late outputs are unknown
        for late in a.late:  # a late output of the dead placement changes nothing
            router._on_message(a, Outputs([late], a.stats))
        assert not router._streams


async def test_resume_off_ends_with_unavailable(gguf_model, fp):
    a, b = Worker(fp, "a", die_after=3), Worker(fp, "b")
    async with Router(gguf_model, [a, b], RouterConfig(resume_on_worker_loss=False)) as router:
        with pytest.raises(UnavailableError, match="worker a exited"):
            await collect(router)
        assert b.requests == []


async def test_the_same_worker_back_within_the_stall_timeout_takes_it(gguf_model, fp):
    a = Worker(fp, "a", die_after=4)
    async with Router(gguf_model, [a], RouterConfig(request_stall_timeout_s=5 * TIME_FACTOR)) as router:
        task = asyncio.create_task(collect(router))
        while a.state != WorkerState.DEAD:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert len(a.requests) == 1  # nowhere to go: it waits
        a.back()  # re-admitted: a HELLO of the same boot
        deltas = await asyncio.wait_for(task, 5 * TIME_FACTOR)
        assert_one_contiguous_stream(deltas)
        assert deltas[-1].route == "gpu (a), resumed at token 4 on gpu (a)" and a.requests[1].first_token_index == 4


async def test_waiting_past_the_stall_timeout_is_unavailable(gguf_model, fp):
    a = Worker(fp, "a", die_after=2)
    async with Router(gguf_model, [a], RouterConfig(request_stall_timeout_s=0.3)) as router:
        start = time.monotonic()
        with pytest.raises(UnavailableError, match="no progress for .* waiting for a worker"):
            await collect(router)
        # Ended by the 0.3 s stall timeout, not by a worker's (absent) answer: 1 s of slack, scaled.
        assert time.monotonic() - start < (0.3 + 1.0) * TIME_FACTOR


async def test_a_stalled_request_is_aborted_and_resumed_elsewhere(gguf_model, fp):
    a, b = Worker(fp, "a", hang_after=5), Worker(fp, "b")
    async with Router(gguf_model, [a, b], RouterConfig(request_stall_timeout_s=0.3)) as router:
        deltas = await collect(router)
        assert_one_contiguous_stream(deltas)
        assert a.aborted == [a.requests[0].request_id]
        assert b.requests[0].first_token_index == 5 and deltas[-1].route == "gpu (a), resumed at token 5 on gpu (b)"


async def test_overload_resumes_a_started_stream_and_re_places_a_new_one(gguf_model, fp):
    for after, how in ((6, "resumed"), (0, "retried")):
        a, b = Worker(fp, "a", overload_after=after), Worker(fp, "b")
        async with Router(gguf_model, [a, b]) as router:
            deltas = await collect(router)
            assert_one_contiguous_stream(deltas)
            assert b.requests[0].first_token_index == after
            assert deltas[-1].route == f"gpu (a), {how} at token {after} on gpu (b)"


async def test_no_kv_blocks_is_re_placed_until_every_worker_refused(gguf_model, fp):
    a, b = Worker(fp, "a", refuse="no_kv_blocks"), Worker(fp, "b", kind="cpu")
    async with Router(gguf_model, [a, b]) as router:
        deltas = await collect(router)
        assert_one_contiguous_stream(deltas)
        assert deltas[-1].route == "gpu (a), retried at token 0 on cpu (b)"
    a, b = Worker(fp, "a", refuse="no_kv_blocks"), Worker(fp, "b", refuse="resource_exhausted")
    async with Router(gguf_model, [a, b]) as router:
        with pytest.raises(ResourceExhaustedError, match="KV blocks"):
            await collect(router)
        assert len(a.requests) == len(b.requests) == 1  # each asked once
    a, b = Worker(fp, "a", refuse="internal"), Worker(fp, "b")
    async with Router(gguf_model, [a, b]) as router:
        with pytest.raises(WorkerRequestError):
            await collect(router)
        assert b.requests == []  # any other error is the answer


class SlowPrefill(Worker):
    """Reports prefill progress (empty outputs) for `chunks` x 0.1 s before its first token."""

    def __init__(self, fp, name, chunks, **kw):
        super().__init__(fp, name, **kw)
        self.chunks = chunks

    async def _play(self, request) -> None:
        for _ in range(self.chunks):
            await asyncio.sleep(0.1)
            self._on_message(self, Outputs([SeqOutput(request.request_id, 0, [])], self.stats))
        await super()._play(request)


async def test_prefill_progress_is_not_a_stall(gguf_model, fp):
    a, b = SlowPrefill(fp, "a", chunks=int(10 * TIME_FACTOR)), Worker(fp, "b")
    async with Router(gguf_model, [a, b], RouterConfig(request_stall_timeout_s=0.5 * TIME_FACTOR)) as router:
        deltas = await collect(router)  # prefill twice the timeout, each chunk well within it
        assert_one_contiguous_stream(deltas)
        assert deltas[-1].route == "gpu (a)" and b.requests == [] and a.aborted == []


def measured(worker, prefill_tokens_per_s: float, decode_step_s: float):
    """A scripted worker with a load report the cost policy can price."""
    worker.stats = EngineStats(blocks_total=1000, max_num_seqs=8, max_num_batched_tokens=512,
                               prefill_tokens_per_s={512: prefill_tokens_per_s}, decode_step_s={1: decode_step_s})
    return worker


async def test_a_resume_is_placed_by_the_cost_policy_not_by_the_fewest_in_flight(gguf_model, fp):
    # Only the GPU worker meets the default TTFT SLO, so it takes the request; once it is lost, neither CPU worker
    # meets it, and the one that finishes soonest takes the resume: c (10 ms steps), not b (50 ms), which the
    # fewest-in-flight rule would take (both idle, b first).
    a = measured(Worker(fp, "a", die_after=3), 10_000.0, 0.001)
    b = measured(Worker(fp, "b", kind="cpu"), 100.0, 0.05)
    c = measured(Worker(fp, "c", kind="cpu"), 100.0, 0.01)
    async with Router(gguf_model, [a, b, c]) as router:
        deltas = await collect(router)
        assert_one_contiguous_stream(deltas)
        assert deltas[-1].route == "gpu (a), resumed at token 3 on cpu (c)" and not b.requests


async def test_a_dropped_worker_leaves_nothing_in_the_placers_record(gguf_model, fp):
    a, b = Worker(fp, "a"), Worker(fp, "b", kind="cpu")
    async with Router(gguf_model, [a, b]) as router:
        async with router.generate("x", PARAMS) as stream:
            await stream.__anext__()
            assert router.placer.inflight(stream.client) == 1
            worker = stream.client
            await router.drop_client(worker, "left the registry")
            assert router.placer.inflight(worker) == 0 and worker not in router.placer._workers
            rest = [d async for d in stream]
        assert rest[-1].finish_reason == FinishReason.LENGTH
