"""Every architecture row on CUDA (run by `make gpu-check`; skipped without CUDA): the paged runner with
its captured decode graphs against the fp32 CPU forward that test_architectures.py holds to transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridgate.models import load_gguf, model_fingerprint
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.gpu.model import DecoderModel
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.scheduler import SchedulerConfig
from hybridgate.workers.step_inputs import build_step_inputs
from tiny_gguf import TINY_SPECS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 16
BF16_BOUND = 0.1  # of the fp32 logits' largest magnitude: above the 6.3% seen on the CPU device


@pytest.fixture(scope="module", params=list(TINY_SPECS))
def case(request, tiny_models):
    model = load_gguf(tiny_models(request.param))
    prompt = np.random.default_rng(3).integers(0, model.config.vocab_size, size=40).tolist()
    cpu = DecoderModel(model, torch.device("cpu"), torch.float32)
    cache, ids, gaps = cpu.new_cache(), [], []
    logits = cpu.forward(torch.tensor(prompt), [len(prompt)], [cache])[0]
    first = logits.clone()
    for _ in range(STEPS):
        top = torch.topk(logits, 2).values
        ids.append(int(logits.argmax()))
        gaps.append(float(top[0] - top[1]))
        logits = cpu.forward(torch.tensor(ids[-1:]), [1], [cache])[0]
    return request.param, model, prompt, ids, gaps, first


def greedy_on(runner: TorchRunner, model, prompts: list[list[int]]) -> list[list[int]]:
    engine = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=12), model_fingerprint(model))
    params = SamplingParams(temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        assert engine.add(AddRequest(str(i), p, params, 0, STEPS, -1)) is None
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for s in engine.step():
            out[s.request_id] += output_of(s).token_ids
    return [out[str(i)] for i in range(len(prompts))]


def first_difference_is_a_tie(got: list[int], want: list[int], gaps: list[float], tie: float) -> bool:
    diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return diff is None or gaps[diff] < tie


def test_cuda_fp32_graphs_match_the_cpu_forward(case):
    # Chunked prefill past the 16-token windows, then decodes replayed from captured graphs (batch of 3).
    name, model, prompt, want, gaps, _ = case
    runner = TorchRunner(model, torch.device("cuda"), torch.float32, kv_cache_memory="1GiB", max_num_seqs=4)
    runner.warm_up()
    before = runner.graphs.replays
    got = greedy_on(runner, model, [prompt, prompt[:30], prompt[5:]])
    assert runner.graphs.replays > before
    assert first_difference_is_a_tie(got[0], want, gaps, 1e-3), (name, got[0], want)


def test_cuda_bf16_graph_replay_is_bitwise_equal_to_eager(case):
    # Contexts of 40, 30 and 35 tokens (past the 16-token windows): the window masks are in the graph.
    from hybridgate.mempool import BlockAllocator
    from hybridgate.workers.gpu.graphs import DecodeGraphs
    from hybridgate.workers.scheduler import ScheduledBatch
    from hybridgate.workers.sequence import Sequence

    name, model, prompt, _, _, _ = case
    runner = TorchRunner(model, torch.device("cuda"), kv_cache_memory="1GiB", max_num_seqs=4)
    runner.warm_up()
    assert runner.model.dtype == torch.bfloat16
    alloc = BlockAllocator(runner.num_blocks, runner.block_size)
    seqs = [Sequence(AddRequest(str(i), p, SamplingParams(temperature=0), 0, 8, -1))
            for i, p in enumerate([prompt, prompt[:30], prompt[5:]])]
    for s in seqs:
        alloc.ensure(s.block_table, s.num_tokens + 8)
    runner.forward(ScheduledBatch([(s, s.num_tokens) for s in seqs]))
    for s in seqs:
        s.num_computed = s.num_tokens
        s.output_ids.append(7)
    h = build_step_inputs(ScheduledBatch([(s, 1) for s in seqs]), runner.block_size, None, runner.scratch_slot)
    eager = DecodeGraphs(runner.model, runner.cache, runner.scratch_slot, 4, runner.max_model_len, capture=False,
                         num_splits=runner._num_splits)
    args = (h.ids, h.positions, h.slots, h.decode_tables.astype(np.int32), np.asarray(h.contexts))
    before = runner.graphs.replays
    replayed = runner.graphs.run(*args).clone()
    assert runner.graphs.replays == before + 1
    assert torch.equal(replayed, eager.run(*args)), name


def test_cuda_bf16_follows_the_fp32_golden_forward(case):
    # The default GPU dtype against the fp32 CPU forward (held to transformers within 1e-3): the prompt's
    # last logits within BF16_BOUND of the reference logits' largest magnitude (8 bits of mantissa through
    # every layer: on the CPU device these files' bf16 forward is 0.8-6.3% of that off), and greedy decoding
    # through the paged runner and its graphs the same ids up to the first gap below twice that bound (two
    # logits each off by up to the bound can swap). The bound is fixed: a margin taken from the measured
    # error would grow with the error it is meant to catch.
    name, model, prompt, want, gaps, first = case
    bf16 = DecoderModel(model, torch.device("cuda"), torch.bfloat16)
    got = bf16.forward(torch.tensor(prompt, device="cuda"), [len(prompt)], [bf16.new_cache()])[0].float().cpu()
    bound = BF16_BOUND * float(first.abs().max())
    err = float((got - first).abs().max())
    assert err <= bound, (name, err, bound)
    runner = TorchRunner(model, torch.device("cuda"), kv_cache_memory="1GiB", max_num_seqs=4)
    runner.warm_up()
    ids = greedy_on(runner, model, [prompt])[0]
    assert first_difference_is_a_tie(ids, want, gaps, 2 * bound), (name, ids, want, err, bound)
