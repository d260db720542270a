"""The Router over a real in-process engine (torch runner, fp32 CPU) and over scripted workers."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import pytest_asyncio
import torch

from conftest import TIME_FACTOR, golden_json
from hybridgate.models import model_fingerprint
from hybridgate.router import (
    DeadlineExceededError,
    FingerprintMismatchError,
    InvalidRequestError,
    ResourceExhaustedError,
    Router,
    RouterConfig,
    UnavailableError,
    WorkerRequestError,
)
from hybridgate.wire import EngineStats, FinishReason, Overload, RequestError, SamplingParams
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.inprocess import InProcessClient
from scripted import ScriptedClient

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("one_torch_thread")]
GREEDY = golden_json("greedy.json")
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def runner(gguf_model):
    return TorchRunner(gguf_model, torch.device("cpu"), torch.float32)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(gguf_model, runner):
    async with Router(gguf_model, [InProcessClient(runner, model_fingerprint(gguf_model))]) as r:
        yield r


async def collect(router, prompt, params):
    async with router.generate(prompt, params) as stream:
        return [d async for d in stream]


async def idle(router, timeout=10.0):
    client = router.clients[0]
    for _ in range(int(timeout * TIME_FACTOR / 0.01)):
        if not client.engine.has_work() and client.inbox.requests.empty():
            return client.engine.refresh_stats()
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not go idle")


async def test_france_greedy_matches_reference(router):
    deltas = await collect(router, FRANCE, SamplingParams(temperature=0, max_tokens=32))
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == GREEDY["france"]["ids"]
    assert "".join(d.text for d in deltas) == "The capital of France is Paris."
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [FinishReason.EOS]
    last = deltas[-1]
    assert last.usage.completion_tokens == 8 and last.usage.prompt_tokens == len(GREEDY["france"]["prompt_ids"])
    assert last.route == "gpu (inproc)" and last.timings.ttft_ms <= last.timings.total_ms


@pytest.mark.parametrize("question", ["Translate 'good morning' into Japanese.", "Say 'thank you' in Chinese, Russian and Greek."])
async def test_streamed_text_equals_reference_decode(router, tokenizer, question):
    deltas = await collect(router, [{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=32))
    ids = [t for d in deltas for t in d.token_ids]
    assert deltas[-1].finish_reason == FinishReason.LENGTH and len(ids) == 32
    text = "".join(d.text for d in deltas)
    assert text == tokenizer.decode(ids)
    assert any(ord(c) > 127 for c in text)
    if question.startswith("Translate"):
        assert text.endswith("\ufffd")  # the 32nd token ends inside a character: flushed as U+FFFD
        assert all("\ufffd" not in d.text for d in deltas[:-1])


async def test_special_tokens_are_skipped_in_text_unless_asked(router, tokenizer):
    # Greedy past EOS: the answer's 8 ids end with <|im_end|> (id 2), and generation goes on.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids_of = lambda deltas: [t for d in deltas for t in d.token_ids]  # noqa: E731
    skipped = await collect(router, FRANCE, params)
    kept = await collect(router, FRANCE, msgspec.structs.replace(params, skip_special_tokens=False))
    assert ids_of(skipped) == ids_of(kept) and ids_of(kept)[:8] == GREEDY["france"]["ids"]
    assert tokenizer.eos_token_id == 2 and 2 in ids_of(skipped)
    text, raw = "".join(d.text for d in skipped), "".join(d.text for d in kept)
    assert "<|im_end|>" not in text and text == tokenizer.decode(ids_of(skipped), skip_special_tokens=True)
    assert "<|im_end|>" in raw and raw == tokenizer.decode(ids_of(kept))


@pytest.mark.parametrize("n", [1, 2, 17])
async def test_max_tokens_counts_exactly(router, n):
    deltas = await collect(router, "Hello", SamplingParams(max_tokens=n, ignore_eos=True, seed=n))
    assert sum(len(d.token_ids) for d in deltas) == n == deltas[-1].usage.completion_tokens
    assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == FinishReason.LENGTH


async def test_break_aborts_within_one_step_and_frees_kv(router):
    before = (await idle(router)).tokens_after_abort
    async with router.generate("Once upon a time", SamplingParams(max_tokens=500, ignore_eos=True)) as stream:
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                break
    stats = await idle(router)
    assert stats.tokens_after_abort - before <= 1
    assert stats.kv_cache_bytes == 0 and stats.running == 0


async def test_leaving_the_block_while_holding_the_stream(router):
    async with router.generate("Once upon a time", SamplingParams(max_tokens=500, ignore_eos=True)) as stream:
        await stream.__anext__()
        held = stream
    assert held.finished
    stats = await idle(router)
    assert stats.kv_cache_bytes == 0 and stats.running == 0
    with pytest.raises(StopAsyncIteration):
        await held.__anext__()


async def test_batch_of_eight_equals_solo_and_seeded_sampling_is_batch_independent(router):
    prompts = [f"Write a sentence about the number {i}." for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    solo = [await collect(router, p, greedy) for p in prompts]
    steps_before = dict(router.clients[0].stats.batch_size_counts)
    together = await asyncio.gather(*(collect(router, p, greedy) for p in prompts))
    ids = lambda ds: [t for d in ds for t in d.token_ids]  # noqa: E731
    assert [ids(d) for d in together] == [ids(d) for d in solo]
    steps = router.clients[0].stats.batch_size_counts
    assert steps.get(8, 0) > steps_before.get(8, 0)

    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = ids(await collect(router, prompts[0], seeded))
    others = [collect(router, p, SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True)) for p in prompts[1:]]
    among = await asyncio.gather(collect(router, prompts[0], seeded), *others)
    assert ids(among[0]) == alone


async def test_new_request_gets_first_token_while_a_long_one_runs(router):
    long_done, short_first = asyncio.Event(), []

    async def long():
        await collect(router, "Tell me a story.", SamplingParams(max_tokens=64, ignore_eos=True))
        long_done.set()

    task = asyncio.create_task(long())
    await asyncio.sleep(0.3 * TIME_FACTOR)
    async with router.generate("Hi", SamplingParams(max_tokens=4, ignore_eos=True)) as stream:
        async for _ in stream:
            short_first.append(long_done.is_set())
    await task
    assert short_first[0] is False


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "messages"),
        ([{"role": "wizard", "content": "hi"}], SamplingParams(), "role"),
        ("x" * ((1 << 20) + 1), SamplingParams(), "prompt"),
        ("hi", SamplingParams(temperature=-1), "temperature"),
        ("hi", SamplingParams(max_tokens=9000), "max_tokens"),
    ],
)
async def test_invalid_requests_name_the_field(router, prompt, params, field):
    with pytest.raises(InvalidRequestError, match=field):
        async with router.generate(prompt, params) as stream:
            [d async for d in stream]


async def test_prompt_longer_than_the_model_names_both_counts(router):
    with pytest.raises(InvalidRequestError, match=r"prompt: (\d+) tokens, but the max model length is 8192"):
        async with router.generate("hello " * 9000) as stream:
            [d async for d in stream]


async def test_fingerprint_mismatch_names_both(gguf_model, runner):
    with pytest.raises(FingerprintMismatchError) as info:
        async with Router(gguf_model, [InProcessClient(runner, "0" * 64)]):
            pass
    assert "0" * 64 in str(info.value) and model_fingerprint(gguf_model) in str(info.value)


# --- scripted workers: stop strings split every way, worker death --------------------------------


def split_ids(tokenizer, text: str, cuts: tuple[int, ...]) -> list[int]:
    bounds = [0, *cuts, len(text)]
    return [t for a, b in zip(bounds, bounds[1:]) for t in tokenizer.encode(text[a:b])]


async def test_stop_string_cut_every_way(gguf_model, tokenizer):
    import itertools

    fp = model_fingerprint(gguf_model)
    before, stop, after = "The city is ", "Paris", " and more text"
    for r in range(len(stop)):
        for cuts in itertools.combinations(range(1, len(stop)), r):
            script = tokenizer.encode(before) + split_ids(tokenizer, stop, cuts) + tokenizer.encode(after)
            client = ScriptedClient(fp, script)
            async with Router(gguf_model, [client]) as router:
                deltas = await collect(router, "x", SamplingParams(stop=("Paris",), max_tokens=50))
            text = "".join(d.text for d in deltas)
            n_ids = sum(len(d.token_ids) for d in deltas)
            assert text == before and deltas[-1].finish_reason == FinishReason.STOP, cuts
            assert n_ids == len(tokenizer.encode(before)) + len(split_ids(tokenizer, stop, cuts))  # incl. the completing token
            assert client.aborted == [client.requests[0].request_id]


async def test_held_back_text_is_released_at_the_end(gguf_model, tokenizer):
    fp = model_fingerprint(gguf_model)
    for finish, tail in ((FinishReason.LENGTH, []), (FinishReason.EOS, [2])):
        script = tokenizer.encode("We went to Par") + tail
        async with Router(gguf_model, [ScriptedClient(fp, script, finish=finish)]) as router:
            deltas = await collect(router, "x", SamplingParams(stop=("Paris",), max_tokens=50))
        assert "".join(d.text for d in deltas) == "We went to Par"
        assert deltas[-1].finish_reason == finish


async def test_a_stop_held_behind_an_earlier_open_one_cuts_at_the_end(gguf_model, tokenizer):
    # "went" matches at 3 but waits while "We went to Paris", from 0, may still complete; the
    # stream ends first, so "went" cuts the text.
    fp = model_fingerprint(gguf_model)
    stops = ("went", "We went to Paris")
    for finish, tail in ((FinishReason.LENGTH, []), (FinishReason.EOS, [2])):
        script = tokenizer.encode("We went to Par") + tail
        async with Router(gguf_model, [ScriptedClient(fp, script, finish=finish)]) as router:
            deltas = await collect(router, "x", SamplingParams(stop=stops, max_tokens=50))
        assert "".join(d.text for d in deltas) == "We " and deltas[-1].finish_reason == FinishReason.STOP
        assert sum(len(d.token_ids) for d in deltas) == len(script)


async def test_worker_death_before_first_token_retries_elsewhere(gguf_model, tokenizer):
    fp = model_fingerprint(gguf_model)
    dying, healthy = ScriptedClient(fp, [5, 6], die_after=0), ScriptedClient(fp, tokenizer.encode("fine"), kind="cpu")
    async with Router(gguf_model, [dying, healthy]) as router:
        deltas = await collect(router, "x", SamplingParams(max_tokens=5))
        assert "".join(d.text for d in deltas) == "fine"
        assert deltas[-1].route == f"gpu ({dying.endpoint}), retried at token 0 on cpu ({healthy.endpoint})"


async def test_worker_death_mid_stream_is_unavailable_when_resume_is_off(gguf_model):
    fp = model_fingerprint(gguf_model)
    config = RouterConfig(resume_on_worker_loss=False)
    async with Router(gguf_model, [ScriptedClient(fp, [5, 6, 7, 8], die_after=2)], config) as router:
        got = []
        with pytest.raises(UnavailableError, match="exited"):
            async with router.generate("x", SamplingParams(max_tokens=5)) as stream:
                async for d in stream:
                    got.append(d)
        assert len(got) == 2
        with pytest.raises(UnavailableError, match="no worker is ready"):
            async with router.generate("x", SamplingParams(max_tokens=5)) as stream:
                pass


class FailingClient(ScriptedClient):
    """Streams one token, then sends `message(request_id)` (an OVERLOAD or a RequestError)."""

    def __init__(self, fingerprint, message):
        super().__init__(fingerprint, [5, 6, 7])
        self.message = message

    async def _play(self, request) -> None:
        from hybridgate.wire import Outputs, SeqOutput

        await asyncio.sleep(0)
        self._on_message(self, Outputs([SeqOutput(request.request_id, 0, [5])], self.stats))
        await asyncio.sleep(0)
        self._on_message(self, self.message(request.request_id))


@pytest.mark.parametrize("message, error, status", [
    (lambda rid: Overload([rid, "another"], "its queue to this worker is full"), UnavailableError, "queue"),
    (lambda rid: RequestError(rid, "out of memory", "resource_exhausted"), ResourceExhaustedError, "memory"),
    (lambda rid: RequestError(rid, "boom"), WorkerRequestError, "boom"),
], ids=["overload", "resource-exhausted", "internal"])
async def test_worker_failures_reach_the_caller_as_their_error(gguf_model, message, error, status):
    async with Router(gguf_model, [FailingClient(model_fingerprint(gguf_model), message)]) as router:
        got = []
        with pytest.raises(error, match=status):
            async with router.generate("x", SamplingParams(max_tokens=5)) as stream:
                async for d in stream:
                    got.append(d)
        assert len(got) == 1


async def test_a_deadline_shorter_than_every_plans_predicted_ttft_is_refused_before_any_work(gguf_model, tokenizer):
    fp = model_fingerprint(gguf_model)
    # Both workers 3,000 prompt tokens deep: the fastest plan's TTFT is (3,000 + the prompt) / 2,000 s, 1.5 s.
    gpu, cpu = ScriptedClient(fp, [5, 6], kind="gpu"), ScriptedClient(fp, [5, 6], kind="cpu")
    for client, rate in ((gpu, 2000.0), (cpu, 200.0)):
        client.stats = EngineStats(queued_prefill_tokens=3000, blocks_total=1000, max_num_seqs=64,
                                   max_num_batched_tokens=2048, prefill_tokens_per_s={512: rate},
                                   decode_step_s={1: 0.02})
    async with Router(gguf_model, [gpu, cpu]) as router:
        with pytest.raises(DeadlineExceededError):
            async with router.generate("Hello", SamplingParams(max_tokens=2), deadline_s=0.05) as stream:
                [d async for d in stream]
        assert gpu.requests == [] and cpu.requests == []  # no worker was asked to do anything
        # A deadline the fastest plan meets runs.
        async with router.generate("Hello", SamplingParams(max_tokens=2), deadline_s=30.0) as stream:
            deltas = [d async for d in stream]
        assert sum(len(d.token_ids) for d in deltas) == 2 and len(gpu.requests) + len(cpu.requests) == 1


async def test_end_of_turn_ids_of_the_vocabulary_stop_unless_eos_is_ignored(gguf_model, tokenizer):
    # SmolLM2's EOS is its only end-of-turn token, so this router's vocabulary is given one more (id 7).
    fp = model_fingerprint(gguf_model)
    for ignore_eos, expected in ((False, (5, 7)), (True, (5,))):
        client = ScriptedClient(fp, tokenizer.encode("fine"))
        async with Router(gguf_model, [client]) as router:
            router.tokenizer.stop_token_ids = frozenset({tokenizer.eos_token_id, 7})
            await collect(router, "x", SamplingParams(max_tokens=5, stop_token_ids=(5,), ignore_eos=ignore_eos))
        assert client.requests[0].params.stop_token_ids == expected
        assert client.requests[0].eos_token_id == tokenizer.eos_token_id


async def test_a_raw_prompt_starts_with_bos_when_the_vocabulary_asks(gguf_model, tokenizer):
    # llama.cpp's llama_tokenize(add_special=true): BOS first when tokenizer.ggml.add_bos_token (SmolLM2's is false).
    fp = model_fingerprint(gguf_model)
    for add_bos, expected in ((False, tokenizer.encode("Hi there")), (True, [1, *tokenizer.encode("Hi there")])):
        client = ScriptedClient(fp, tokenizer.encode("fine"))
        async with Router(gguf_model, [client]) as router:
            router.tokenizer.add_bos_token = add_bos
            await collect(router, "Hi there", SamplingParams(max_tokens=5))
        assert client.requests[0].prompt_ids == expected


async def test_readiness_callback_set_after_construction_is_called(gguf_model):
    # serve builds the Router first and hands it the gateway's health callback afterwards: that
    # callback must hear the flip to READY (a gateway whose gRPC health never said SERVING).
    seen = []
    router = Router(gguf_model, [ScriptedClient(model_fingerprint(gguf_model), [5, 6])])
    router.on_ready_change = seen.append
    async with router:
        assert seen and seen[-1] is True
    assert router.on_ready_change == seen.append
