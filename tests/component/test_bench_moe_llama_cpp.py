"""The qwen3-30b-a3b bench file against llama.cpp itself: its quantizer's types and its forward pass.

Marked `bench` (llama-cpp-python, the bench extra; `make test` deselects it), as
tests/component/test_llama_cpp_baseline.py. A missing llama_cpp is an error here, never a skip.
The shape is the tiny cut (16 experts of 256, 4 chosen, GQA 8) in 4 blocks, so `use_more_bits` gives
Q6_K to blocks 2 and 3 and Q4_K to blocks 0 and 1, with a 32,256-token vocabulary (deepseek-coder's).
References:
- the types: llama.cpp's own quantizer (`llama_model_quantize`, Q4_K_M and the other mixes) run on the F16
  file of the same shape, against `mixes.assign`, which the bench files are written with;
- the forward pass: llama.cpp's logits on the F16 file (exact weights; its F16 KV cache) and on the
  Q4_K_M file (its int8 activations: FACTS.md gives ~0.3 of log-prob at worst) against the torch runner's
  fp32 forward on gguf's dequantized weights. Measured: F16 KL 6.8e-6, top-1 16/16; Q4_K_M KL 0.012,
  top-1 16/16.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybridgate.bench import accuracy
from hybridgate.bench.mixes import MIXES, assign
from hybridgate.bench.model_files import bench_model, requantize
from hybridgate.bench.shapes import SHAPES

pytestmark = pytest.mark.bench

SHAPE = dataclasses.replace(SHAPES["qwen3-30b-a3b"].tiny(), layers=4, vocab="deepseek-coder", vocab_size=32256)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe-files")
    return {m: bench_model(SHAPE, MIXES[m], seed=3, progress=False, folder=folder) for m in ("F16", "Q4_K_M")}


@pytest.mark.parametrize("quant", ["Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "BF16"])
def test_llama_cpp_quantizer_agrees_on_every_mix(files, quant):
    import gguf

    got = requantize(files["F16"], MIXES[quant], folder=files["F16"].parent / quant)
    assert {t.name: t.tensor_type.name for t in gguf.GGUFReader(got).tensors} == \
        assign(MIXES[quant], SHAPE.tensors(), SHAPE.layers)


def test_llama_cpp_quantizer_gives_the_experts_the_types_of_the_table(files):
    import llama_cpp  # the bench extra: an ImportError here is the answer

    from hybridgate.models import load_gguf

    assert llama_cpp.__version__ == "0.3.36"  # the llama-quant.cpp whose rules `mixes` writes

    theirs = load_gguf(requantize(files["F16"], MIXES["Q4_K_M"], folder=files["F16"].parent))
    got = {n: t.ggml_type.name for n, t in theirs.tensors.items()}
    assert got == assign(MIXES["Q4_K_M"], SHAPE.tensors(), SHAPE.layers)
    assert [got[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert got["blk.0.ffn_gate_inp.weight"] == "F32" and got["blk.3.ffn_up_exps.weight"] == "Q4_K"
    ours = load_gguf(files["Q4_K_M"])
    assert {n: t.ggml_type.name for n, t in ours.tensors.items()} == got


@pytest.mark.parametrize("mix,top1,kl", [("F16", 1.0, 1e-4), ("Q4_K_M", 0.85, 0.05)])
def test_llama_cpp_runs_the_file_as_the_fp32_reference_does(files, mix, top1, kl):
    import torch

    from hybridgate.bench.llama_baseline import LlamaCppBaseline
    from hybridgate.models import load_gguf
    from hybridgate.workers.gpu.runner import TorchRunner

    rng = np.random.default_rng(0)
    cases = [{"prompt_ids": rng.integers(3, 32000, 12).tolist(), "ids": rng.integers(3, 32000, 8).tolist()}
             for _ in range(2)]
    reference = accuracy.teacher_forced_logits(
        TorchRunner(load_gguf(files[mix]), torch.device("cpu"), torch.float32, kv_cache_memory="64MiB"), cases)
    baseline = LlamaCppBaseline(files[mix], threads=1, max_seqs=2)
    try:
        theirs = baseline.teacher_forced_logits(cases)
    finally:
        baseline.close()
    figures = accuracy.compare(reference, theirs)
    assert float(reference.std()) > 1  # logits of a few units: the comparison can tell a wrong routing
    assert figures["positions"] == 16 and figures["top1_agreement"] >= top1 and figures["kl_mean"] <= kl, figures
