"""A tiny random Gemma 4 made in transformers (`Gemma4ForCausalLM`, text only, fp32, eager) and written as GGUF.

transformers 5.25 (installed here) has `Gemma4ForCausalLM` (models/gemma4/modeling_gemma4.py) with its text
config `Gemma4TextConfig`; the model is the reference itself. It is written under llama.cpp's names and keys as
its converter writes them (conversion/gemma.py `Gemma4Model` over `Gemma3Model` and `TextModel`, llama-cpp-python
0.3.36): tensor names through gguf's own table (`gguf.get_tensor_name_map(MODEL_ARCH.GEMMA4, ...)`), after the
converter's renames (`.weight` added to `layer_scalar` and the experts' tensors; `router.scale` ->
`ffn_gate_inp.scale`, `router.per_expert_scale` -> `ffn_down_exps.scale`); no norm shift (Gemma 4's RMSNorm
multiplies by its weight, not 1 + weight); no `output.weight` (tied); `rope_freqs` with 1 on the rotated pairs of
the full layers' "proportional" RoPE and 1e30 on the others; the metadata read from the config's dict, as the
converter reads config.json (`per_layer_config` gives the full layers' head size and, where it has one, their KV
head count: then `head_count_kv` is an array; `feed_forward_length` an array under `use_double_wide_mlp`).

The layout mirrors `tiny_gemma4`'s where the config can express it: six layers of hidden 64 and 4 query heads,
sliding (window 16, RoPE base 10000, head size 16, 2 KV heads) and full (base 1e6, head size 32, partial rotary
factor 0.25) alternating S F S F S F; the last two layers share the K/V of layers 2 and 3
(`num_kv_shared_layers` 2) and have a double-wide FFN (96 -> 192); a `layer_scalar` per layer; final logits
capped at 30; no per-layer embeddings. `moe=False` (E2B/E4B's attention, without their per-layer embeddings):
every owning layer has its V projection, full layers 2 KV heads. `moe=True` (26B-A4B's): `attention_k_eq_v`
(full layers take V = K and have 1 KV head, `num_global_key_value_heads`) and 8 experts choosing 2 (width 32)
beside every dense FFN. Vocabulary: `tiny_gguf.add_byte_level_vocab`'s 260 tokens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from tiny_gguf import add_byte_level_vocab, write_typed_tensors

VOCAB = 260
SLIDING = (True, False, True, False, True, False)
EMBED_SCALE = 0.5  # times sqrt(hidden) at the input: about unit rows, so greedy ids vary


def make_gemma4(*, moe: bool = False, sliding: tuple[bool, ...] = SLIDING, seed: int = 0):
    """transformers' `Gemma4ForCausalLM` (fp32, eager attention, eval) of the module doc, its layers sliding
    where `sliding` says (the last must be full: transformers makes it so), weights drawn from `seed`: matrices
    N(0, 1/in) (Q and K N(0, 4/in), the router N(0, 4/in), the embedding N(0, 0.25/in)), norm weights and the
    router's input scale 1 + N(0, 0.1), `layer_scalar` and the per-expert scales U(0.5, 1.5)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    config = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=len(sliding),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=16,
        layer_types=layer_types, rope_parameters=rope, max_position_embeddings=4096, rms_norm_eps=1e-6,
        final_logit_softcapping=30.0, hidden_size_per_layer_input=0, num_kv_shared_layers=2,
        use_double_wide_mlp=True, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager")
    if moe:
        config |= dict(attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=8,
                       top_k_experts=2, moe_intermediate_size=32)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**config)).float().eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("norm.weight", "router.scale")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(("layer_scalar", "per_expert_scale")):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5))
            elif p.dim() >= 2:  # matrices `[out, in]`, experts `[experts, out, in]`
                scale = {"q_proj": 2.0, "k_proj": 2.0, "router": 2.0, "embed_tokens": EMBED_SCALE}
                s = next((v for k, v in scale.items() if k in name), 1.0)
                p.copy_(torch.randn_like(p) * s / p.shape[-1] ** 0.5)
    return model


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values (row-major `[out, in]`, experts outermost) of a `Gemma4ForCausalLM`, named
    as llama.cpp's converter names them (see the module doc), with its `rope_freqs`."""
    hp = model.config.to_dict()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, hp["num_hidden_layers"])
    renames = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}
    out = {}
    for hf, value in model.state_dict().items():
        if hf == "lm_head.weight":  # tied to the embedding: the converter writes no output.weight
            continue
        layer = hf.split(".")[2] if hf.startswith("model.layers.") else None
        special = next((g for h, g in renames.items() if hf.endswith(h)), None)
        if special:
            name = f"blk.{layer}.{special}"
        else:
            name = names.get_name(hf if hf.endswith(".weight") else hf + ".weight", try_suffixes=(".weight",))
            if name is None:
                raise KeyError(f"{hf}: no GGUF name in gguf's Gemma 4 table")
        out[name] = value.detach().float().numpy()
    head_dim = _full_layer_field(hp, "head_dim")
    rotated = int(head_dim * hp["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    out["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (head_dim // 2 - rotated))
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def _full_layer_field(hparams: dict, field: str) -> int | None:
    """`field` of the first full layer in config.json's `per_layer_config` (the converter's search)."""
    for layer, values in hparams.get("per_layer_config", {}).items():
        if hparams["layer_types"][int(layer)] == "full_attention" and field in values:
            return values[field]
    return None


def write_gemma4_hf_gguf(model, path: Path) -> Path:
    """`model` as a GGUF file at `path` (every tensor F32), its metadata as llama.cpp's converter writes it
    from config.json (the config's dict: a per-layer field read on the config object is ambiguous)."""
    hp = model.config.to_dict()
    layers, head_full = hp["num_hidden_layers"], _full_layer_field(hp, "head_dim")
    swa = [t == "sliding_attention" for t in hp["layer_types"]]
    rope = hp["rope_parameters"]
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_name("tiny-gemma4-hf")
    ffn = hp["intermediate_size"]
    if hp["use_double_wide_mlp"]:
        ffn = [ffn if i < layers - hp["num_kv_shared_layers"] else 2 * ffn for i in range(layers)]
    kv, kv_full = hp["num_key_value_heads"], _full_layer_field(hp, "num_key_value_heads")
    if kv_full:
        kv = [kv if s else kv_full for s in swa]
    for add, value in [(writer.add_block_count, layers), (writer.add_context_length, hp["max_position_embeddings"]),
                       (writer.add_embedding_length, hp["hidden_size"]), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, hp["num_attention_heads"]), (writer.add_head_count_kv, kv),
                       (writer.add_rope_freq_base, rope["full_attention"]["rope_theta"]),
                       (writer.add_rope_freq_base_swa, rope["sliding_attention"]["rope_theta"]),
                       (writer.add_layer_norm_rms_eps, hp["rms_norm_eps"]),
                       (writer.add_final_logit_softcapping, hp["final_logit_softcapping"]),
                       (writer.add_sliding_window, hp["sliding_window"]),
                       (writer.add_shared_kv_layers, hp["num_kv_shared_layers"]),
                       (writer.add_embedding_length_per_layer_input, hp["hidden_size_per_layer_input"] or 0),
                       (writer.add_sliding_window_pattern, swa),
                       (writer.add_key_length, head_full), (writer.add_value_length, head_full),
                       (writer.add_key_length_swa, hp["head_dim"]), (writer.add_value_length_swa, hp["head_dim"]),
                       (writer.add_rope_dimension_count, head_full),
                       (writer.add_rope_dimension_count_swa, hp["head_dim"]),
                       (writer.add_vocab_size, hp["vocab_size"])]:
        add(value)
    if hp["enable_moe_block"]:
        writer.add_expert_count(hp["num_experts"])
        writer.add_expert_used_count(hp["top_k_experts"])
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    add_byte_level_vocab(writer)
    write_typed_tensors(writer, gguf_tensors(model), lambda name: "F32", np.random.default_rng(0))
    return path
