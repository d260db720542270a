"""GPU-only checks of the CUDA path (run by `make gpu-check`; skipped without CUDA)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cuda_runner(gpu_model_path):
    from hybridgate.models import load_gguf
    from hybridgate.workers.gpu.runner import TorchRunner

    runner = TorchRunner(load_gguf(gpu_model_path), torch.device("cuda"), kv_cache_memory="2GiB", max_num_seqs=16)
    runner.warm_up()
    return runner


def _prefilled(runner, lengths):
    from hybridgate.mempool import BlockAllocator
    from hybridgate.wire import AddRequest, SamplingParams
    from hybridgate.workers.scheduler import ScheduledBatch
    from hybridgate.workers.sequence import Sequence

    alloc = BlockAllocator(runner.num_blocks, runner.block_size)
    rng = np.random.default_rng(0)
    seqs = []
    for i, n in enumerate(lengths):
        s = Sequence(AddRequest(str(i), rng.integers(3, 1000, n).tolist(), SamplingParams(temperature=0), 0, 8, 2))
        alloc.ensure(s.block_table, n + 8)
        seqs.append(s)
    runner.forward(ScheduledBatch([(s, s.num_tokens) for s in seqs]))
    for s in seqs:
        s.num_computed = s.num_tokens
        s.output_ids.append(7)
    return seqs, alloc


def test_graph_replay_is_bitwise_equal_to_eager_at_the_same_padded_size(cuda_runner):
    from hybridgate.workers.gpu.graphs import DecodeGraphs
    from hybridgate.workers.scheduler import ScheduledBatch
    from hybridgate.workers.step_inputs import build_step_inputs

    seqs, _ = _prefilled(cuda_runner, (5, 20, 33))
    batch = ScheduledBatch([(s, 1) for s in seqs])
    h = build_step_inputs(batch, cuda_runner.block_size, None, cuda_runner.scratch_slot)
    eager = DecodeGraphs(cuda_runner.model, cuda_runner.cache, cuda_runner.scratch_slot, 16,
                         cuda_runner.max_model_len, capture=False, num_splits=cuda_runner._num_splits)
    args = (h.ids, h.positions, h.slots, h.decode_tables.astype(np.int32), np.asarray(h.contexts))
    before = cuda_runner.graphs.replays
    replayed = cuda_runner.graphs.run(*args).clone()
    assert cuda_runner.graphs.replays == before + 1
    assert torch.equal(replayed, eager.run(*args))


def test_cuda_decode_matches_the_gather_reference(cuda_runner):
    import dataclasses

    from hybridgate.workers.gpu.attention import PagedAttention
    from hybridgate.workers.scheduler import ScheduledBatch

    seqs, _ = _prefilled(cuda_runner, (17, 64, 100, 250))
    batch = ScheduledBatch([(s, 1) for s in seqs])
    device_step = cuda_runner._stage(batch)
    step = device_step.paged_step(block_gather=True)
    assert step.decode_blocks is not None  # the block-gather path copies whole blocks
    model, ids, pos, last = cuda_runner.model, device_step.ids, device_step.positions, device_step.last
    fast = model.forward_tokens(ids, pos, PagedAttention(cuda_runner.cache, step), last).float()
    slot_step = dataclasses.replace(step, decode_blocks=None, decode_block_mask=None)
    ref = model.forward_tokens(ids, pos, PagedAttention(cuda_runner.cache, slot_step), last).float()
    graphs = cuda_runner.forward(batch).float()
    assert (fast - ref).abs().max().item() < 5e-2  # bf16
    assert (graphs - ref).abs().max().item() < 5e-2


def test_freed_blocks_reused_at_once_keep_kv_intact(cuda_runner):
    """Under load, blocks freed by finished sequences are reallocated in the same step; the KV of the
    survivors (checksummed) must not change and their outputs must equal solo runs."""
    from hybridgate.models import model_fingerprint  # noqa: F401
    from hybridgate.wire import AddRequest, SamplingParams
    from hybridgate.workers.engine import EngineCore, output_of
    from hybridgate.workers.scheduler import SchedulerConfig

    def run(reqs):
        engine = EngineCore(cuda_runner, SchedulerConfig(max_num_seqs=16), "fp", prefix_caching=False)
        for r in reqs:
            engine.add(r)
        out, checks = {}, []
        while engine.has_work():
            for s in engine.step():
                out.setdefault(s.request_id, []).extend(output_of(s).token_ids)
            survivor = next((s for s in engine.scheduler.running if s.request_id == "keep"), None)
            if survivor is not None and survivor.num_computed >= 32:
                slots = survivor.block_table[:2]
                k = cuda_runner.cache.k[0].view(-1, cuda_runner.block_size, *cuda_runner.cache.k[0].shape[1:])[slots]
                checks.append(hashlib.sha256(k.float().cpu().numpy().tobytes()).hexdigest())
        return out, checks

    rng = np.random.default_rng(1)
    keep = AddRequest("keep", rng.integers(3, 1000, 40).tolist(), SamplingParams(temperature=0, ignore_eos=True), 0, 64, 2)
    churn = [AddRequest(f"c{i}", rng.integers(3, 1000, 20).tolist(), SamplingParams(temperature=0, ignore_eos=True),
                        0, int(rng.integers(1, 6)), 2) for i in range(60)]
    together, checks = run([keep, *churn])
    solo, _ = run([keep])
    assert together["keep"] == solo["keep"]
    assert len(set(checks)) == 1 and len(checks) > 10
