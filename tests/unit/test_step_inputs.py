"""`build_step_inputs`: the prompt rows the CPU runner multiplies on AMX tiles, chosen per request; the
staging buffer a max-size step fits in, and the fallback counted when one does not."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest

from hybridgate.gateway.metrics import GatewayMetrics
from hybridgate.mempool import PinnedPool
from hybridgate.wire import AddRequest, EngineStats, SamplingParams
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence
from hybridgate.workers.step_inputs import build_step_inputs, staging_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _seq(name: str, prompt: int, computed: int, outputs: int = 0) -> Sequence:
    s = Sequence(AddRequest(name, list(range(1, prompt + 1)), SamplingParams(temperature=0), 0, 64, -1))
    s.output_ids = [7] * outputs
    s.num_computed = computed
    s.block_table = list(range(8 * int(name), 8 * int(name) + 8))
    return s


def test_prompt_rows_are_the_prompt_tokens_of_long_prompts_whatever_the_batch():
    decode = _seq("0", 40, 41, outputs=2)  # a decode: its token is generated (row 0)
    short = _seq("1", 20, 0)  # a whole prompt under the length: rows 1-20, none
    chunk = _seq("2", 50, 10)  # a long prompt's middle chunk of 16: rows 21-36, all prompt tokens
    tail = _seq("3", 34, 30, outputs=3)  # a recompute: 4 prompt tokens (rows 37-40), then 3 generated
    batch = ScheduledBatch([(decode, 1), (short, 20), (chunk, 16), (tail, 7)])
    inputs = build_step_inputs(batch, 16, None, 0, long_prompt=32)
    np.testing.assert_array_equal(inputs.prompt_rows, [*range(21, 37), 37, 38, 39, 40])
    assert build_step_inputs(batch, 16, None, 0).prompt_rows.size == 0  # none asked: none listed
    alone = build_step_inputs(ScheduledBatch([(chunk, 16)]), 16, None, 0, long_prompt=32)
    np.testing.assert_array_equal(alone.prompt_rows, np.arange(16))  # the same tokens, wherever they sit
    # a mixture of experts' higher threshold: of these, only the 50-token prompt's rows
    experts = build_step_inputs(batch, 16, None, 0, long_prompt=32, expert_long_prompt=40)
    np.testing.assert_array_equal(experts.prompt_rows, inputs.prompt_rows)
    np.testing.assert_array_equal(experts.expert_prompt_rows, np.arange(21, 37))
    assert inputs.expert_prompt_rows.size == 0  # none asked: none listed


def _max_size_batch(tokens: int, seqs: int, model_len: int, block_size: int) -> ScheduledBatch:
    """seqs - 1 decodes at model_len tokens and one prefill chunk of the rest of the token budget ending at
    model_len: the most any step puts in the staging buffer."""
    blocks = -(-model_len // block_size)

    def seq(name: str, computed: int, outputs: int) -> Sequence:
        s = Sequence(AddRequest(name, list(range(1, model_len - outputs + 1)), SamplingParams(temperature=0), 0,
                                max(outputs, 1), -1))
        s.output_ids, s.num_computed = [7] * outputs, computed
        s.block_table = list(range(blocks * int(name), blocks * (int(name) + 1)))
        return s

    chunk = tokens - (seqs - 1)
    decodes = [(seq(str(i), model_len - 1, 1), 1) for i in range(seqs - 1)]
    return ScheduledBatch([*decodes, (seq(str(seqs - 1), model_len - chunk, 0), chunk)])


def test_a_max_size_step_fits_a_buffer_sized_by_staging_bytes():
    tokens, seqs, model_len, block_size = 512, 8, 1024, 16
    batch = _max_size_batch(tokens, seqs, model_len, block_size)
    assert batch.num_tokens == tokens and len(batch) == seqs
    # The arrays written: ids, positions, slots (512 each), 7 decode contexts padded to 1024, one prefill
    # context of 1024, 8 last rows.
    assert staging_bytes(tokens, seqs, model_len) == 8 * (3 * 512 + 7 * 1024 + 1024 + 8)
    pool = PinnedPool(staging_bytes(tokens, seqs, model_len), 2)
    buf = pool.acquire()
    inputs = build_step_inputs(batch, block_size, buf, 0)
    assert pool.stats.fallbacks == 0
    assert np.shares_memory(inputs.ids, pool.slab) and np.shares_memory(inputs.last, pool.slab)
    assert inputs.decode_context.shape == (7, 1024) and inputs.prefill_context.size == 1024


def test_a_step_larger_than_its_buffer_is_counted_and_exported():
    batch = _max_size_batch(64, 4, 256, 16)
    pool = PinnedPool(staging_bytes(64, 4, 256) - 64, 2)  # one cache line short
    buf = pool.acquire()
    inputs = build_step_inputs(batch, 16, buf, 0)
    assert not np.shares_memory(inputs.ids, pool.slab)  # pageable memory ...
    assert pool.stats.fallbacks == 1  # ... counted
    pool.release(buf)
    stats = EngineStats(pinned_fallbacks=pool.stats.fallbacks)
    worker = type("W", (), {"stats": stats, "name": "gpu-0", "kind": "gpu", "endpoint": ""})()
    text = generate_latest(GatewayMetrics(lambda: [worker]).registry).decode()
    assert 'hybridgate:pinned_fallbacks_total{worker="gpu-0"} 1.0' in text


def test_the_gpu_runner_stages_the_largest_step_of_its_scheduler_in_one_buffer(tmp_path):
    """Its pool follows its max_num_seqs, token budget and max model length (it was 4 MiB whatever they were)."""
    import torch

    from hybridgate.models import load_gguf
    from hybridgate.workers.gpu.runner import TorchRunner
    from tiny_gguf import write_tiny_llama

    model = load_gguf(write_tiny_llama(tmp_path / "m.gguf", heads=4, kv_heads=2, context=4096))
    runner = TorchRunner(model, torch.device("cpu"), torch.float32, kv_cache_memory="4MiB", max_num_seqs=128,
                         max_num_batched_tokens=1024)
    assert runner.pool.buffer_bytes >= staging_bytes(1024, 128, runner.max_model_len) > 4 << 20


def test_the_pinned_buffers_at_a_131072_token_context_are_the_size_the_docs_give():
    """docs/engine.md: two buffers of about 76 MiB at 64 sequences and 131,072 tokens (steps of 2,048 tokens, blocks
    of 16). By hand, int64 words: 3 x 2,048 tokens + 5 x 64 entries + 1 + 3 x 64 x 8,192 table cells + 12 x 64
    sampler fields + 64 x 131,072 penalty ids = 9,968,705, x 8 bytes = 76.06 MiB."""
    from pathlib import Path

    from hybridgate.workers.input_batch import packed_words

    assert packed_words(2048, 64, 131072, 16) == 9_968_705
    docs = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()
    assert "two of about 76 MiB at 64 sequences and 131,072\ntokens" in docs
