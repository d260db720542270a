"""The Numba runner on tiny GGUF files whose matrices are Q6_K, F16 or BF16, against the torch runner.

The files are `tiny_gguf.QUANT_SPEC` (llama, 256-wide rows so Q6_K's 256-weight blocks fit, a real
llama.cpp vocabulary) written by gguf's writer with every matrix (token embedding and LM head
included) in one type; test_architectures.py holds the torch runner to transformers on the same
files. Reference: the torch runner in fp32 (weights dequantized by gguf's dequantizer). The Numba
runner runs the tiled kernels (`quant.Q6KMatrix`, on the avx2 and avx512 paths `quant.Q6KSuperMatrix` with
int16 activations, `quant.FloatMatrix`), fp32 KV cache, in each
activation format its path offers: last-position logits of three prompts in one batch, and of the
same prompts one at a time (bit-equal: batch invariance through the whole model).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridgate.models import load_gguf
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = ("Q6_K", "F16", "BF16")
PROMPT_LENGTHS = (3, 17, 30)
# Largest logit difference (the logits' spread here: standard deviation 4.1, largest 27). Float32
# activations: 1e-3, as test_cpu_architectures (measured 2-7e-5). int16 ones (Q6_K's superblock kernel
# on the avx2 and avx512 paths) round every matmul input by up to 2^-16 of its 256-column super-block's
# largest value, 2^8 times float32's rounding, through every matmul of both layers and the LM head:
# measured 3.1-5.2e-3 on both paths, which differ only in summation order. 1e-2 is 0.25% of the
# logits' standard deviation; a wrong code, scale or column order moves them by about that deviation.
TOL = {"f32": 1e-3, "i16": 1e-2}


@pytest.fixture(scope="module", params=KINDS)
def case(request, tiny_models):
    model = load_gguf(tiny_models("quant", ggml_type=request.param))
    assert {t.ggml_type.name for t in model.tensors.values()} == {"F32", request.param}
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]
    from hybridgate.workers.gpu.model import DecoderModel

    ref = DecoderModel(model, torch.device("cpu"), torch.float32)
    ids = torch.tensor([i for p in prompts for i in p])
    want = ref.forward(ids, list(PROMPT_LENGTHS), [ref.new_cache() for _ in prompts]).numpy()
    return request.param, model, prompts, want


def _forward(runner, prompts: list[list[int]], first_block: int = 0) -> np.ndarray:
    seqs = []
    for i, ids in enumerate(prompts):
        s = Sequence(AddRequest(str(i), ids, SamplingParams(temperature=0), 0, 4, -1))
        s.block_table = [first_block + 2 * i, first_block + 2 * i + 1]
        seqs.append(s)
    return runner.forward(ScheduledBatch([(s, s.num_tokens) for s in seqs]))


@pytest.mark.parametrize("activations", ["f32", "auto"])
def test_numba_logits_match_the_torch_runner(case, activations):
    from hybridgate.workers.cpu import kernel_table, quant
    from hybridgate.workers.cpu.runner import NumbaRunner

    kind, model, prompts, want = case
    runner = NumbaRunner(model, kv_cache_memory="4MiB", threads=1, kv_cache_dtype="fp32", activations=activations)
    layer = runner.model.layers[0]
    # the class the kernel table gives the type on this path: on avx2, auto and i16 give Q6_K the superblock kernel
    fast = quant.FloatMatrix if kind != "Q6_K" else getattr(quant, kernel_table.choose(kind, activations, quant.PATH).matrix)
    for m in (layer.qkv, layer.wo, layer.gate_up, layer.down, runner.model.lm_head):
        assert type(m) is fast, (m.name, type(m).__name__)
    got = _forward(runner, prompts)
    tol = TOL[layer.down.activations]
    for n, row, ref in zip(PROMPT_LENGTHS, got, want):
        assert np.abs(row - ref).max() < tol, (kind, layer.down.activations, n, np.abs(row - ref).max())
        if np.diff(np.sort(ref)[-2:])[0] > 2 * tol:  # a clear top token is the same token
            assert row.argmax() == ref.argmax()
    for i, p in enumerate(prompts):  # alone, each prompt's logits are the batch's bits
        np.testing.assert_array_equal(_forward(runner, [p], first_block=8 + 2 * i)[0], got[i])
