"""The Numba runner on the default model requantized into a mix of every type gguf can write.

Each linear weight of the default model is dequantized and quantized again by
gguf's own quantizer (`gguf.quants.quantize`) into one of seven types, rotating
by layer and role, so the Q, K and V of every layer (and its gate and up) are
of different types: the fused matrices of a Q4_K_M file, whose parts the CPU
worker once refused. The torch runner on the same weights (dequantized by
gguf's dequantizer, fp32) is the reference; the floor is `bench accuracy`'s
(tests/component/test_accuracy.py). The K-quants, which gguf cannot write, are
covered block by block in tests/unit/test_cpu_kernels.py.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from hybridgate.bench import accuracy
from hybridgate.models.gguf_file import TensorView

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOP1_FLOOR, KL_CEILING = 0.995, 1e-4  # as test_accuracy: the floor against the fp32 reference
TYPES = ["Q5_0", "Q8_0", "Q4_0", "Q5_1", "F16", "BF16", "Q4_1"]
ROLES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


def requantized(model, types: list[str]):
    """The model with blk.i.ROLE.weight in types[(i + j) % len(types)] (ROLES[j]); the rest unchanged."""
    tensors = dict(model.tensors)
    for i in range(model.config.num_layers):
        for j, role in enumerate(ROLES):
            t = tensors[f"blk.{i}.{role}.weight"]
            kind = gguf.GGMLQuantizationType[types[(i + j) % len(types)]]
            data = np.ascontiguousarray(gguf.quants.quantize(t.dequantize(), kind)).view(np.uint8)
            tensors[t.name] = TensorView(t.name, kind, t.shape, data.reshape(t.shape[0], -1))
    return dataclasses.replace(model, tensors=tensors)


@pytest.fixture(scope="module")
def mixed_model(gguf_model):
    return requantized(gguf_model, TYPES)


def test_numba_runner_on_a_mix_of_types_meets_the_accuracy_floor(mixed_model):
    import torch

    from hybridgate.workers.cpu.fused import FusedMatrix
    from hybridgate.workers.cpu.runner import NumbaRunner
    from hybridgate.workers.gpu.runner import TorchRunner

    kinds = {t.ggml_type.name for t in mixed_model.tensors.values()}
    assert set(TYPES) <= kinds
    # 4 of bench accuracy's cases, 16 committed ids each: 64 positions in 16 steps (the whole file's
    # 512 in 64 steps is test_accuracy's, on the default model); an fp32 KV cache, so that the two
    # runners differ only in their kernels' arithmetic (top-1 1.0 and mean KL 1.2e-8 on 128 positions)
    cases = [dict(c, ids=c["ids"][:16]) for c in accuracy.load_cases()[:4]]
    reference = accuracy.teacher_forced_logits(
        TorchRunner(mixed_model, torch.device("cpu"), torch.float32, kv_cache_memory="128MiB"), cases)
    runner = NumbaRunner(mixed_model, kv_cache_memory="128MiB", kv_cache_dtype="fp32")
    layer = runner.model.layers[0]
    assert isinstance(layer.qkv, FusedMatrix) and isinstance(layer.gate_up, FusedMatrix)
    assert [p.kind for p in layer.qkv.parts] == [int(gguf.GGMLQuantizationType[k]) for k in TYPES[:3]]
    figures = accuracy.compare(reference, accuracy.teacher_forced_logits(runner, cases))
    assert figures["positions"] == 64
    assert figures["top1_agreement"] >= TOP1_FLOOR and figures["kl_mean"] <= KL_CEILING, figures
