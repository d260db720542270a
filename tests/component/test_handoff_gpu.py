"""GPU-only checks of the KV hand-off's export (run by `make gpu-check`; skipped without CUDA).

The copy stream waits for the step that wrote the blocks (an event), while the engine runs its next
steps: the KV received must equal the device blocks after that step, under concurrent decodes; and the
hidden-fraction metric is measured with CUDA events on both streams for a 2,048-token prompt.
"""

from __future__ import annotations

import hashlib
import queue
import time

import numpy as np
import pytest
import torch
import zmq

from conftest import TIME_FACTOR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def setup(gpu_model_path):
    from hybridgate.models import load_gguf
    from hybridgate.workers.gpu.export import KVExporter
    from hybridgate.workers.gpu.runner import TorchRunner

    runner = TorchRunner(load_gguf(gpu_model_path), torch.device("cuda"), kv_cache_memory="2GiB", max_num_seqs=16)
    runner.warm_up()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("inproc://gpu-handoff")
    events: queue.Queue = queue.Queue()
    exporter = KVExporter(runner, ctx, events.put, buffer_memory=64 << 20)
    yield runner, sock, events, exporter
    exporter.close()
    sock.close(0)
    ctx.term()


def _handoff_under_decodes(setup, prompt_len: int, others: int):
    """A hand-off of `prompt_len` tokens while `others` sequences decode; (received K/V per layer as
    float32 checksums, the device's, stats)."""
    from hybridgate.wire import AddRequest, HandoffTarget, SamplingParams
    from hybridgate.workers.engine import EngineCore
    from hybridgate.workers.scheduler import SchedulerConfig

    runner, sock, events, exporter = setup
    engine = EngineCore(runner, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096), "fp",
                        prefix_caching=False)
    engine.handoffs.exporter = exporter
    rng = np.random.default_rng(prompt_len)
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    for i in range(others):
        engine.add(AddRequest(f"o{i}", rng.integers(3, 1000, 64).tolist(), greedy, 0, 400, 2), b"r")
    while any(s.num_computed < s.num_tokens - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.add(AddRequest("h", rng.integers(3, 1000, prompt_len).tolist(), greedy, 0, 8, 2,
                          handoff=HandoffTarget("inproc://gpu-handoff", "tok")), b"r")
    while not engine.handoffs.parked:
        engine.step()
    parked = engine.handoffs.parked[(b"r", "h")].seq
    received: dict[int, list[np.ndarray]] = {}
    event = None
    deadline = time.monotonic() + 60 * TIME_FACTOR
    while event is None or sock.poll(0):
        assert time.monotonic() < deadline
        engine.step()  # the next steps run while the export copies
        while sock.poll(0):
            peer, kind, body, *frames = sock.recv_multipart()
            if kind == b"P":
                from hybridgate.workers.handoff import decode_part

                part = decode_part(body)
                for j in range(part.num_layers):
                    received[part.first_layer + j] = [np.frombuffer(f, np.uint16).copy() for f in frames[2 * j:2 * j + 2]]
        if event is None:
            try:
                event = events.get_nowait()
            except queue.Empty:
                pass
    assert event.kind == "sent", event
    engine.handoffs.handle(b"", event)
    torch.cuda.synchronize()
    bs, n = runner.block_size, parked.num_computed
    table = torch.tensor(parked.block_table, device="cuda")
    for layer, (k, v) in sorted(received.items()):
        for got, cache in ((k, runner.cache.k[layer]), (v, runner.cache.v[layer])):
            want = cache.view(-1, bs, *cache.shape[1:])[table].reshape(-1, *cache.shape[1:])[:n]
            want = want.contiguous().view(torch.int16).cpu().numpy().view(np.uint16).reshape(-1)
            assert hashlib.sha256(got.tobytes()).digest() == hashlib.sha256(want.tobytes()).digest(), layer
    assert len(received) == runner.model.config.num_layers
    engine.abort([f"o{i}" for i in range(others)] + ["h"], b"r")
    return engine.refresh_stats()


def test_exported_kv_equals_the_device_blocks_under_concurrent_steps(setup):
    stats = _handoff_under_decodes(setup, 300, others=8)
    assert stats.handoff_bytes_total > 0


def test_hidden_fraction_on_a_2048_token_prompt(setup):
    stats = _handoff_under_decodes(setup, 2048, others=8)
    copy, hidden = stats.handoff_copy_seconds_total, stats.handoff_copy_hidden_seconds_total
    gbps = stats.handoff_bytes_total / copy / 1e9 if copy else 0.0
    print(f"\nhand-off of 2048 tokens under 8 decodes: copy {copy * 1e3:.2f} ms, hidden {hidden * 1e3:.2f} ms "
          f"({hidden / copy:.0%}), {gbps:.1f} GB/s")
    assert 0 < hidden <= copy
