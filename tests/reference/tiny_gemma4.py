"""Tiny random Gemma 4 GGUF files, written deterministically from a seed under llama.cpp's keys and names.

llama.cpp (src/models/gemma4.cpp, its loader `llama_model_gemma4::load_arch_hparams` / `load_arch_tensors`,
and its converter's `Gemma4Model`, whose keys and tensors these files copy) is these files' reference, exact on
F32 weights (`make_gemma4_golden.py`); transformers' `Gemma4ForCausalLM` is the other (`tiny_gemma4_hf`), on
layouts its config can express (not these: `attention_k_eq_v` takes V = K on every full layer, not on one).

Six layers of hidden 64 and 4 query heads: sliding (window 16, RoPE base 10000, head size 16, 2 KV heads) and
full (RoPE base 1e6, head size 32, 1 KV head, `rope_freqs` rotating only its first 4 of 16 pairs: the converter's
"proportional" RoPE with partial_rotary_factor 0.25) alternate, S F S F S F; the last two layers share the K/V of
layers 2 and 3 (`attention.shared_kv_layers` 2: llama.cpp's rule, the last full and the last sliding owning
layer), have no K/V tensors and a double-wide FFN (`feed_forward_length` as an array, as the converter writes
`use_double_wide_mlp`); layer 3 has no `attn_v` (V = K: attention_k_eq_v); every layer a `layer_output_scale`;
final logits capped at 30. `moe=True` adds to every layer 8 experts choosing 2 (width 32, fused
`ffn_gate_up_exps`), beside the dense FFN, with the router's input scale and a scale per expert, as the 26B-A4B
files hold them. Vocabulary: `tiny_gguf.add_byte_level_vocab`'s 260 tokens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tiny_gguf import add_byte_level_vocab, write_typed_tensors

VOCAB = 260
HIDDEN, HEADS, WINDOW = 64, 4, 16
SLIDING = (True, False, True, False, True, False)
HEAD_DIM_SWA, HEAD_DIM_FULL = 16, 32
KV_HEADS = tuple(2 if s else 1 for s in SLIDING)
SHARED_KV_LAYERS = 2
FFN = (96, 96, 96, 96, 192, 192)
NO_V_LAYERS = (3,)  # attention_k_eq_v: no attn_v, V = K
EXPERTS, EXPERTS_USED, EXPERT_FFN = 8, 2, 32
EMBED_SCALE = 0.5  # times sqrt(hidden) at the input: about unit rows, so greedy ids vary
ROTATED_FULL_PAIRS = 4  # of HEAD_DIM_FULL / 2: partial_rotary_factor 0.25


def gemma4_tensors(seed: int, moe: bool) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values (row-major `[out, in]`, experts outermost), drawn from `seed`: matrices
    N(0, 1/in) (Q and K N(0, 4/in), the embedding N(0, 0.25/in), the router N(0, 4/in)), norms 1 + N(0, 0.1),
    output and expert scales U(0.5, 1.5)."""
    rng = np.random.default_rng(seed)
    h = HIDDEN

    def mat(*shape: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal(shape) * scale / np.sqrt(shape[-1])

    def vec(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.standard_normal(n)

    unrotated = HEAD_DIM_FULL // 2 - ROTATED_FULL_PAIRS
    out = {"token_embd.weight": mat(VOCAB, h, scale=EMBED_SCALE), "output_norm.weight": vec(h),
           "rope_freqs.weight": np.array([1.0] * ROTATED_FULL_PAIRS + [1e30] * unrotated)}
    first_shared = len(SLIDING) - SHARED_KV_LAYERS
    for i, sliding in enumerate(SLIDING):
        d, kv, f = (HEAD_DIM_SWA if sliding else HEAD_DIM_FULL), KV_HEADS[i], FFN[i]
        layer = {"attn_norm": vec(h), "attn_q": mat(HEADS * d, h, scale=2.0), "attn_q_norm": vec(d),
                 "attn_output": mat(h, HEADS * d), "post_attention_norm": vec(h), "ffn_norm": vec(h),
                 "ffn_gate": mat(f, h), "ffn_up": mat(f, h), "ffn_down": mat(h, f), "post_ffw_norm": vec(h),
                 "layer_output_scale": rng.uniform(0.5, 1.5, 1)}
        if i < first_shared:
            layer |= {"attn_k": mat(kv * d, h, scale=2.0), "attn_k_norm": vec(d)}
            if i not in NO_V_LAYERS:
                layer["attn_v"] = mat(kv * d, h)
        if moe:
            layer |= {"ffn_gate_inp": mat(EXPERTS, h, scale=2.0), "ffn_gate_up_exps": mat(EXPERTS, 2 * EXPERT_FFN, h),
                      "ffn_down_exps": mat(EXPERTS, h, EXPERT_FFN), "pre_ffw_norm_2": vec(h),
                      "post_ffw_norm_1": vec(h), "post_ffw_norm_2": vec(h)}
        out |= {f"blk.{i}.{name}.weight": v for name, v in layer.items()}
        if moe:
            out[f"blk.{i}.ffn_gate_inp.scale"] = vec(h)
            out[f"blk.{i}.ffn_down_exps.scale"] = rng.uniform(0.5, 1.5, EXPERTS)
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def write_gemma4_gguf(path: Path, *, moe: bool = False, seed: int = 0, per_layer_embedding: int = 0,
                      ggml_type: str = "F32") -> Path:
    """The tiny Gemma 4 (see the module doc) as a GGUF file at `path`; the same bytes for the same arguments.
    Matrices as `ggml_type` (gguf's quantizer; `tiny_gguf._typed`), 1-D tensors and the router F32.
    `per_layer_embedding` > 0 writes an E2B/E4B-style `embedding_length_per_layer_input` (a file to refuse)."""
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_name(f"tiny-gemma4{'-moe' if moe else ''}")
    for add, value in [(writer.add_block_count, len(SLIDING)), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, list(FFN)),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, list(KV_HEADS)),
                       (writer.add_key_length, HEAD_DIM_FULL), (writer.add_value_length, HEAD_DIM_FULL),
                       (writer.add_key_length_swa, HEAD_DIM_SWA), (writer.add_value_length_swa, HEAD_DIM_SWA),
                       (writer.add_rope_dimension_count, HEAD_DIM_FULL),
                       (writer.add_rope_dimension_count_swa, HEAD_DIM_SWA),
                       (writer.add_rope_freq_base, 1000000.0), (writer.add_rope_freq_base_swa, 10000.0),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_sliding_window, WINDOW),
                       (writer.add_sliding_window_pattern, list(SLIDING)),
                       (writer.add_shared_kv_layers, SHARED_KV_LAYERS),
                       (writer.add_embedding_length_per_layer_input, per_layer_embedding),
                       (writer.add_final_logit_softcapping, 30.0), (writer.add_vocab_size, VOCAB)]:
        add(value)
    if moe:
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(EXPERTS_USED)
        writer.add_expert_feed_forward_length(EXPERT_FFN)
    add_byte_level_vocab(writer)
    write_typed_tensors(writer, gemma4_tensors(seed, moe), lambda name: ggml_type, np.random.default_rng(seed))
    return path
