"""Sizing the GPU worker's memory as vLLM does: the KV cache budget, the profiling steps, the start-up
length, the hand-off buffers. Numbers are injected: no CUDA device is needed."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import zmq

from hybridgate.workers.gpu.sizing import GRAPH_OVERHEAD_BYTES, graphs_allowance, profile_batches
from hybridgate.workers.memory import kv_cache_budget
from tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GiB, MiB = 1 << 30, 1 << 20


def test_a_1b_model_on_an_80_gib_device_leaves_most_of_it_to_the_kv_cache():
    # Llama-3.2-1B in bf16 (2.5 GiB of weights) + 0.5 GiB of CUDA context; 1 GiB of activations, 0.25 GiB graphs.
    budget = kv_cache_budget(total=80 * GiB, used_after_weights=3 * GiB, peak_activations=1 * GiB, utilization=0.9,
                             graphs_allowance=GiB // 4)
    assert budget == int(67.75 * GiB)  # 72 - 3 - 1 - 0.25
    # At Llama-3.2-1B's 32 KiB per token (16 layers x 8 KV heads x 64 x bf16, K and V): 2,220,032 tokens.
    assert budget // (2 * 16 * 8 * 64 * 2) == 2_220_032


def test_an_8b_model_at_16_gib_of_weights():
    budget = kv_cache_budget(80 * GiB, int(16.5 * GiB), 2 * GiB, 0.9, GiB // 2)
    assert budget == 53 * GiB
    # Llama-3-8B: 128 KiB per token (32 layers x 8 KV heads x 128 x bf16, K and V).
    assert budget // (2 * 32 * 8 * 128 * 2) == 434_176


def test_a_model_that_does_not_fit_is_refused_in_one_line_naming_the_flags_and_numbers():
    with pytest.raises(ValueError) as raised:
        kv_cache_budget(80 * GiB, int(70.1 * GiB), 3 * GiB, 0.9, 200 * MiB)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("the KV cache would get -1.3 GiB: 80.0 GiB x 0.90 utilization - 70.1 GiB weights and "
                              "runtime - 3.0 GiB peak activations - 200.0 MiB decode graphs")
    for flag in ("--gpu-memory-utilization", "--max-num-batched-tokens", "--worker-max-model-len (serve: "
                 "--max-model-len)", "--kv-cache-memory"):
        assert flag in message


def test_a_budget_below_one_sequence_of_the_asked_length_is_refused():
    need = 131072 * 32 * 1024  # a 131,072-token sequence of Llama-3.2-1B: 4 GiB
    assert kv_cache_budget(24 * GiB, 16 * GiB, GiB, 0.9, 0, need=need) == int(24 * GiB * 0.9) - 17 * GiB
    with pytest.raises(ValueError, match=r"would get 3\.6 GiB \(at least 4\.0 GiB needed\): 24\.0 GiB x 0\.90 "):
        kv_cache_budget(24 * GiB, 16 * GiB, 2 * GiB, 0.9, 0, need=need)


def test_profile_steps_are_the_largest_step_and_the_largest_decode():
    p = profile_batches(tokens=2048, max_num_seqs=64, decode_batch=64, decode_context=8192, block_size=16,
                       vocab_size=1000)
    assert p.largest.num_tokens == 2048 and len(p.largest) == 64  # 64 rows of logits
    chunk, n = p.largest.entries[0]
    assert n == 1985 and chunk.num_computed == 0 and len(chunk.block_table) == 125  # ceil(1985 / 16)
    tables = [b for seq, _ in p.largest.entries for b in seq.block_table]
    assert len(set(tables)) == len(tables) == 125 + 63  # nothing written twice
    assert all(n == 1 and s.num_computed == 8191 and len(s.block_table) == 512 for s, n in p.decode.entries)
    assert len(p.decode) == 64 and p.num_blocks == 512 + 1  # the widest table and a free block
    small = profile_batches(tokens=16, max_num_seqs=64, decode_batch=8, decode_context=1, block_size=16,
                            vocab_size=1000)
    assert small.largest.num_tokens == 16 and len(small.largest) == 16


def test_graphs_allowance_is_the_decode_peak_the_logits_and_an_overhead_per_graph():
    assert graphs_allowance([1, 2, 4, 8], 1000, MiB) == MiB + 15 * 1000 * 4 + 4 * GRAPH_OVERHEAD_BYTES
    assert graphs_allowance([1, 2], 10, 0) == 3 * 10 * 4 + 2 * GRAPH_OVERHEAD_BYTES


class FakeMemory:
    """A device's counters: `total` and `used` given, each profiled step's peak given in turn."""

    def __init__(self, total: int, used: int, peaks: list[int]):
        self.total, self.used, self.peaks, self.steps = total, used, list(peaks), 0

    def total_and_used(self) -> tuple[int, int]:
        return self.total, self.used

    def peak_growth(self, step) -> int:
        step()
        self.steps += 1
        return self.peaks.pop(0)


def test_a_131072_token_model_starts_with_the_length_its_budget_holds(tmp_path, caplog):
    from hybridgate.models import load_gguf
    from hybridgate.workers.gpu.runner import TorchRunner

    model = load_gguf(write_tiny_llama(tmp_path / "long.gguf", heads=4, kv_heads=2, context=131072))
    block = 2 * 2 * 16 * 2 * 8 * 4  # K and V x 2 layers x 16 tokens x 2 KV heads x head dim 8 x float32
    memory = FakeMemory(total=64 * MiB, used=25 * MiB, peaks=[6 * MiB])  # 32 - 25 - 6: 1 MiB
    with caplog.at_level(logging.INFO, logger="hybridgate.worker"):
        runner = TorchRunner(model, torch.device("cpu"), torch.float32, memory=memory, gpu_memory_utilization=0.5,
                             max_num_batched_tokens=512)
    assert memory.steps == 1  # the largest step ran; no decode graphs on a CPU device
    assert runner.num_blocks == MiB // block == 256 and runner.max_model_len == 256 * 16
    assert "lowered from the model's 131072 tokens to 4096" in caplog.text
    assert ("budget 64.0 MiB x 0.50 utilization - 25.0 MiB weights and runtime - 6.0 MiB peak activations - "
            "0.0 MiB decode graphs = 1.0 MiB, a profiled step of 512 tokens); max model length 4096") in caplog.text
    with pytest.raises(ValueError, match=r"^the KV cache would get 1\.0 MiB \(at least 8\.0 MiB needed\): .*"
                                         r"--gpu-memory-utilization.*--max-model-len.*--kv-cache-memory"):
        TorchRunner(model, torch.device("cpu"), torch.float32, memory=FakeMemory(64 * MiB, 25 * MiB, [6 * MiB]),
                    gpu_memory_utilization=0.5, max_num_batched_tokens=512, max_model_len=32768)
    with pytest.raises(ValueError, match=r"^the KV cache would get -1\.0 MiB: "):
        TorchRunner(model, torch.device("cpu"), torch.float32, memory=FakeMemory(64 * MiB, 25 * MiB, [8 * MiB]),
                    gpu_memory_utilization=0.5)


def test_an_explicit_kv_cache_memory_wins_over_the_utilization(tmp_path):
    from hybridgate.models import load_gguf
    from hybridgate.workers.gpu.runner import TorchRunner

    model = load_gguf(write_tiny_llama(tmp_path / "long.gguf", heads=4, kv_heads=2, context=131072))
    memory = FakeMemory(64 * MiB, 25 * MiB, [6 * MiB])
    runner = TorchRunner(model, torch.device("cpu"), torch.float32, kv_cache_memory="2MiB", memory=memory)
    assert memory.steps == 0 and runner.num_blocks == 2 * MiB // 4096


def _exporter(max_model_len: int, buffer_memory: int = 256 * MiB, notify=lambda event: None):
    from hybridgate.bench.shapes import SHAPES
    from hybridgate.workers.gpu.attention import PagedKVCache
    from hybridgate.workers.gpu.export import KVExporter

    # Llama-3.2-1B: 16 layers, 8 KV heads of 64, bf16 (a token's K and V of one layer: 2 KiB).
    config = SHAPES["llama-3.2-1b"].config()
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (16, 8, 64)
    cache = PagedKVCache(config, 4, 16, torch.device("cpu"), torch.bfloat16)
    fake = SimpleNamespace(cache=cache, max_model_len=max_model_len, model=SimpleNamespace(device=torch.device("cpu")))
    ctx = zmq.Context()
    return KVExporter(fake, ctx, notify, buffer_memory=buffer_memory), ctx


@pytest.mark.parametrize("max_model_len, buffers, buffer_mib, max_tokens", [
    (131072, 2, 128, 65536),  # one layer at full length is 256 MiB, the whole slab: half of it per buffer
    (32768, 4, 64, 32768),  # the longest hand-off's layer fits one buffer
    (1024, 16, 16, 8192),  # at least slab / 16
])
def test_handoff_buffers_hold_a_layer_of_the_longest_handoff_and_are_two_at_least(
        max_model_len, buffers, buffer_mib, max_tokens, caplog):
    with caplog.at_level(logging.INFO, logger="hybridgate.worker"):
        exporter, ctx = _exporter(max_model_len)
    try:
        assert exporter.pool.buffer_bytes == buffer_mib * MiB and exporter.max_tokens == max_tokens
        assert exporter.pool.slab.nbytes // exporter.pool.buffer_bytes == buffers
        assert (f"KV hand-offs: {buffers} pinned buffers of {buffer_mib}.0 MiB (--handoff-buffer-memory 256.0 MiB), "
                f"one layer's K and V of up to {max_tokens} tokens") in caplog.text
        assert ("longer prompts stay on this worker" in caplog.text) == (max_tokens < max_model_len)
    finally:
        exporter.close()
        ctx.term()


def test_a_slab_too_small_for_two_buffers_is_refused():
    with pytest.raises(ValueError, match="--handoff-buffer-memory"):
        _exporter(131072, buffer_memory=48 * 1024)  # 32 KiB per block of one layer: one buffer


def test_a_handoff_longer_than_a_buffer_fails_before_its_header_is_sent():
    import queue

    from hybridgate.wire import ROPE_BASIS, HandoffHeader, SamplingParams
    from hybridgate.workers.handoff import ExportJob

    events: queue.Queue = queue.Queue()
    exporter, ctx = _exporter(131072, notify=events.put)  # 128 MiB buffers: one layer of up to 65,536 tokens
    cpu = ctx.socket(zmq.ROUTER)
    cpu.bind("inproc://long-handoff")
    try:
        n = 65536 + 1  # one block more than a buffer holds
        header = HandoffHeader(request_id="r", token="t", fingerprint="fp", block_size=16, num_layers=16,
                               num_kv_heads=8, head_dim=64, dtype="bfloat16", num_tokens=n, rope_basis=ROPE_BASIS,
                               prompt_ids=[1] * n, output_ids=[5], params=SamplingParams(), seed=1, max_tokens=4,
                               eos_token_id=2, next_token_index=1)
        exporter.submit(ExportJob((b"c", "r"), "inproc://long-handoff", header, list(range(-(-n // 16)))))
        event = events.get(timeout=10)
        assert event.kind == "failed"
        # 4,097 blocks of 16 tokens x 2 KiB (K and V of one layer) against a 128 MiB buffer
        assert event.reason == ("a hand-off of 65537 tokens: one layer's K and V (134250496 bytes) exceed a pinned "
                                "buffer (134217728 bytes, up to 65536 tokens; --handoff-buffer-memory sets them)")
        assert cpu.poll(200) == 0  # the CPU worker was sent nothing: no header waits there for frames
    finally:
        cpu.close(0)
        exporter.close()
        ctx.term()
