"""The Numba runner behind the shared engine: logits against transformers (golden), greedy ids,
one pass over each weight matrix per step whatever the batch."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import bf16_rounded, golden_json, golden_npz
from hybridgate.models import model_fingerprint
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.cpu.runner import NumbaRunner
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.handoff_checks import KVLayout
from hybridgate.workers.scheduler import ScheduledBatch, SchedulerConfig
from hybridgate.workers.sequence import Sequence

LOGITS = golden_npz("logits.npz")


@pytest.fixture(scope="module")
def runner(gguf_model):
    # An fp32 KV cache and float32 activations: these tests hold the kernels to the fp32 reference. The
    # defaults (fp16 cache; int16 activations wherever `auto` measured them faster, every weight type on
    # the avx2 path: logits 6e-3 off here) are held to the accuracy floor in test_accuracy.py.
    r = NumbaRunner(gguf_model, kv_cache_memory="128MiB", threads=1, kv_cache_dtype="fp32", activations="f32")
    r.warm_up(progress=False)
    return r


def test_logits_match_the_reference(runner):
    # Weights are dequantized exactly and activations stay float32, so the fp32 reference holds closely.
    seqs = []
    for i in range(3):
        s = Sequence(AddRequest(str(i), LOGITS[f"short{i}_ids"].tolist(), SamplingParams(temperature=0), 0, 4, 2))
        s.block_table = list(range(i * 4, i * 4 + 4))
        seqs.append(s)
    got = runner.forward(ScheduledBatch([(s, s.num_tokens) for s in seqs]))
    for i in range(3):
        assert np.abs(got[i] - LOGITS[f"short{i}_logits"]).max() < 2e-3


def weight_matrices(model) -> list:
    """The matrices a forward pass multiplies by: each layer's (a dict or a dataclass of parts), the LM head."""
    out = []
    for layer in model.layers:
        parts = layer.values() if isinstance(layer, dict) else [getattr(layer, f) for f in layer.__dataclass_fields__]
        out += [p for p in parts if hasattr(p, "matmul")]
    return out + [model.lm_head]


def test_greedy_france_and_one_pass_over_the_weights_per_step(runner, gguf_model, monkeypatch):
    """Greedy ids equal the reference's among 8 other requests, and every step multiplies by each weight
    matrix once whatever its batch: (4 per layer: fused QKV, output, fused gate-up, down) + the LM head."""
    engine = EngineCore(runner, SchedulerConfig(), model_fingerprint(gguf_model))
    france = golden_json("greedy.json")["france"]
    engine.add(AddRequest("fr", france["prompt_ids"], SamplingParams(temperature=0), 0, 16, 2))
    for k in range(8):
        engine.add(AddRequest(f"x{k}", france["prompt_ids"][:10 + k], SamplingParams(temperature=0, ignore_eos=True),
                              0, 6, 2))
    matrices = {id(m): m for m in weight_matrices(runner.model)}
    calls: list[int] = []
    for m in matrices.values():
        monkeypatch.setattr(m, "matmul", lambda x, out=None, f=m.matmul: (calls.append(x.shape[0]), f(x, out))[1])
    out, per_step, batches = [], [], []
    while engine.has_work():
        calls.clear()
        stepped = engine.step()
        per_step.append(len(calls))
        batches.append(calls[-1])  # the LM head's rows: one per sequence of the step
        out += [i for s in stepped if s.request_id == "fr" for i in output_of(s).token_ids]
    assert out == france["ids"]
    assert per_step == [4 * gguf_model.config.num_layers + 1] * len(per_step)
    assert max(batches) == 9 and min(batches) >= 1  # all nine requests shared steps


def test_logits_are_bitwise_equal_alone_and_in_a_batch_of_8(runner):
    prompts = [LOGITS[f"short{i % 3}_ids"].tolist()[: 5 + i] for i in range(8)]
    seqs = []
    for i, ids in enumerate(prompts):
        s = Sequence(AddRequest(str(i), ids, SamplingParams(temperature=0), 0, 4, 2))
        s.block_table = [2 * i, 2 * i + 1]
        seqs.append(s)
    # Prefill: the first request alone, then all eight in one step (its KV written again, identically).
    alone = runner.forward(ScheduledBatch([(seqs[0], seqs[0].num_tokens)]))
    batch = runner.forward(ScheduledBatch([(s, s.num_tokens) for s in seqs]))
    np.testing.assert_array_equal(alone[0], batch[0])
    for s in seqs:
        s.num_computed = s.num_tokens
        s.append(int(batch[0].argmax()))
    # Decode: the same step alone and among eight.
    alone = runner.forward(ScheduledBatch([(seqs[0], 1)]))
    batch = runner.forward(ScheduledBatch([(s, 1) for s in seqs]))
    np.testing.assert_array_equal(alone[0], batch[0])
    assert not np.array_equal(batch[0], batch[1])  # the rows are different requests


def test_16_bit_caches_hold_twice_the_blocks_in_the_same_memory(gguf_model):
    c = gguf_model.config
    float32_block = 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4  # K and V, every layer, 16 tokens
    memory = str(20 * float32_block)
    blocks, held = {}, {}
    for name in ("fp32", "fp16", "bf16"):
        r = NumbaRunner(gguf_model, kv_cache_memory=memory, threads=1, kv_cache_dtype=name)
        blocks[name] = r.num_blocks
        held[name] = sum(a.nbytes for a in r.k_cache + r.v_cache) // (r.num_blocks + 1)  # + 1: the scratch block
    assert blocks == {"fp32": 20, "fp16": 40, "bf16": 40}
    assert held == {"fp32": float32_block, "fp16": float32_block // 2, "bf16": float32_block // 2}


@pytest.mark.parametrize(("name", "wire", "rounded"), [
    ("fp16", "float16", lambda x: x.astype(np.float16).astype(np.float32)),
    ("bf16", "bfloat16", bf16_rounded),
])
def test_import_into_a_16_bit_cache_stores_the_rounded_values(gguf_model, name, wire, rounded):
    runner = NumbaRunner(gguf_model, kv_cache_memory="16MiB", threads=1, kv_cache_dtype=name)
    assert runner.kv_layout() == KVLayout(tuple(range(30)), ((3, 64),) * 30, wire)  # the file's 30 layers
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((2, 21, 3, 64)) * 4).astype(np.float32)
    runner.import_kv([7, 2], 11, k, v)
    got_k, got_v = runner.read_kv([7, 2], 11, 21)
    assert got_k.dtype == got_v.dtype == np.float32
    np.testing.assert_array_equal(got_k, rounded(k))
    np.testing.assert_array_equal(got_v, rounded(v))
    assert not np.array_equal(got_k, k)


def test_weight_bytes_held_are_at_most_1_25x_the_gguf_tensors(gguf_model):
    import mmap

    tensor_bytes = sum(t.data.nbytes for t in gguf_model.tensors.values())
    runner = NumbaRunner(gguf_model, kv_cache_memory="16MiB", threads=1)
    seen: set[int] = set()

    def arrays(obj):  # every numpy array reachable from the model object, counted once
        if isinstance(obj, np.ndarray):
            if id(obj) not in seen:
                seen.add(id(obj))
                yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from arrays(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from arrays(v)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):  # kernels: no weights
            yield from arrays(vars(obj))

    def maps_the_file(a) -> bool:
        while a is not None:
            if isinstance(a, (np.memmap, mmap.mmap)):
                return True
            a = getattr(a, "base", None)
        return False

    held = list(arrays(runner.model))
    assert not any(maps_the_file(a) for a in held)  # copies: the GGUF can be unmapped once loaded
    held_bytes = sum(a.nbytes for a in held)
    assert held_bytes == runner.model.weight_bytes
    assert held_bytes <= 1.25 * tensor_bytes, (held_bytes, tensor_bytes)
