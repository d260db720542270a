"""The bench's shape and quant-mix tables against llama.cpp's own numbers.

References:
- SmolLM2-135M requantized to Q4_K_M by llama.cpp's quantizer (llama_model_quantize, llama-cpp-python
  0.3.36; FACTS.md): F32 61, Q5_0 166, Q4_K 16, Q6_K 14, Q8_0 15.
- Llama 3.2 3B Q4_K_M as llama.cpp's loader reports it (rjmalagon/ollama-linux-amd-apu issue #19):
  f32 58, q4_K 168, q6_K 29.
- Parameter counts published with the models (Hugging Face model cards): Llama 3.2 1B 1,235,814,400,
  Llama 3.1 8B 8,030,261,248, Qwen2.5-0.5B 494,032,768 (plus Llama 3's rope_freqs: head_dim / 2).
- use_more_bits: llama-quant.cpp; layers 0, 1, 2, 5, 8, ..., 26-29 of 30 written out by hand.
- Qwen3-30B-A3B Q4_K_M (unsloth/Qwen3-30B-A3B-GGUF) as llama.cpp's loader reports it (a log quoted in an
  ik_llama.cpp issue thread, 2025-06-10): f32 241, q4_K 289, q6_K 49 tensors, 30.53 B parameters,
  file size 17.28 GiB.
"""

from collections import Counter

import gguf
import numpy as np
import pytest

from hybridgate.bench.mixes import MIXES, assign, mix, use_more_bits
from hybridgate.bench.shapes import SHAPES, shape


@pytest.fixture(scope="module")
def smollm2_tensors():
    from hybridgate.models import load_gguf
    from hybridgate.models.paths import default_model_path

    model = load_gguf(default_model_path())
    return {n: tuple(v.shape) for n, v in model.tensors.items()}


def test_smollm2_q4_k_m_counts_match_llama_cpp_quantizer(smollm2_tensors):
    types = assign(MIXES["Q4_K_M"], smollm2_tensors, 30)
    assert Counter(types.values()) == {"F32": 61, "Q5_0": 166, "Q4_K": 16, "Q6_K": 14, "Q8_0": 15}
    assert types["token_embd.weight"] == "Q8_0"  # tied LM head, 576 columns: not a multiple of 256
    assert types["blk.0.attn_v.weight"] == "Q8_0" and types["blk.3.attn_v.weight"] == "Q5_0"
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.3.ffn_down.weight"] == "Q4_K"


def test_llama_3_2_3b_q4_k_m_counts_match_llama_cpp_loader():
    s = SHAPES["llama-3.2-3b"]
    assert Counter(assign(MIXES["Q4_K_M"], s.tensors(), s.layers).values()) == {"F32": 58, "Q4_K": 168, "Q6_K": 29}


def test_use_more_bits_of_30_layers():
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


@pytest.mark.parametrize("name", ["Q6_K", "Q8_0", "F16", "BF16"])
def test_uniform_mixes(name):
    s = SHAPES["llama-3.2-1b"]
    types = assign(MIXES[name], s.tensors(), s.layers)
    matrices = {n: t for n, t in types.items() if len(s.tensors()[n]) == 2}
    lm_head = {"Q6_K": "Q6_K", "Q8_0": "Q8_0", "F16": "F16", "BF16": "BF16"}[name]
    assert matrices.pop("token_embd.weight") == lm_head
    assert set(matrices.values()) == {MIXES[name].default}
    assert {t for n, t in types.items() if len(s.tensors()[n]) == 1} == {"F32"}


def test_qwen_rows_of_896_fall_back():
    s = SHAPES["qwen2.5-0.5b"]
    types = assign(MIXES["Q4_K_M"], s.tensors(), s.layers)
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.5.attn_q.weight"] == "Q5_0"  # 896 columns: Q4_K -> Q5_0
    assert types["blk.0.attn_v.weight"] == "Q8_0"  # more bits: Q6_K -> Q8_0
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.4.ffn_down.weight"] == "Q4_K"  # 4864 columns


@pytest.mark.parametrize("name,params", [("llama-3.2-1b", 1_235_814_400 + 32), ("llama-3.1-8b", 8_030_261_248 + 64),
                                         ("qwen2.5-0.5b", 494_032_768)])
def test_parameter_counts(name, params):
    assert shape(name).parameters == params


def test_llama_3_2_1b_tensor_shapes():
    t = SHAPES["llama-3.2-1b"].tensors()
    assert t["token_embd.weight"] == (128256, 2048) and "output.weight" not in t
    assert t["blk.15.attn_k.weight"] == (512, 2048) and t["blk.15.ffn_down.weight"] == (2048, 8192)
    assert list(t)[:2] == ["token_embd.weight", "rope_freqs.weight"] and list(t)[-1] == "output_norm.weight"


def test_llama3_rope_divisors():
    # Meta's apply_scaling at theta 500000, head_dim 64, factor 32, low 1, high 4, original 8192:
    # wavelengths under 2048 keep their frequency, over 8192 are divided by 32.
    d = SHAPES["llama-3.2-1b"].rope_scaling.freq_divisors(64, 500000.0)
    wavelen = 2 * np.pi * 500000.0 ** (np.arange(0, 64, 2) / 64)
    assert np.all(d[wavelen < 2048] == 1.0) and np.all(d[wavelen > 8192] == 32.0)
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    smooth = (8192 / wavelen[mid] - 1) / 3
    np.testing.assert_allclose(d[mid], 1 / ((1 - smooth) / 32 + smooth), rtol=1e-6)


def test_unknown_names_are_named():
    with pytest.raises(ValueError, match="shape: expected one of llama-3.2-1b"):
        shape("llama-9b")
    with pytest.raises(ValueError, match="quant mix: expected one of Q4_K_M"):
        mix("Q3_K_S")
    with pytest.raises(ValueError, match="layers: expected 1 to 16"):
        SHAPES["llama-3.2-1b"].with_layers(17)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b"])
def test_tiny_keeps_the_family_head_group_and_lm_head(name):
    real, tiny = shape(name), shape(name).tiny()
    assert (tiny.arch, tiny.tied, tiny.rope_scaling, tiny.rope_theta) == \
        (real.arch, real.tied, real.rope_scaling, real.rope_theta)
    assert tiny.heads // tiny.kv_heads == real.heads // real.kv_heads and tiny.kv_heads == 2
    assert (tiny.layers, tiny.head_dim, tiny.vocab_size, tiny.hidden) == (2, 16, 512, tiny.heads * 16)
    assert tiny.name == f"{name}-tiny"


def test_qwen3_30b_a3b_q4_k_m_counts_match_llama_cpp_loader():
    s = SHAPES["qwen3-30b-a3b"]
    types = assign(MIXES["Q4_K_M"], s.tensors(), s.layers)
    assert Counter(types.values()) == {"F32": 241, "Q4_K": 289, "Q6_K": 49}
    assert round(s.parameters / 1e9, 2) == 30.53
    # the router is never quantized; ffn_down_exps takes use_more_bits by the layer in its name
    assert types["blk.9.ffn_gate_inp.weight"] == "F32" and types["blk.9.ffn_gate_exps.weight"] == "Q4_K"
    assert [i for i in range(48) if types[f"blk.{i}.ffn_down_exps.weight"] == "Q6_K"] == \
        [i for i in range(48) if use_more_bits(i, 48)]
    assert s.tensors()["blk.0.ffn_down_exps.weight"] == (128, 2048, 768)
    sizes = {n: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]] for n, t in types.items()}
    tensor_bytes = sum(int(np.prod(shape)) // sizes[n][0] * sizes[n][1] for n, shape in s.tensors().items())
    assert round(tensor_bytes / 2**30, 2) == 17.28  # the metadata (tokenizer) is the rest of the file


def test_tiny_keeps_the_experts():
    tiny = shape("qwen3-30b-a3b").tiny()
    assert (tiny.arch, tiny.experts, tiny.experts_used, tiny.expert_ffn, tiny.hidden) == ("qwen3moe", 16, 4, 256, 256)
    assert tiny.config().num_experts == 16 and tiny.tensors()["blk.1.ffn_up_exps.weight"] == (16, 256, 256)


def test_eight_experts_are_refused():
    s = SHAPES["qwen3-30b-a3b"]
    eight = type(s)(**{**s.__dict__, "experts": 8, "experts_used": 2, "layers": 2})
    with pytest.raises(ValueError, match="8 experts"):
        assign(MIXES["Q4_K_M"], eight.tensors(), eight.layers)
