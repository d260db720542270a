"""The paged runners and the engine: paged vs contiguous, chunked prefill, prefix caching,
preemption, cancel storm. The torch runner (fp32 on a CPU torch device) and the Numba CPU runner
share the engine; tests that hold for any runner run on both."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from conftest import TIME_FACTOR, golden_npz
from hybridgate.mempool import BlockAllocator
from hybridgate.models import model_fingerprint
from hybridgate.router import Router
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.inprocess import InProcessClient
from hybridgate.workers.scheduler import ScheduledBatch, SchedulerConfig
from hybridgate.workers.sequence import Sequence
from hybridgate.workers.step_inputs import build_step_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG_IDS = golden_npz("logits.npz")["long_ids"].tolist()


@pytest.fixture(scope="module")
def torch_runner(gguf_model):
    return TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def cpu_runner(gguf_model):
    from hybridgate.workers.cpu.runner import NumbaRunner

    # fp32 KV and float32 activations, as the reference's (`auto` takes int16 activations on the avx2 path).
    r = NumbaRunner(gguf_model, kv_cache_memory="256MiB", threads=1, kv_cache_dtype="fp32", activations="f32")
    r.warm_up(progress=False)
    return r


@pytest.fixture(scope="module", params=["torch", "cpu"])
def runner(request):
    return request.getfixturevalue(f"{request.param}_runner")


def logits_of(runner, batch: ScheduledBatch) -> np.ndarray:
    out = runner.forward(batch)
    return out.numpy() if isinstance(out, torch.Tensor) else out


def atol(runner) -> float:
    """Against fp32 torch: the CPU runner sums the same float32 products in another order."""
    return 1e-4 if runner.kind == "gpu" else 2e-3


@pytest.fixture(scope="module")
def fingerprint(gguf_model):
    return model_fingerprint(gguf_model)


def new_seq(rid: str, ids: list[int], max_tokens: int = 8, **params) -> Sequence:
    return Sequence(AddRequest(rid, ids, SamplingParams(temperature=0, **params), 0, max_tokens, 2))


def run_engine(engine: EngineCore, requests: list[AddRequest]) -> dict[str, list[int]]:
    """Add the requests, step until idle; the ids each request got (also those added before)."""
    for r in requests:
        assert engine.add(r) is None
    out: dict[str, list[int]] = defaultdict(list)
    while engine.has_work():
        for s in engine.step():
            out[s.request_id] += output_of(s).token_ids
    return out


def request(rid: str, ids: list[int], max_tokens: int = 8, **params) -> AddRequest:
    return AddRequest(rid, list(ids), SamplingParams(temperature=0, **params), 0, max_tokens, 2)


@pytest.mark.parametrize("lengths", [(16, 32, 48), (15, 17, 33, 50)], ids=["on-boundary", "off-boundary"])
def test_paged_equals_contiguous(runner, llama, lengths):
    alloc = BlockAllocator(runner.num_blocks, runner.block_size)
    seqs = [new_seq(str(i), LONG_IDS[i * 7 : i * 7 + n]) for i, n in enumerate(lengths)]
    caches = [llama.new_cache() for _ in seqs]
    for s in seqs:
        assert alloc.ensure(s.block_table, s.num_tokens + 20)
    paged = logits_of(runner, ScheduledBatch([(s, s.num_tokens) for s in seqs]))
    ref = llama.forward(torch.tensor([t for s in seqs for t in s.prompt_ids]), list(lengths), caches).numpy()
    np.testing.assert_allclose(paged, ref, atol=atol(runner), rtol=0)
    for s in seqs:
        s.num_computed = s.num_tokens
    for step in range(18):  # decodes cross block boundaries
        next_ids = [int(LONG_IDS[1000 + step * 5 + i]) for i in range(len(seqs))]
        for s, t in zip(seqs, next_ids):
            s.output_ids.append(t)
        paged = logits_of(runner, ScheduledBatch([(s, 1) for s in seqs]))
        ref = llama.forward(torch.tensor(next_ids), [1] * len(seqs), caches).numpy()
        np.testing.assert_allclose(paged, ref, atol=atol(runner), rtol=0)
        for s in seqs:
            s.num_computed += 1


def test_chunked_prefill_logits(runner):
    # A 600-token prompt in chunks of 256 against one shot.
    chunked, whole = new_seq("c", LONG_IDS[:600]), new_seq("w", LONG_IDS[:600])
    alloc = BlockAllocator(runner.num_blocks, runner.block_size, prefix_caching=False)
    for s in (chunked, whole):
        alloc.ensure(s.block_table, 600)
    for a in range(0, 600, 256):
        n = min(256, 600 - a)
        logits = logits_of(runner, ScheduledBatch([(chunked, n)]))
        chunked.num_computed += n
    np.testing.assert_allclose(logits, logits_of(runner, ScheduledBatch([(whole, 600)])), atol=1e-4, rtol=0)


def test_decodes_keep_running_through_a_chunked_prefill(torch_runner, fingerprint):
    # The scheduler's part (the same for every runner): a decode keeps getting a token every step
    # while a 2048-token prompt is prefilled under a 256-token budget.
    runner = torch_runner
    engine = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=256), fingerprint, prefix_caching=False)
    engine.add(request("decode", LONG_IDS[5:15], 80, ignore_eos=True))
    first = engine.step()
    assert engine.add(request("long", LONG_IDS[:2048], 4)) is None
    steps = []
    original = engine.scheduler.schedule

    def spy():
        batch = original()
        steps.append([(s.request_id, n) for s, n in batch.entries])
        return batch

    engine.scheduler.schedule = spy
    out = run_engine(engine, [])
    long_steps = [i for i, st in enumerate(steps) if any(r == "long" and n > 1 for r, n in st)]
    between = steps[long_steps[0] : long_steps[-1] + 1]
    assert all(sum(n for _, n in st) <= 256 for st in steps)
    assert all(("decode", 1) in st for st in between) and len(between) >= 7
    solo = run_engine(EngineCore(runner, SchedulerConfig(max_num_batched_tokens=4096), fingerprint, False),
                      [request("long", LONG_IDS[:2048], 4)])
    assert out["long"] == solo["long"] and len(out["long"]) == 4
    assert len(out["decode"]) == 80 and first[0].request_id == "decode"


def test_prefix_caching_saves_whole_blocks(runner, fingerprint):
    prompt = LONG_IDS[100:200]
    cached = EngineCore(runner, SchedulerConfig(), fingerprint, prefix_caching=True)
    plain = EngineCore(runner, SchedulerConfig(), fingerprint, prefix_caching=False)
    first = run_engine(cached, [request("a", prompt)])["a"]
    for n in (100, 101):
        ids = LONG_IDS[100 : 100 + n]
        before = cached.refresh_stats().prefill_tokens
        cached.add(request("r", ids))
        seqs = []
        while cached.has_work():
            seqs += [s for s in cached.step() if s.request_id == "r"]
        got = [t for s in dict.fromkeys(seqs) for t in s.output_ids]
        assert seqs[0].cached_tokens == 16 * ((n - 1) // 16)
        assert cached.refresh_stats().prefill_tokens - before == n - 16 * ((n - 1) // 16)
        assert got == run_engine(plain, [request("p", ids)])["p"]
    assert first == run_engine(plain, [request("p", prompt)])["p"]


@pytest.mark.parametrize("kind", ["torch", "cpu"])
def test_preemption_recomputes_and_matches_solo(gguf_model, fingerprint, kind):
    if kind == "torch":
        small = TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="64MiB", max_num_blocks=16)
    else:
        from hybridgate.workers.cpu.runner import NumbaRunner

        small = NumbaRunner(gguf_model, kv_cache_memory="64MiB", max_num_blocks=16, threads=1)
    prompts = [LONG_IDS[i * 40 : i * 40 + 30] for i in range(4)]
    reqs = [request(str(i), p, 48, ignore_eos=True) for i, p in enumerate(prompts)]  # 4 x 78 tokens > 16 x 16
    engine = EngineCore(small, SchedulerConfig(), fingerprint)
    together = run_engine(engine, reqs)
    assert engine.refresh_stats().preemptions > 0
    assert engine.allocator.num_used == 0
    for r in reqs:
        solo = run_engine(EngineCore(small, SchedulerConfig(), fingerprint), [r])
        assert together[r.request_id] == solo[r.request_id]


def test_cancel_storm_returns_every_block_and_buffer(gguf_model, runner, fingerprint):
    async def storm():
        client = InProcessClient(runner, fingerprint)
        rng = random.Random(3)
        async with Router(gguf_model, [client]) as router:

            async def one(i):
                stop_after = rng.randrange(0, 6)
                async with router.generate(f"Request {i} says", SamplingParams(max_tokens=40, ignore_eos=True)) as s:
                    if stop_after == 0:
                        return
                    k = 0
                    async for _ in s:
                        k += 1
                        if k >= stop_after:
                            break

            await asyncio.gather(*(one(i) for i in range(200)))
            for _ in range(int(3000 * TIME_FACTOR)):
                if not client.engine.has_work() and client.inbox.requests.empty():
                    break
                await asyncio.sleep(0.01)
            return client.engine.refresh_stats()

    stats = asyncio.run(storm())
    assert stats.blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert runner.pool.stats.buffers_in_use == 0 and stats.pinned_bytes_in_use == 0 and stats.pinned_peak_bytes > 0


def prefilled_decode_batch(runner, lengths, stride: int, next_from: int) -> ScheduledBatch:
    """Prompts of `lengths` prefilled on fresh blocks, each with one more id: the next decode step."""
    alloc = BlockAllocator(runner.num_blocks, runner.block_size)
    seqs = [new_seq(str(i), LONG_IDS[i * stride : i * stride + n]) for i, n in enumerate(lengths)]
    for s in seqs:
        alloc.ensure(s.block_table, s.num_tokens + 1)
    runner.forward(ScheduledBatch([(s, s.num_tokens) for s in seqs]))
    for s in seqs:
        s.num_computed = s.num_tokens
        s.output_ids.append(int(LONG_IDS[next_from + len(s.prompt_ids)]))
    return ScheduledBatch([(s, 1) for s in seqs])


def test_an_abort_that_overtakes_its_request_drops_it(runner, fingerprint):
    engine = EngineCore(runner, SchedulerConfig(), fingerprint)
    assert engine.abort(["late"]) == []
    assert engine.add(request("late", LONG_IDS[:20], 30)) is None
    assert not engine.has_work() and engine.refresh_stats().blocks_used == 0


def test_block_gather_decode_path_equals_the_slot_gather_reference(gguf_model, torch_runner):
    """The CUDA decode path (whole-block gathers) against the per-slot reference, run on the CPU."""
    runner = torch_runner
    blocks = TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="64MiB", block_gather=True)
    results = [r.forward(prefilled_decode_batch(r, (3, 16, 17, 40), stride=11, next_from=700)).numpy()
               for r in (runner, blocks)]
    np.testing.assert_allclose(results[1], results[0], atol=1e-4, rtol=0)


def run_loop(engine: EngineCore, requests: list[AddRequest], timeout: float = 60.0) -> tuple[dict, dict]:
    """Requests queued before the loop starts (so they share its first step), run on an EngineLoop thread
    until each has finished or failed: (ids per request, RequestError per failed request)."""
    import threading
    import time

    from hybridgate.wire import Outputs, RequestError
    from hybridgate.workers.engine_loop import EngineLoop, Inbox

    inbox, ids, errors, done = Inbox(), defaultdict(list), {}, set()

    def send(client, msg):
        if isinstance(msg, RequestError):
            errors[msg.request_id] = msg
            done.add(msg.request_id)
        elif isinstance(msg, Outputs):
            for out in msg.outputs:
                assert out.token_index == len(ids[out.request_id])
                ids[out.request_id] += out.token_ids
                if out.finish:
                    done.add(out.request_id)

    for r in requests:
        inbox.requests.put((b"", r))
    loop = EngineLoop(engine, inbox, send)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout * TIME_FACTOR
    while len(done) < len(requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stopping.set()
    thread.join(10)
    assert len(done) == len(requests), f"unfinished: {[r.request_id for r in requests if r.request_id not in done]}"
    return dict(ids), errors


@pytest.fixture
def fault(torch_runner, monkeypatch):
    """Arm the runner's test fault hook from HYBRIDGATE_TEST_FAULT, as a runner reads it when built."""
    from hybridgate.workers.faults import FAULT_ENV, FaultHook

    def arm(spec: str) -> None:
        monkeypatch.setenv(FAULT_ENV, spec)
        torch_runner.fault = FaultHook.from_env()
        assert torch_runner.fault is not None

    yield arm
    torch_runner.fault = None


def test_a_sequence_failing_in_a_step_ends_alone(torch_runner, fingerprint, fault):
    reqs = [request(f"r{i}", LONG_IDS[i * 50 : i * 50 + 6 + 3 * i], 8, ignore_eos=True) for i in range(8)]
    solo = {r.request_id: run_engine(EngineCore(torch_runner, SchedulerConfig(), fingerprint), [r])[r.request_id]
            for r in reqs if r.request_id != "r3"}
    fault("fail_request:r3")
    engine = EngineCore(torch_runner, SchedulerConfig(), fingerprint)
    ids, errors = run_loop(engine, reqs)
    assert list(errors) == ["r3"] and errors["r3"].code == "internal" and "injected fault" in errors["r3"].message
    assert "r3" not in ids
    assert ids == solo and all(len(v) == 8 for v in solo.values())
    assert engine.refresh_stats().batch_size_counts.get(7, 0) >= 8  # the batch mates kept running together
    assert engine.allocator.num_used == 0


def test_out_of_memory_reruns_without_the_largest_prefill_then_blames_it_alone(torch_runner, fingerprint, fault):
    # A device that holds 400 tokens of activations: 300 + 200 + 450 prompt tokens in one step fail;
    # 300 and 200 each fit alone and finish as they do alone; 450 cannot run at all: RESOURCE_EXHAUSTED.
    reqs = [request("a", LONG_IDS[:300], 3), request("b", LONG_IDS[300:500], 3), request("c", LONG_IDS[500:950], 3)]
    solo = {r.request_id: run_engine(EngineCore(torch_runner, SchedulerConfig(), fingerprint), [r])[r.request_id]
            for r in reqs[:2]}
    fault("oom_over_tokens:400")
    engine = EngineCore(torch_runner, SchedulerConfig(), fingerprint, prefix_caching=False)
    ids, errors = run_loop(engine, reqs)
    assert list(errors) == ["c"] and errors["c"].code == "resource_exhausted"
    assert ids == solo and all(len(v) >= 1 for v in solo.values())
    assert engine.allocator.num_used == 0


def test_triton_kernels_equal_the_reference_path_dynamic_and_padded(gguf_model, torch_runner):
    """The real model (9 query heads over 3 KV heads) through the Triton kernels (interpreted here): a prefill
    of three prompts, then their decode step, dynamic and as the static padded step a CUDA graph captures
    (block tables padded with the scratch block, one graph per batch size), against the reference path."""
    from hybridgate.workers.gpu.graphs import DecodeGraphs

    kernels = TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="64MiB", attention="triton")
    assert kernels.attention == "triton"
    results = [r.forward(prefilled_decode_batch(r, (5, 16, 33), stride=9, next_from=500)) for r in
               (torch_runner, kernels)]
    np.testing.assert_allclose(results[1].numpy(), results[0].numpy(), atol=1e-4, rtol=0)
    graphs = DecodeGraphs(kernels.model, kernels.cache, kernels.scratch_slot, 8, kernels.max_model_len,
                          capture=False, num_splits=lambda batch: 2)
    batch = prefilled_decode_batch(kernels, (7, 17), stride=13, next_from=600)
    dynamic = kernels.forward(batch).numpy()
    h = build_step_inputs(batch, kernels.block_size, None, kernels.scratch_slot)
    static = graphs.run(h.ids, h.positions, h.slots, h.decode_tables.astype(np.int32), np.asarray(h.contexts))
    assert graphs.padded(2) == 2 and graphs.max_blocks == -(-kernels.max_model_len // kernels.block_size)
    np.testing.assert_allclose(static.numpy(), dynamic, atol=1e-4, rtol=0)


def test_a_131072_token_model_starts_with_the_length_its_cache_holds(tmp_path, caplog):
    """A Llama 3.x-style context (131,072 tokens) and an injected budget (--kv-cache-memory 1MiB): the GPU
    worker lowers its max model length to what the cache holds and says so; asked for more than that, it
    refuses in one line naming the flags. (The budget of --gpu-memory-utilization, and the hand-off
    exporter on a Llama-3.2-1B-shaped cache: tests/unit/test_gpu_memory.py.)"""
    import logging

    from hybridgate.models import load_gguf
    from tiny_gguf import write_tiny_llama

    model = load_gguf(write_tiny_llama(tmp_path / "long.gguf", heads=4, kv_heads=2, context=131072))
    assert model.config.max_model_len == 131072
    with caplog.at_level(logging.INFO, logger="hybridgate.worker"):
        runner = TorchRunner(model, torch.device("cpu"), torch.float32, kv_cache_memory="1MiB")
    assert runner.max_model_len == runner.num_blocks * runner.block_size < 131072
    assert f"lowered from the model's 131072 tokens to {runner.max_model_len}" in caplog.text
    assert f"max model length {runner.max_model_len}" in caplog.text  # the start-up line
    fits = TorchRunner(model, torch.device("cpu"), torch.float32, kv_cache_memory="1MiB", max_model_len=256)
    assert fits.max_model_len == 256
    # The worker's own flag and serve's, the asked length and what the cache holds (1 MiB of 4 KiB blocks of 16).
    with pytest.raises(ValueError, match=r"^--worker-max-model-len \(serve: --max-model-len\) 131072: the KV cache "
                                         r"holds 4096 tokens; lower it to 4096 or less, or give the cache more memory "
                                         r"\(--gpu-memory-utilization on CUDA, --kv-cache-memory\)$"):
        TorchRunner(model, torch.device("cpu"), torch.float32, kv_cache_memory="1MiB", max_model_len=131072)
