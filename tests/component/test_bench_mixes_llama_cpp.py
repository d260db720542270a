"""`make bench-check`: the quant mixes of `hybridgate.bench.mixes` against llama.cpp's own quantizer.

A random-weight F16 bench file of a shape (cut to a few blocks, a small vocabulary) is requantized by
`llama_model_quantize` into each mix, and the type llama.cpp gave every tensor (read back with gguf)
must be the one `mixes.assign` names. Needs llama-cpp-python (the bench extra, or a build's folder on
PYTHONPATH): marked `bench`, which `make test` deselects, since it does not build it.
"""

from __future__ import annotations

import dataclasses

import gguf
import pytest

from hybridgate.bench.mixes import MIXES, assign
from hybridgate.bench.model_files import bench_model, requantize
from hybridgate.bench.shapes import SHAPES

pytestmark = pytest.mark.bench
CASES = [("qwen2.5-0.5b", 8, "deepseek-coder", 32256), ("llama-3.2-1b", 3, "llama-spm", 32000)]


@pytest.mark.parametrize("name,layers,vocab,vocab_size", CASES)
@pytest.mark.parametrize("quant", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "BF16"])
def test_types_match_llama_cpp_quantizer(name, layers, vocab, vocab_size, quant, tmp_path_factory):
    import llama_cpp  # noqa: F401  (the bench extra: an ImportError here is the answer)

    folder = tmp_path_factory.getbasetemp() / "mixes"
    shape = dataclasses.replace(SHAPES[name], layers=layers, vocab=vocab, vocab_size=vocab_size)
    source = bench_model(shape, MIXES["F16"], progress=False, folder=folder)
    quantized = requantize(source, MIXES[quant], folder=folder / quant)
    got = {t.name: t.tensor_type.name for t in gguf.GGUFReader(quantized).tensors}
    assert got == assign(MIXES[quant], shape.tensors(), shape.layers)
