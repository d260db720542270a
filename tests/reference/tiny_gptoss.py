"""A tiny random gpt-oss made in transformers (`GptOssForCausalLM`, fp32, eager) and written as GGUF.

The model is the reference itself: its weights are drawn here, then written under llama.cpp's names and
layouts (`convert_hf_to_gguf.py`'s `GptOssModel`, gguf-py's `MODEL_ARCH.GPT_OSS` tensors): `self_attn.sinks`
-> `attn_sinks`, `post_attention_layernorm` -> `post_attention_norm` (the FFN's input norm), `mlp.router` ->
`ffn_gate_inp` (weight and bias); the experts' `gate_up_proj` `[experts, hidden, 2 expert_ffn]`, whose gate
and up columns interleave (transformers' `_apply_gate` reads `[..., ::2]` and `[..., 1::2]`), split into
`ffn_gate_exps` and `ffn_up_exps` `[experts, expert_ffn, hidden]` with their biases, `down_proj`
`[experts, expert_ffn, hidden]` transposed into `ffn_down_exps` `[experts, hidden, expert_ffn]`; Q/K rows as
they are (NEOX RoPE). The sliding window goes in `gpt-oss.attention.sliding_window`; even layers slide by
the architecture (llama.cpp `set_swa_pattern(2)`, transformers' `layer_types`).

RoPE: transformers' default for gpt-oss, YaRN (factor 32 over 4096 original positions, correction range not
truncated), written as llama.cpp's converter writes it (`rope.scaling.type` yarn, `rope.scaling.factor`,
`rope.scaling.original_context_length`), or plain RoPE (`rope="default"`).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from tiny_moe import VOCAB, write_moe_gguf

ROPE_THETA = 150000.0  # gpt-oss's


def make_gptoss(*, experts: int = 8, top_k: int = 2, layers: int = 4, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, head_dim: int = 16, expert_ffn: int = 32, window: int = 16, rope: str = "yarn",
                seed: int = 0):
    """transformers' `GptOssForCausalLM` (fp32, eager attention, eval) with weights drawn from `seed`:
    matrices N(0, 1/in) (the router's N(0, 4/in), so its choices are clear-cut; the experts' N(0, 9/in), so
    the SwiGLU's clamps at ±7 are reached), biases N(0, 0.1²), norms 1 + N(0, 0.1), sinks N(0, 1)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=expert_ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, num_local_experts=experts,
        num_experts_per_tok=top_k, sliding_window=window, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA} if rope == "default" else None,
        tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith(("bias", "_bias")):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                fan_in = p.shape[-2] if "experts" in name else p.shape[-1]  # experts store [in, out]
                scale = 2.0 if name.endswith("router.weight") else 3.0 if name.endswith("gate_up_proj") else 1.0
                p.copy_(torch.randn_like(p) * scale / fan_in**0.5)
    return model


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values (row-major, `[out, in]`, experts outermost) of a `GptOssForCausalLM`."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    names = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias"}
    names |= {f"self_attn.{hf}_proj.{kind}": f"attn_{ours}.{kind}" for hf, ours in
              (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for kind in ("weight", "bias")}
    for i in range(model.config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out |= {b + ours: sd[p + hf] for hf, ours in names.items()}
        gate_up, gate_up_bias = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.gate_up_proj_bias"]
        out[b + "ffn_gate_exps.weight"] = gate_up[:, :, ::2].transpose(0, 2, 1)  # [experts, expert_ffn, hidden]
        out[b + "ffn_up_exps.weight"] = gate_up[:, :, 1::2].transpose(0, 2, 1)
        out[b + "ffn_gate_exps.bias"] = gate_up_bias[:, ::2]
        out[b + "ffn_up_exps.bias"] = gate_up_bias[:, 1::2]
        out[b + "ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1)  # [experts, hidden, ffn]
        out[b + "ffn_down_exps.bias"] = sd[p + "mlp.experts.down_proj_bias"]
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def round_experts_to_mxfp4(model) -> None:
    """Replace every expert matrix of `model` by its MXFP4 round trip (gguf's quantizer and dequantizer along
    the GGUF rows, i.e. blocks of 32 along each expert's input), so that a file whose experts are MXFP4 holds
    exactly `model`."""
    mx = gguf.GGMLQuantizationType.MXFP4

    def round_rows(values: np.ndarray) -> np.ndarray:  # [..., in] rows of 32-blocks
        flat = values.reshape(-1, values.shape[-1])
        return gguf.quants.dequantize(gguf.quants.quantize(flat, mx), mx).reshape(values.shape)

    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            for p in (experts.gate_up_proj, experts.down_proj):  # [experts, in, out]: GGUF rows are [.., out, in]
                rows = np.ascontiguousarray(p.detach().numpy().transpose(0, 2, 1))
                p.copy_(torch.from_numpy(np.ascontiguousarray(round_rows(rows).transpose(0, 2, 1))))


def write_gptoss_gguf(model, path: Path, expert_type: str = "F32", seed: int = 0) -> Path:
    """`model` as a GGUF file: the expert matrices as `expert_type` (MXFP4: llama.cpp's gpt-oss files; see
    `round_experts_to_mxfp4` for a file equal to the model), everything else F32."""
    c = model.config
    rope = c.rope_parameters
    extra = {"rope_freq_base": rope["rope_theta"], "sliding_window": c.sliding_window}
    if rope["rope_type"] == "yarn":
        extra |= {"rope_scaling_type": gguf.RopeScalingType.YARN, "rope_scaling_factor": rope["factor"],
                  "rope_scaling_orig_ctx_len": rope["original_max_position_embeddings"]}
    return write_moe_gguf(path, "gpt-oss", c, gguf_tensors(model), extra,
                          lambda name: expert_type if "_exps." in name else "F32", seed)
