"""A float64 numpy Gemma 4 forward, written from llama.cpp's graph (src/models/gemma4.cpp), on a GGUF file.

The independent second reference of `make_gemma4_golden.py`: it reads the file with gguf's `GGUFReader` (nothing
of hybridgate) and follows llama.cpp's graph op by op: embeddings times sqrt(hidden); per layer RMSNorm, Q (and
where the layer owns K/V: K, V, or V = K without `attn_v`) per head, Q and K RMS-normed with their weights and V
without, NEOX RoPE (the full layers' frequencies divided by `rope_freqs`), causal attention with scale 1 (a
sliding layer's window: distance < window, LLAMA_SWA_TYPE_STANDARD), layers past `shared_kv_layers` reading
layer n_kv - 2 (sliding) or n_kv - 1 (full), llama.cpp's `reuse` rule; the post-attention norm and residual;
the dense GeGLU FFN, and for MoE layers the experts beside it (`build_moe_ffn`: softmax over the router's logits
of rms_norm(residual) / sqrt(hidden) · `ffn_gate_inp.scale`, top k, renormalised, each expert's output times its
`ffn_down_exps.scale`); `post_ffw_norm`, the residual, `layer_output_scale`; the final norm, the tied LM head and
the final softcap.

GELU: the tanh form exactly (`gelu`), or as llama.cpp's CPU backend computes it (`gelu_fp16_table`: ggml-cpu
vec.h with GGML_GELU_FP16, its default, looks the value up in a table of fp16 inputs and outputs), which is what
makes llama.cpp parts from an exact forward by a few 1e-3 on these files.
"""

from __future__ import annotations

import gguf
import numpy as np

ARCH = "gemma4."


def read(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata: key -> number, bool list or string, tensors: name -> float64 array, row-major) of an F32 file."""
    reader = gguf.GGUFReader(str(path))
    meta = {}
    for f in reader.fields.values():
        kind = f.types[0] if f.types else None
        if kind == gguf.GGUFValueType.ARRAY and f.types[-1] != gguf.GGUFValueType.STRING:
            meta[f.name] = [f.parts[i].tolist()[0] for i in f.data]
        elif kind not in (None, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING):
            meta[f.name] = f.parts[-1].tolist()[0]
    tensors = {t.name: np.array(t.data, np.float64).reshape([int(n) for n in reversed(t.shape)])
               for t in reader.tensors}
    return meta, tensors


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (Hendrycks and Gimpel 2016), in float64."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def gelu_fp16_table(x: np.ndarray) -> np.ndarray:
    """llama.cpp's CPU GELU (ggml-cpu vec.h, GGML_GELU_FP16): 0 at x <= -10, x at x >= 10, else the fp16 value of
    GELU at x rounded to fp16."""
    table = gelu(x.astype(np.float16).astype(np.float64)).astype(np.float16).astype(np.float64)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, table))


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def rope_neox(x: np.ndarray, positions: np.ndarray, base: float, factors: np.ndarray | None) -> np.ndarray:
    """x `[tokens, heads, d]` rotated in pairs (x[i], x[i + d/2]) (llama.cpp NEOX) by position · base^(-2i/d) /
    factor_i."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d) / (1.0 if factors is None else factors)
    angle = positions[:, None] * inv[None]
    c, s = np.cos(angle)[:, None], np.sin(angle)[:, None]
    x0, x1 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], -1)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int) -> np.ndarray:
    """Causal GQA attention with scale 1: q `[n, heads, d]`, k and v `[n, kv_heads, d]` -> `[n, heads · d]`."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    i, j = np.arange(n)[:, None], np.arange(n)[None]
    seen = (j <= i) & ((i - j < window) if window else True)
    out = np.empty_like(q)
    for h in range(heads):
        s = np.where(seen, q[:, h] @ k[:, h // group].T, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // group]
    return out.reshape(n, -1)


def experts(meta: dict, t: dict, p: str, x: np.ndarray, residual: np.ndarray, act) -> np.ndarray:
    """The MoE branch of block `p` (`blk.{i}.`): the experts of x (rms_norm(residual) · pre_ffw_norm_2), routed as
    the module doc says."""
    eps, hidden = meta[ARCH + "attention.layer_norm_rms_epsilon"], residual.shape[1]
    router_input = rms_norm(residual, None, eps) / np.sqrt(hidden) * t[p + "ffn_gate_inp.scale"]
    logits = router_input @ t[p + "ffn_gate_inp.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    gate_up, down, scale = t[p + "ffn_gate_up_exps.weight"], t[p + "ffn_down_exps.weight"], t[p + "ffn_down_exps.scale"]
    width, out = gate_up.shape[1] // 2, np.zeros_like(x)
    for row in range(x.shape[0]):
        chosen = np.argsort(-probs[row], kind="stable")[: meta[ARCH + "expert_used_count"]]
        for e, w in zip(chosen, probs[row, chosen] / probs[row, chosen].sum()):
            y = gate_up[e] @ x[row]
            out[row] += w * scale[e] * ((act(y[:width]) * y[width:]) @ down[e].T)
    return out


def block(meta: dict, t: dict, il: int, x: np.ndarray, positions: np.ndarray, cache: dict, act) -> np.ndarray:
    """Block `il` on the stream x `[n, hidden]`; K and V of owning layers go into `cache` (layer -> (k, v))."""
    p, eps = f"blk.{il}.", meta[ARCH + "attention.layer_norm_rms_epsilon"]
    sliding = meta[ARCH + "attention.sliding_window_pattern"][il]
    owners = meta[ARCH + "block_count"] - meta.get(ARCH + "attention.shared_kv_layers", 0)
    base = meta[ARCH + ("rope.freq_base_swa" if sliding else "rope.freq_base")]
    factors = None if sliding else t.get("rope_freqs.weight")
    h = rms_norm(x, t[p + "attn_norm.weight"], eps)
    d = t[p + "attn_q_norm.weight"].shape[0]
    q = rope_neox(rms_norm((h @ t[p + "attn_q.weight"].T).reshape(len(x), -1, d), t[p + "attn_q_norm.weight"], eps),
                  positions, base, factors)
    if il < owners:
        k = h @ t[p + "attn_k.weight"].T
        v = (h @ t[p + "attn_v.weight"].T if p + "attn_v.weight" in t else k).reshape(len(x), -1, d)
        k = rope_neox(rms_norm(k.reshape(len(x), -1, d), t[p + "attn_k_norm.weight"], eps), positions, base, factors)
        cache[il] = (k, rms_norm(v, None, eps))
    k, v = cache[il if il < owners else owners - (2 if sliding else 1)]
    out = attend(q, k, v, meta[ARCH + "attention.sliding_window"] if sliding else 0) @ t[p + "attn_output.weight"].T
    residual = rms_norm(out, t[p + "post_attention_norm.weight"], eps) + x
    f = rms_norm(residual, t[p + "ffn_norm.weight"], eps)
    f = (act(f @ t[p + "ffn_gate.weight"].T) * (f @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
    if p + "ffn_gate_inp.weight" in t:
        x2 = rms_norm(residual, t[p + "pre_ffw_norm_2.weight"], eps)
        f = rms_norm(f, t[p + "post_ffw_norm_1.weight"], eps) + \
            rms_norm(experts(meta, t, p, x2, residual, act), t[p + "post_ffw_norm_2.weight"], eps)
    x = rms_norm(f, t[p + "post_ffw_norm.weight"], eps) + residual
    return x * t[p + "layer_output_scale.weight"][0] if p + "layer_output_scale.weight" in t else x


def last_logits(meta: dict, t: dict, ids: list[int], act=gelu) -> np.ndarray:
    """float64 logits `[vocab]` at the last of `ids` (one forward from an empty cache); act: `gelu` or
    `gelu_fp16_table`."""
    hidden = meta[ARCH + "embedding_length"]
    x = t["token_embd.weight"][np.asarray(ids)] * np.sqrt(np.float32(hidden))
    positions, cache = np.arange(len(ids), dtype=np.float64), {}
    for il in range(meta[ARCH + "block_count"]):
        x = block(meta, t, il, x, positions, cache, act)
    h = rms_norm(x[-1:], t["output_norm.weight"], meta[ARCH + "attention.layer_norm_rms_epsilon"])
    logits = (h @ t.get("output.weight", t["token_embd.weight"]).T)[0]
    cap = meta.get(ARCH + "final_logit_softcapping", 0.0)
    return cap * np.tanh(logits / cap) if cap else logits
