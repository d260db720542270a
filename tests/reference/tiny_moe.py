"""A tiny random Qwen3 MoE made in transformers (`Qwen3MoeForCausalLM`, fp32) and written as GGUF.

The model is the reference itself (no GGUF loader between it and the file): its weights are drawn
here, then written under llama.cpp's names and layouts (`convert_hf_to_gguf.py`'s `Qwen3MoeModel`:
`mlp.gate` -> `ffn_gate_inp`, the experts' 3-D `gate_up_proj` split into `ffn_gate_exps` and
`ffn_up_exps` `[experts, expert_ffn, hidden]`, `down_proj` -> `ffn_down_exps`; Q/K rows as they are,
qwen3's RoPE being NEOX). Vocabulary: `write_tiny_llama`'s 260 byte-level tokens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from tiny_gguf import add_byte_level_vocab, write_typed_tensors

VOCAB = 260


def make_qwen3moe(*, experts: int = 8, top_k: int = 2, layers: int = 2, hidden: int = 64, heads: int = 4,
                  kv_heads: int = 2, head_dim: int = 16, expert_ffn: int = 32, seed: int = 0):
    """transformers' `Qwen3MoeForCausalLM` (fp32, eager attention, eval) with weights drawn from `seed`:
    matrices N(0, 1/in) (the router's N(0, 4/in), so its choices are clear-cut), norms 1 + N(0, 0.1)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, moe_intermediate_size=expert_ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                scale = 2.0 if name.endswith("mlp.gate.weight") else 1.0
                p.copy_(torch.randn_like(p) * scale / p.shape[-1] ** 0.5)
    return model


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values (row-major, `[out, in]`, experts outermost) of a `Qwen3MoeForCausalLM`."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    fe = model.config.moe_intermediate_size
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.experts.down_proj": "ffn_down_exps"}
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, ours in names.items():
            out[f"blk.{i}.{ours}.weight"] = sd[p + hf + (".weight" if "experts" not in hf else "")]
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [experts, 2 expert_ffn, hidden]: gate rows first
        out[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :fe]
        out[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, fe:]
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def write_qwen3moe_gguf(model, path: Path, ggml_type: str = "F32", arch: str = "qwen3moe", seed: int = 0) -> Path:
    """`model` as a GGUF file: matrices and expert tensors as `ggml_type` (`tiny_gguf.write_tiny_model`'s
    types: F32, F16, BF16 and gguf's quantized ones hold the model's weights; Q4_K, Q5_K and Q6_K, which
    gguf cannot quantize, are random blocks of the same size drawn from `seed`, so such a file is no
    longer `model`); rows that do not fit the type's blocks, norms and the router stay F32 (llama.cpp's
    quantizer leaves `ffn_gate_inp` unquantized). `arch` other than qwen3moe writes the same tensors
    under that name (a file to refuse)."""
    c = model.config
    return write_moe_gguf(path, arch, c, gguf_tensors(model), {"rope_freq_base": c.rope_parameters["rope_theta"]},
                          lambda name: ggml_type, seed)


def write_moe_gguf(path: Path, arch: str, c, tensors: dict[str, np.ndarray], extra: dict,
                   type_of, seed: int = 0) -> Path:
    """A mixture-of-experts GGUF of transformers config `c` (its counts and widths under llama.cpp's keys, each
    `extra` item through `GGUFWriter.add_<key>`), `write_tiny_llama`'s 260-token vocabulary and `tensors`:
    1-D tensors, biases and the router F32, every other matrix as `type_of(name)` (see `write_qwen3moe_gguf`)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in [(writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, c.hidden_size),
                       (writer.add_feed_forward_length, c.intermediate_size),
                       (writer.add_head_count, c.num_attention_heads),
                       (writer.add_head_count_kv, c.num_key_value_heads),
                       (writer.add_key_length, c.head_dim), (writer.add_value_length, c.head_dim),
                       (writer.add_layer_norm_rms_eps, c.rms_norm_eps), (writer.add_vocab_size, c.vocab_size),
                       (writer.add_expert_count, c.num_experts), (writer.add_expert_used_count, c.num_experts_per_tok),
                       (writer.add_expert_feed_forward_length, expert_width(c))]:
        add(value)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    add_byte_level_vocab(writer)
    write_typed_tensors(writer, tensors, type_of, rng)
    return path


def expert_width(c) -> int:
    """Each expert's FFN width in a transformers MoE config (Qwen3 MoE: moe_intermediate_size; gpt-oss:
    intermediate_size)."""
    return getattr(c, "moe_intermediate_size", None) or c.intermediate_size
