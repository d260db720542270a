"""The Numba runner with its prompt kernels (`amx`'s bf16 tiles, `int8`'s int8 GEMM) on tiny K-quant GGUF
files, against the torch runner.

Runs with AMX where the kernels were compiled with it (a Xeon since Sapphire Rapids), with int8 on the avx2
and avx512 paths; skipped on the generic path. The files are `tiny_gguf.QUANT_SPEC`
(llama, rows of 256) with every matrix Q4_K or Q6_K. Prompts of at least the table's length (32) run
their matmuls on the prompt kernel, shorter ones and generated tokens on the int16 kernels; so checked
here: logits against the fp32 torch runner (for AMX's rows, on the same weights rounded to bf16 as the
tiles round them), a batch mixing both kinds of rows giving each prompt the bits it has alone, a prompt
chunked in two giving the bits of one chunk, a sequence recomputed after decoding (a preemption's
recompute) giving the bits of its decode steps, and a resumed stream (its generated ids replayed as the
tail of its prompt, `first_token_index`) giving them too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridgate.models import load_gguf
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.cpu import isa
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence

KERNEL = "amx" if isa.selected().amx else "int8" if isa.selected().isa in ("avx2", "avx512") else None
pytestmark = [pytest.mark.skipif(KERNEL is None, reason="no prompt kernel on the generic path"),
              pytest.mark.usefixtures("one_torch_thread")]

PROMPT_LENGTHS = (40, 24, 33)  # two on the prompt kernel, one (under its 32 tokens) on the int16 kernels
ON_TILES = (True, False, True)
# Largest logit difference against the fp32 reference (the logits' spread: standard deviation 4.2-4.8),
# as test_cpu_q6k_half_model.py's for int16 activations: measured 5.6-8.6e-4 for the tiles' rows against the
# reference on bf16-rounded weights (the activations' split and float32 sums), 4.0-4.4e-3 for the int16 row
# against the plain one. Against the plain reference the tiles' rows differ by 0.11-0.27: this random
# two-layer model amplifies a matmul's error about 20 times (the int16 kernels' 3e-5 of a matmul's largest
# output gives their 4e-3), and bf16 weights err by 1.5e-3 of it. A wrong code, scale, row or column moves
# the logits by about their deviation.
# int8 activations per 32 columns round about 250 times coarser than int16 per 256 (max|x_b| / 254 against
# max|x_s| / 65534), amplified as above: measured up to 1.03 (Q6_K, the 40-token prompt) on this model, so
# 1.5 for their rows, a third of the deviation.
TOL = {"amx": 1e-2, "int8": 1.5}


def rounded_to_bf16(model):
    """The model with every layer matrix (what the tiles multiply) dequantized, rounded to bf16 and stored
    as F32: the tiles' weights, for the torch reference."""
    import dataclasses

    import gguf

    from hybridgate.models.gguf_file import TensorView
    from tests.unit.test_cpu_amx import bf16

    tensors = dict(model.tensors)
    for name, t in model.tensors.items():
        if name.startswith("blk.") and t.ggml_type.name not in ("F32", "F16", "BF16"):
            w = bf16(t.dequantize()).astype(np.float32)
            data = w.view(np.uint8).reshape(t.shape[0], -1)
            tensors[name] = TensorView(name, gguf.GGMLQuantizationType.F32, t.shape, data)
    return dataclasses.replace(model, tensors=tensors)


@pytest.fixture(scope="module", params=("Q4_K", "Q6_K"))
def case(request, tiny_models):
    from hybridgate.workers.cpu import kernel_table, quant
    from hybridgate.workers.cpu.runner import NumbaRunner
    from hybridgate.workers.gpu.model import DecoderModel

    if not kernel_table.choose(request.param, "auto", quant.PATH).prompt_kernel:
        pytest.skip(f"{request.param} has no prompt kernel on the {quant.PATH} path (kernel_table)")
    assert PROMPT_LENGTHS[1] < 32 <= min(PROMPT_LENGTHS[0], PROMPT_LENGTHS[2])
    model = load_gguf(tiny_models("quant", ggml_type=request.param))
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]
    ids = torch.tensor([i for p in prompts for i in p])
    want = []
    for weights in (rounded_to_bf16(model) if KERNEL == "amx" else model, model):
        ref = DecoderModel(weights, torch.device("cpu"), torch.float32)
        want.append(ref.forward(ids, list(PROMPT_LENGTHS), [ref.new_cache() for _ in prompts]).numpy())
    want = np.where(np.array(ON_TILES)[:, None], *want)  # each row against the weights its kernels multiply
    runner = NumbaRunner(model, kv_cache_memory="4MiB", threads=1, kv_cache_dtype="fp32")
    assert runner.long_prompt == 32
    assert runner.model.layers[0].wo.prompt_kernel == f"{KERNEL}.multiply"
    return request.param, runner, prompts, want


def _seqs(prompts: list[list[int]], first_block: int) -> list[Sequence]:
    seqs = []
    for i, ids in enumerate(prompts):
        s = Sequence(AddRequest(str(i), ids, SamplingParams(temperature=0), 0, 8, -1))
        s.block_table = [first_block + 4 * i + j for j in range(4)]
        seqs.append(s)
    return seqs


def test_logits_match_the_torch_runner_and_each_prompt_has_its_bits_alone(case):
    kind, runner, prompts, want = case
    seqs = _seqs(prompts, 0)
    got = runner.forward(ScheduledBatch([(s, s.num_tokens) for s in seqs]))
    for n, row, ref, tiles in zip(PROMPT_LENGTHS, got, want, ON_TILES):
        tol = TOL[KERNEL] if tiles else TOL["amx"]
        assert np.abs(row - ref).max() < tol, (kind, n, np.abs(row - ref).max())
        if np.diff(np.sort(ref)[-2:])[0] > 2 * tol:  # a clear top token is the same token
            assert row.argmax() == ref.argmax()
    for i, p in enumerate(prompts):  # alone, each prompt's logits are the batch's bits
        (s,) = _seqs([p], 16 + 4 * i)
        np.testing.assert_array_equal(runner.forward(ScheduledBatch([(s, s.num_tokens)]))[0], got[i])


def test_a_chunked_prompt_and_a_recompute_after_decoding_give_the_same_bits(case):
    _, runner, prompts, _ = case
    (whole,) = _seqs(prompts[:1], 0)
    one = runner.forward(ScheduledBatch([(whole, whole.num_tokens)]))[0]
    (chunked,) = _seqs(prompts[:1], 4)
    runner.forward(ScheduledBatch([(chunked, 16)]))  # 16 prompt tokens, then the other 24
    chunked.num_computed = 16
    np.testing.assert_array_equal(runner.forward(ScheduledBatch([(chunked, 24)]))[0], one)
    # two decode steps after the prompt (ids forced), then the whole sequence again as one prefill: the
    # generated tokens stay on the int16 kernels there too, so the last logits are the decode step's bits
    whole.num_computed = whole.num_tokens
    decoded = None
    for token in (5, 7):
        whole.append(token)
        decoded = runner.forward(ScheduledBatch([(whole, 1)]))[0]
        whole.num_computed += 1
    (again,) = _seqs(prompts[:1], 8)
    again.output_ids = list(whole.output_ids)
    np.testing.assert_array_equal(runner.forward(ScheduledBatch([(again, again.num_tokens)]))[0], decoded)
    # a resumed stream: the prompt plus the two ids streamed, first_token_index 2; its replayed ids are not
    # prompt rows, so its last logits are the decode step's bits too
    (resumed,) = _seqs([prompts[0] + list(whole.output_ids)], 12)
    resumed.first_token_index = 2
    np.testing.assert_array_equal(runner.forward(ScheduledBatch([(resumed, resumed.num_tokens)]))[0], decoded)
