"""Gemma 4 on both runners against transformers' `Gemma4ForCausalLM` on the same random weights.

transformers 5.25 (installed here) has Gemma 4 (`Gemma4ForCausalLM`, `Gemma4TextConfig`); the reference is
that model itself, text only, fp32, eager attention, made with random weights in `tiny_gemma4_hf.make_gemma4`
and written to GGUF as llama.cpp's converter writes it (`write_gemma4_hf_gguf`). Sliding and full layers
alternate with their own head sizes (16, 32) and RoPE (base 1e4; base 1e6 "proportional", a quarter of the
pairs rotated); the last two layers read the K/V of layers 2 and 3 and have a double-wide FFN; V RMS-normed
without a weight; a `layer_scalar` per layer; the final softcap. The dense file has E2B/E4B's attention (every
owning layer has its V, 2 KV heads everywhere); the MoE file 26B-A4B's (`attention_k_eq_v`: full layers take
V = K and have 1 KV head) and 8 experts choosing 2 beside every dense FFN, with the router's input scale and
the per-expert scales. Per file: last-position logits of three packed prompts within 1e-3 on both runners;
greedy ids for 16 tokens equal (or the first difference where the reference's top-2 gap is below 1e-3)
through the paged cache with chunked prefill (the 16-token windows start mid-chunk) and a prefix-cache hit on
both runners, and through a GPU→CPU hand-off (torch prefill, Numba decode). The per-layer layout read from the
file is transformers' (head sizes, KV heads, which layer's K/V each layer reads, V = K, FFN widths, scalars, RoPE
frequencies).

transformers and llama.cpp (src/models/gemma4.cpp) compute the same graph on these files but for llama.cpp's
CPU GELU, read from an fp16 table; transformers' `gelu_pytorch_tanh` is exact, as both runners are (here within
1e-5 of it). Checked once with llama-cpp-python 0.3.36 (F32 cache, one thread) on the files written here:
its last-position logits 1.7e-3 (dense) and 3.7e-3 (MoE) from transformers', 9e-4 at most once transformers
reads llama.cpp's table (`gemma4_numpy.gelu_fp16_table`), the same argmax. Where the two part: which earlier
layer a K/V-sharing layer reads. transformers takes the last owning layer of its own kind
(`Gemma4TextConfig.kv_sharing_modes`); llama.cpp fixed offsets from the first sharing layer (src/llama-model.cpp's
`reuse` callback: 2 back for a sliding layer, 1 back for a full one). They agree wherever the last layer before
the sharing ones is full and the one before it sliding, as in the files above; on a layout where the offsets
cross kinds llama.cpp aborts creating its KV cache (llama-kv-cache.cpp: `GGML_ASSERT(map_layer_ids.find(il_reuse)
!= map_layer_ids.end())`), and the runners follow transformers (the last test).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridgate.models import load_gguf
from hybridgate.workers.gpu.model import DecoderModel
# qwen3moe's tests of logits (within 1e-3, packed) and of greedy ids through chunked prefill and the prefix cache
# (every block back), run here on this module's `case` (they read only its fields).
from test_moe import TOL, Case, hf_logits, numba_packed, numba_runner, torch_packed
from test_moe import test_greedy_through_chunked_prefill_and_the_prefix_cache
from test_moe import test_numba_runner_logits_match_transformers, test_torch_runner_logits_match_transformers
# The GPU→CPU hand-off test of every family, here held to transformers' greedy ids; the dense file's owning layers
# differ in bytes per token (2 KV heads of 16 or 32), so the export packs frames of two sizes.
from test_cpu_architectures import test_a_gpu_to_cpu_handoff_decodes_the_ids_of_the_cpu_runner_alone as \
    test_a_gpu_to_cpu_handoff_decodes_transformers_ids
from test_cpu_architectures import torch_engine
from tiny_gemma4_hf import make_gemma4, write_gemma4_hf_gguf

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

# collected here under these names (torch_engine: the hand-off test's fixture)
REUSED = (test_greedy_through_chunked_prefill_and_the_prefix_cache, test_numba_runner_logits_match_transformers,
          test_torch_runner_logits_match_transformers, test_a_gpu_to_cpu_handoff_decodes_transformers_ids,
          torch_engine)


@pytest.fixture(scope="module", params=["dense", "moe"])
def case(request, tmp_path_factory) -> Case:
    hf = make_gemma4(moe=request.param == "moe")
    return Case(hf, write_gemma4_hf_gguf(hf, tmp_path_factory.mktemp("gemma4hf") / f"gemma4-{request.param}.gguf"))


def kv_sources(config) -> tuple[int, ...]:
    """transformers' choice of the layer whose K/V each layer attends over: a `reuse` layer reads the `store`
    layer of its own type (`Gemma4TextAttention.forward`'s `shared_kv_states[self.layer_type]`)."""
    modes, types = config.kv_sharing_modes, config.layer_types
    store = {types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    return tuple(store[types[i]] if mode == "reuse" else i for i, mode in enumerate(modes))


def test_the_file_reads_as_transformers_model(case):
    hf, c = case.hf, case.gguf.config
    layers = hf.model.layers
    attn = [layer.self_attn for layer in layers]
    assert c.layer_kv_source == kv_sources(hf.config)
    assert c.layer_head_dims == tuple(a.head_dim for a in attn)
    assert c.layer_kv_heads == tuple(c.num_heads // a.num_key_value_groups for a in attn)
    assert c.layer_windows == tuple(a.sliding_window or 0 for a in attn)
    qkv = [("attn_q",) if a.is_kv_shared_layer else ("attn_q", "attn_k", "attn_k" if a.v_proj is None else "attn_v")
           for a in attn]
    assert c.layer_qkv == tuple(qkv)
    assert c.layer_intermediate_sizes == tuple(layer.mlp.intermediate_size for layer in layers)
    np.testing.assert_allclose(c.layer_output_scales, [float(layer.layer_scalar) for layer in layers], rtol=1e-7)
    assert {a.scaling for a in attn} == {c.attention_scale} and c.final_softcap == hf.config.final_logit_softcapping
    assert (c.num_experts, c.experts_per_token) == ((8, 2) if layers[0].enable_moe_block else (0, 0))
    # RoPE: transformers' inverse frequencies per layer type ("proportional": zero past the rotated pairs), ours
    # from the base, the head size and, on full layers, `rope_freqs` (1e30 past the rotated pairs)
    rotary, factors = hf.model.rotary_emb, np.asarray(c.rope_freq_factors)
    for i, kind in enumerate(hf.config.layer_types):
        d = c.layer_head_dims[i]
        ours = 1.0 / c.layer_rope_theta[i] ** (np.arange(0, d, 2) / d) / (factors if c.layer_rope_factors[i] else 1)
        np.testing.assert_allclose(ours, getattr(rotary, f"{kind}_inv_freq").numpy(), rtol=2e-6, atol=1e-20)


def test_shared_layers_read_the_kv_transformers_names_where_llama_cpps_offsets_would_not(tmp_path):
    # Layers S S F S | S F, the last two sharing: transformers' sliding layer 4 reads layer 3, its full layer 5
    # layer 2; llama.cpp's offsets name layer 2 (full, head size 32) for layer 4 and layer 3 (sliding) for layer 5,
    # and it aborts. Both runners follow transformers, logits within 1e-3.
    hf = make_gemma4(sliding=(True, True, False, True, True, False))
    model = load_gguf(write_gemma4_hf_gguf(hf, tmp_path / "crossed.gguf"))
    assert model.config.layer_kv_source == kv_sources(hf.config) == (0, 1, 2, 3, 3, 2)
    prompts = [np.random.default_rng(3).integers(0, hf.config.vocab_size, size=n).tolist() for n in (9, 40)]
    want = hf_logits(hf, prompts)
    for got in (torch_packed(DecoderModel(model, torch.device("cpu"), torch.float32), prompts),
                numba_packed(numba_runner(model), prompts)):
        err = np.abs(got - want).max(axis=1)
        assert (err < TOL).all(), err
