"""What each layer of a file holds: its shapes read from the metadata, and the tensors it must have.

Most families give one head size, KV head count and FFN width for every layer; Gemma 4 varies them by layer
(llama.cpp `llama_hparams::n_embd_head_k(il)`, `n_head_kv(il)`, `n_ff(il)`, read by `get_key_or_arr`), lets
its last layers share an earlier layer's K/V (`has_kv(il)`; src/llama-model.cpp's KV-cache `reuse` callback)
and takes V from K where a layer has no `attn_v`. `layer_fields` turns the file's keys into `ModelConfig`'s
per-layer tuples; `expected_tensors` lists, per layer, every tensor the architecture row reads, with its shape.
"""

from __future__ import annotations

from typing import Any

from hybridgate.models.architectures import Architecture
from hybridgate.models.gguf_metadata import ModelLoadError

# `gguf_file.ModelConfig` and `gguf_file.TensorView` (which import this module: named here, not imported)
ModelConfig = TensorView = Any

# Tensors a file may hold beyond the layout's own (read by `_rope_factors`, or the untied LM head).
OPTIONAL_TENSORS = ("output.weight", "rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
# Tensors a layer that shares another's K/V may still hold, unread (llama.cpp: TENSOR_NOT_REQUIRED there).
SHARED_KV_UNREAD = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")


def per_layer(meta: dict[str, Any], key: str, layers: int, default: int) -> tuple[int, ...]:
    """`key`'s value for every layer: one number for all, or an array of `layers` numbers (llama.cpp
    `get_key_or_arr`). Raises ModelLoadError naming the key when an array has another length."""
    value = meta.get(key, default)
    if not isinstance(value, list):
        return (int(value),) * layers
    if len(value) != layers:
        raise ModelLoadError(f"GGUF metadata {key} has {len(value)} entries, expected block_count {layers}")
    return tuple(int(v) for v in value)


def refuse_layout(row: Architecture, meta: dict[str, Any]) -> None:
    """Raise ModelLoadError, in one line, where a key of `row.refused_keys` is non-zero in the file."""
    for name, why in row.refused_keys:
        if meta.get(f"{row.name}.{name}"):
            raise ModelLoadError(f"{row.name}.{name}={meta[f'{row.name}.{name}']}: not supported: {why}")


def layer_fields(row: Architecture, meta: dict[str, Any], tensors: dict[str, TensorView], layers: int,
                 head_dim: int, windows: tuple[int, ...]) -> dict[str, Any]:
    """`ModelConfig`'s per-layer fields, and its `num_kv_heads` and `intermediate_size` (the largest), from
    the file. A sliding layer (window > 0) has `attention.key_length_swa` as its head size where the file
    has that key. The last `attention.shared_kv_layers` layers read the K/V of the last earlier layer of
    their kind (sliding or not), as transformers' Gemma 4 chooses (`Gemma4TextConfig.kv_sharing_modes`);
    llama.cpp's `reuse` callback (src/llama-model.cpp) takes fixed offsets from the first sharing layer, 2
    back for a sliding layer and 1 back for a full one: the same layers wherever the last owning layer is
    full and the one before it sliding (`test_gemma4_transformers` has a layout where they part).
    Raises ModelLoadError naming the key: a head size or RoPE dimension that differs between K and V or
    from the head, or a shared layer with no earlier layer of its kind."""
    arch = row.name
    sliding = [w > 0 for w in windows]
    swa_dim = int(meta.get(f"{arch}.attention.key_length_swa", head_dim))
    for key in ("attention.value_length_swa", "rope.dimension_count_swa"):
        if int(meta.get(f"{arch}.{key}", swa_dim)) != swa_dim:
            raise ModelLoadError(f"GGUF metadata {arch}.{key}={meta[f'{arch}.{key}']} differs from the sliding "
                                 f"layers' key_length_swa {swa_dim} (not supported)")
    kv_heads = per_layer(meta, f"{arch}.attention.head_count_kv", layers, int(meta[f"{arch}.attention.head_count"]))
    ffn = per_layer(meta, f"{arch}.feed_forward_length", layers, 0)
    shared = int(meta.get(f"{arch}.attention.shared_kv_layers", 0))
    first = layers - shared
    source = list(range(layers))
    for i in range(first, layers):
        kin = [j for j in range(first) if sliding[j] == sliding[i]]
        if not kin:
            raise ModelLoadError(f"GGUF metadata {arch}.attention.shared_kv_layers={shared}: layer {i} has no "
                                 f"earlier {'sliding' if sliding[i] else 'full'} layer to share K/V with")
        source[i] = kin[-1]
    qkv = []
    for i in range(layers):
        if source[i] != i:
            qkv.append(row.qkv_tensors[:1])  # Q only
        elif row.k_eq_v and f"blk.{i}.attn_v.weight" not in tensors:
            qkv.append(("attn_q", "attn_k", "attn_k"))
        else:
            qkv.append(row.qkv_tensors)
    scale = lambda i: tensors.get(f"blk.{i}.layer_output_scale.weight")  # noqa: E731
    return {
        "num_kv_heads": max(kv_heads),
        "intermediate_size": max(ffn),
        "layer_head_dims": tuple(swa_dim if s else head_dim for s in sliding),
        "layer_kv_heads": kv_heads,
        "layer_kv_source": tuple(source),
        "layer_intermediate_sizes": ffn,
        "layer_output_scales": tuple(float(scale(i).dequantize().reshape(-1)[0]) if scale(i) else 1.0
                                     for i in range(layers)),
        "layer_rope_factors": tuple(row.swa_rope_factors or not s for s in sliding),
        "layer_qkv": tuple(qkv),
    }


def _layer_tensors(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Name (after `blk.{i}.`) -> row-major shape of every tensor layer `i` reads."""
    row, h, d = config.arch, config.hidden_size, config.layer_head_dims[i]
    q, kv = config.num_heads * d, config.layer_kv_heads[i] * d
    qkv = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_qkv": (q + 2 * kv, h)}
    names = dict.fromkeys(config.layer_qkv[i])
    layer = {"attn_norm.weight": (h,), "attn_output.weight": (h, q), row.ffn_norm + ".weight": (h,)}
    layer |= {n + ".weight": qkv[n] for n in names}
    if row.qkv_bias:
        layer |= {n + ".bias": qkv[n][:1] for n in names}
    if row.output_bias:
        layer["attn_output.bias"] = (h,)
    if row.attn_sinks:
        layer["attn_sinks.weight"] = (config.num_heads,)
    layer |= _ffn_tensors(config, i)
    if row.qk_norm:
        layer |= {"attn_q_norm.weight": (d,)} | ({"attn_k_norm.weight": (d,)} if config.owns_kv(i) else {})
    if row.post_norms:
        layer |= {"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
    return layer


def _ffn_tensors(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """The FFN's tensors of block `i`: the dense gate/up/down, or the row's experts and router (and the dense FFN
    beside them where the row has one)."""
    row, h, f, moe = config.arch, config.hidden_size, config.layer_intermediate_sizes[i], config.moe
    dense = {n + ".weight": (f * 2 // len(row.gate_up_tensors), h) for n in row.gate_up_tensors}
    dense |= {"ffn_down.weight": (h, f)}
    if moe is None:
        return dense
    e, fe = config.num_experts, config.expert_intermediate_size
    fs = config.shared_expert_intermediate_size
    out = {n + ".weight": (e, fe * 2 // len(moe.expert_tensors), h) for n in moe.expert_tensors}
    out |= {"ffn_gate_inp.weight": (e, h), "ffn_down_exps.weight": (e, h, fe)}
    if moe.selection_bias:
        out["exp_probs_b.bias"] = (e,)
    if moe.biases:
        out |= {n[: -len(".weight")] + ".bias": shape[:2] for n, shape in out.items() if n.endswith("_exps.weight")}
        out["ffn_gate_inp.bias"] = (e,)
    if moe.shared_expert:
        out |= {"ffn_gate_shexp.weight": (fs, h), "ffn_up_shexp.weight": (fs, h), "ffn_down_shexp.weight": (h, fs)}
    if moe.shared_expert_gate:
        out["ffn_gate_inp_shexp.weight"] = (h,)
    if moe.beside_dense:
        out |= dense | {n + ".weight": (h,) for n in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")}
    if moe.router_input_norm:
        out["ffn_gate_inp.scale"] = (h,)
    if moe.expert_scales:
        out["ffn_down_exps.scale"] = (e,)
    return out


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> row-major shape of every tensor `config`'s architecture reads (`[out, in]` for matrices)."""
    h = config.hidden_size
    out = {"token_embd.weight": (config.vocab_size, h), "output_norm.weight": (h,)}
    out |= {f"blk.{i}.{n}": shape for i in range(config.num_layers) for n, shape in _layer_tensors(config, i).items()}
    if not config.tie_word_embeddings:
        out["output.weight"] = (config.vocab_size, h)
    return out


def optional_tensors(config: ModelConfig) -> set[str]:
    """Tensors a file may hold that `expected_tensors` does not list: `OPTIONAL_TENSORS`, the row's optional
    layer tensors, and the K/V tensors of layers that share another's (`SHARED_KV_UNREAD`)."""
    out = set(OPTIONAL_TENSORS)
    for i in range(config.num_layers):
        names = config.arch.optional_layer_tensors + (() if config.owns_kv(i) else SHARED_KV_UNREAD)
        out |= {f"blk.{i}.{n}" for n in names}
    return out


def check_tensors(config: ModelConfig, tensors: dict[str, TensorView]) -> None:
    """Raise ModelLoadError naming the first tensor that is missing, of another shape, or read by nothing."""
    expected = expected_tensors(config)
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelLoadError(f"tensor {name!r} is missing (architecture {config.architecture!r} reads it)")
        if tensors[name].shape != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {list(tensors[name].shape)}, expected {list(shape)}")
    for name in ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight"):
        if name in tensors and tensors[name].shape != (config.head_dim // 2,):
            raise ModelLoadError(f"tensor {name!r} has shape {list(tensors[name].shape)}, "
                                 f"expected [{config.head_dim // 2}] (head_dim / 2)")
    unused = sorted(set(tensors) - set(expected) - optional_tensors(config))
    if unused:
        raise ModelLoadError(f"tensor {unused[0]!r} is not read by architecture {config.architecture!r}"
                             f" ({len(unused)} such tensors); this file's layout is not supported")
