"""Write small random-weight GGUF files with `gguf.GGUFWriter`.

`write_tiny_llama`: byte-level vocabulary, used by `make_golden.py` (the committed
tiny files are its output) and by tests that need a malformed file.
`write_tiny_model`: one family of `hybridgate.models.architectures` (`TINY_SPECS`)
with a real vocabulary copied from llama.cpp's test files and its matrices in any
quant type, for the architecture tests of both runners.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def add_byte_level_vocab(writer: gguf.GGUFWriter) -> None:
    """`write_tiny_llama`'s 260-token byte-level BPE vocabulary (pre-tokenizer qwen2, BOS 1, EOS 2, no BOS
    added) as `writer`'s tokenizer metadata."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_level_alphabet() + ["Ġt"])
    writer.add_token_types([3, 3, 3] + [1] * 257)
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write_tiny_llama(
    path: Path,
    *,
    heads: int,
    kv_heads: int,
    tied: bool = True,
    head_dim: int = 8,
    layers: int = 2,
    ffn: int = 96,
    seed: int = 0,
    pre: str = "smollm",
    context: int = 256,
) -> Path:
    """A random Llama GGUF (F32 tensors) with a byte-level vocabulary.

    Vocabulary: 3 control tokens, 256 byte tokens and 1 merge ("Ġ t"): 260 ids.
    """
    rng = np.random.default_rng(seed)
    hidden = heads * head_dim
    alphabet = byte_level_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["Ġt"]
    token_types = [3, 3, 3] + [1] * 256 + [1]
    vocab = len(tokens)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    writer.add_tensor("token_embd.weight", mat(vocab, hidden, 4.0))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", norm(hidden))
        writer.add_tensor(p + "attn_q.weight", mat(hidden, hidden, 2.0))
        writer.add_tensor(p + "attn_k.weight", mat(kv_heads * head_dim, hidden, 2.0))
        writer.add_tensor(p + "attn_v.weight", mat(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_output.weight", mat(hidden, hidden))
        writer.add_tensor(p + "ffn_norm.weight", norm(hidden))
        writer.add_tensor(p + "ffn_gate.weight", mat(ffn, hidden))
        writer.add_tensor(p + "ffn_up.weight", mat(ffn, hidden))
        writer.add_tensor(p + "ffn_down.weight", mat(hidden, ffn))
    writer.add_tensor("output_norm.weight", norm(hidden))
    if not tied:
        writer.add_tensor("output.weight", mat(vocab, hidden, 4.0))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_default_shaped(path: Path, seed: int = 0) -> Path:
    """A random-weight GGUF with SmolLM2-135M's shapes (30 layers, 576 hidden, 9/3 heads, 1536 FFN,
    49152 vocab), F16 linear weights (about 270 MB): for GPU machines that lack the packaged model."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim, hidden, ffn, layers, vocab = 9, 3, 64, 576, 1536, 30, 49152
    alphabet = byte_level_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["Ġt"]
    tokens += [f"<filler_{i}>" for i in range(vocab - len(tokens))]
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_block_count, layers), (writer.add_context_length, 8192),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_rope_freq_base, 100000.0), (writer.add_rope_dimension_count, head_dim),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, vocab)]:
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (0.5 / np.sqrt(cols))).astype(np.float16)

    writer.add_tensor("token_embd.weight", mat(vocab, hidden) * np.float16(8))
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in [("attn_q", hidden, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)]:
            writer.add_tensor(p + name + ".weight", mat(rows, cols))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- tiny random models per architecture, with real vocabularies ----------------------------------

@dataclass(frozen=True)
class TinySpec:
    """Shapes and extras of one tiny model (4 heads over 2 KV heads: a head-mapping bug shows)."""

    arch: str
    vocab: str  # llama.cpp test vocabulary whose tokenizer metadata is copied (`testdata.llama_vocab`)
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    layers: int = 3
    tied: bool = True
    window: int = 0  # sliding window written for families that have one (0: none written)
    rope_base: float = 10000.0
    rope_freqs: bool = False  # a Llama 3 `rope_freqs.weight` of frequency divisors
    softcaps: tuple[float, float] = (0.0, 0.0)  # (attention, final) written when non-zero
    explicit_head_dim: bool = False  # write attention.key_length / value_length
    long_rope_original: int = 0  # Phi-3 LongRoPE: original context (context_length is 4096) and factor tensors


TINY_SPECS = {
    "llama": TinySpec("llama", "llama-spm", tied=False),  # Llama 2 / Mistral: SPM, separate output
    # Llama 3.2's layout (tied, rope_freqs); SPM vocabulary, as the BPE one of 128,256 tokens and
    # 280,000 merges costs every GGUF parse (ours, transformers') seconds and changes no logits.
    "llama3": TinySpec("llama", "llama-spm", rope_freqs=True, rope_base=500000.0),
    # Qwen's own vocabulary (151,936 tokens and 151,387 merges) costs every GGUF parse (ours and
    # transformers' two per load) tens of seconds under load; a 32,000-token byte-level BPE stands in.
    "qwen2": TinySpec("qwen2", "deepseek-coder", rope_base=1000000.0),
    "qwen3": TinySpec("qwen3", "deepseek-coder", head_dim=32, tied=False, explicit_head_dim=True),
    "gemma2": TinySpec("gemma2", "llama-spm", head_dim=32, explicit_head_dim=True, window=16,
                       softcaps=(20.0, 15.0)),
    "gemma3": TinySpec("gemma3", "llama-spm", head_dim=32, layers=7, explicit_head_dim=True, window=16,
                       rope_base=1000000.0),
    # Phi-3-mini-128k's layout: LongRoPE factors, served up to the original context with the short ones.
    "phi3": TinySpec("phi3", "phi-3", tied=False, long_rope_original=1024),
}
# K-quants need rows of 256: every matrix's input width a multiple of it.
QUANT_SPEC = TinySpec("llama", "llama-spm", hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=256, layers=2)


def _vocab_fields(vocab_path: str) -> tuple[tuple[str, Any, int, int | None], ...]:
    """(key, value, GGUFValueType, array item type) of every `tokenizer.*` field of a vocabulary file
    (cached as JSON next to it: GGUFReader takes seconds on a large vocabulary)."""
    from hybridgate.bench.model_files import vocab_fields

    return vocab_fields(vocab_path)


def _k_quant_blocks(rng: np.random.Generator, rows: int, cols: int, kind: gguf.GGMLQuantizationType,
                    std: float) -> np.ndarray:
    """Random K-quant blocks (uint8 `[rows, bytes]`) whose weights have about `std` and mean ~0.

    Codes and sub-scales are random bytes; the fp16 super-block scales `d` (and `dmin`) are set so
    the dequantized weights (gguf's dequantizer, the reference) are centred and of the wanted size.
    Layouts (ggml-common.h): Q4_K/Q5_K start with d, dmin; Q6_K ends with d.
    """
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (size - 2, None)}[kind.name]

    def dequant(d: float, dmin: float) -> np.ndarray:
        b = blocks.copy()
        b[:, at[0] : at[0] + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        if at[1] is not None:
            b[:, at[1] : at[1] + 2] = np.frombuffer(np.float16(dmin).tobytes(), np.uint8)
        return gguf.quants.dequantize(b.reshape(rows, -1), kind)

    ratio = float(dequant(1.0, 0.0).mean() / -dequant(0.0, 1.0).mean()) if at[1] is not None else 0.0
    d = std / float((dequant(1.0, ratio)).std())
    jitter = rng.uniform(0.5, 1.5, size=len(blocks)).astype(np.float32)
    blocks[:, at[0] : at[0] + 2] = (d * jitter).astype(np.float16)[:, None].view(np.uint8)
    if at[1] is not None:
        blocks[:, at[1] : at[1] + 2] = (d * ratio * jitter).astype(np.float16)[:, None].view(np.uint8)
    return blocks.reshape(rows, -1)


def _typed(rng: np.random.Generator, values: np.ndarray, kind: gguf.GGMLQuantizationType):
    """(data, raw type) of a float32 matrix stored as `kind`, or as F32 when its rows do not fit the blocks."""
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if kind == gguf.GGMLQuantizationType.F32 or values.ndim < 2 or values.shape[-1] % block:
        return values, None
    if kind.name in ("Q4_K", "Q5_K", "Q6_K"):
        return _k_quant_blocks(rng, *values.shape, kind, float(values.std())), kind
    if kind == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16), None
    return gguf.quants.quantize(values, kind), kind


def write_typed_tensors(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray], type_of,
                        rng: np.random.Generator) -> None:
    """Add `tensors` to `writer`, then write the file and close it: 1-D tensors, biases and the router
    (`ffn_gate_inp`) F32, every other matrix as `type_of(name)` (a GGML type name, through `_typed`), an
    expert tensor's `[experts, rows, cols]` quantized as its stacked rows, as GGUF stores it."""
    for name, values in tensors.items():
        if values.ndim == 1 or name.endswith((".bias", "ffn_gate_inp.weight")):
            writer.add_tensor(name, values)
            continue
        data, raw = _typed(rng, values.reshape(-1, values.shape[-1]), gguf.GGMLQuantizationType[type_of(name)])
        writer.add_tensor(name, data.reshape(*values.shape[:-1], -1), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_model(path: Path, spec: TinySpec | str, vocab_path: Path, *,
                     ggml_type: str = "F32", seed: int = 0, window: int | None = None) -> Path:
    """A random-weight GGUF of `spec`'s family with the real vocabulary of `vocab_path`.

    Matrices (token embedding, linear weights, LM head) are stored as `ggml_type` (F32, F16, BF16,
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 quantized by gguf; Q4_K, Q5_K, Q6_K as random blocks) where their
    rows fit its blocks, else F32 (as llama.cpp's own fallback); norms and biases stay F32.
    `window` overrides the spec's sliding window.
    """
    spec = TINY_SPECS[spec] if isinstance(spec, str) else spec
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[ggml_type]
    fields = _vocab_fields(str(vocab_path))
    vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    writer = gguf.GGUFWriter(str(path), spec.arch)
    _write_hparams(writer, spec, vocab, spec.window if window is None else window)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                             sub_type=None if sub is None else gguf.GGUFValueType(sub))

    def add(name: str, values: np.ndarray) -> None:
        data, raw = _typed(rng, values.astype(np.float32), kind)
        writer.add_tensor(name, data, raw_dtype=raw)

    for name, values in _tiny_tensors(rng, spec, vocab).items():
        (add if values.ndim == 2 else writer.add_tensor)(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer: gguf.GGUFWriter, spec: TinySpec, vocab: int, window: int) -> None:
    for add, value in [(writer.add_block_count, spec.layers), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, spec.hidden), (writer.add_feed_forward_length, spec.ffn),
                       (writer.add_head_count, spec.heads), (writer.add_head_count_kv, spec.kv_heads),
                       (writer.add_rope_freq_base, spec.rope_base), (writer.add_rope_dimension_count, spec.head_dim),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_vocab_size, vocab)]:
        add(value)
    if spec.explicit_head_dim:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    if window:
        writer.add_sliding_window(window)
    if spec.softcaps[0]:
        writer.add_attn_logit_softcapping(spec.softcaps[0])
    if spec.softcaps[1]:
        writer.add_final_logit_softcapping(spec.softcaps[1])
    if spec.long_rope_original:  # as llama.cpp's converter writes Phi-3 LongRoPE (Phi3MiniModel)
        writer.add_rope_scaling_orig_ctx_len(spec.long_rope_original)
        scale = 4096 / spec.long_rope_original
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(spec.long_rope_original))))


def _tiny_tensors(rng: np.random.Generator, spec: TinySpec, vocab: int) -> dict[str, np.ndarray]:
    """Name -> float32 values, in GGUF's names and row-major `[out, in]` shapes, per family layout."""
    from hybridgate.models import ARCHITECTURES

    row, h, f = ARCHITECTURES[spec.arch], spec.hidden, spec.ffn
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def vec(n: int, mean: float = 1.0, std: float = 0.1) -> np.ndarray:
        return (mean + std * rng.standard_normal(n)).astype(np.float32)

    out = {"token_embd.weight": mat(vocab, h, 4.0)}
    if spec.rope_freqs:  # Llama 3's factors: 1 for high frequencies up to 8 for low ones
        out["rope_freqs.weight"] = np.geomspace(1.0, 8.0, spec.head_dim // 2).astype(np.float32)
    if spec.long_rope_original:  # Phi-3-mini-128k's factors run about 1-1.2 (short) and 1-40 (long)
        out["rope_factors_short.weight"] = np.linspace(1.0, 1.5, spec.head_dim // 2).astype(np.float32)
        out["rope_factors_long.weight"] = np.geomspace(1.0, 20.0, spec.head_dim // 2).astype(np.float32)
    for i in range(spec.layers):
        p = f"blk.{i}."
        wq, wk, wv = mat(q, h, 2.0), mat(kv, h, 2.0), mat(kv, h)
        qkv = {"attn_q": wq, "attn_k": wk, "attn_v": wv, "attn_qkv": np.concatenate([wq, wk, wv])}
        layer = {n + ".weight": qkv[n] for n in row.qkv_tensors}
        if row.qkv_bias:
            layer |= {n + ".bias": vec(len(qkv[n]), 0.0, 0.5) for n in row.qkv_tensors}
        if row.qk_norm:
            layer |= {"attn_q_norm.weight": vec(spec.head_dim), "attn_k_norm.weight": vec(spec.head_dim)}
        gate, up = mat(f, h), mat(f, h)
        layer |= {"ffn_up.weight": np.concatenate([gate, up])} if row.fused_gate_up else \
            {"ffn_gate.weight": gate, "ffn_up.weight": up}
        layer |= {"attn_norm.weight": vec(h), "attn_output.weight": mat(h, q), "ffn_norm.weight": vec(h),
                  "ffn_down.weight": mat(h, f)}
        if row.post_norms:
            layer |= {"post_attention_norm.weight": vec(h), "post_ffw_norm.weight": vec(h)}
        out |= {p + n: v for n, v in layer.items()}
    out["output_norm.weight"] = vec(h)
    if not spec.tied:
        out["output.weight"] = mat(vocab, h, 4.0)
    return out


# transformers' Qwen3 parameter names (under `model.`) → GGUF's, per layer then global (llama.cpp's
# `convert_hf_to_gguf.py` and gguf-py's tensor map; qwen3 keeps Q/K rows in HF's order: no permutation).
QWEN3_LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_hf_qwen3(path: Path, model, pooling_type: int | None = None) -> Path:
    """A GGUF (F32 tensors, tied LM head) of a transformers `Qwen3Model` whose vocabulary is
    `write_tiny_llama`'s byte-level one (its `vocab_size` must be 260), with `qwen3.pooling_type`
    written when given (llama.cpp's numbers: 1 mean, 2 cls, 3 last): an embedding model's file."""
    c = model.config
    alphabet = byte_level_alphabet()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["Ġt"]
    if c.vocab_size != len(tokens):
        raise ValueError(f"vocab_size: must be {len(tokens)} (the byte-level vocabulary), got {c.vocab_size}")
    writer = gguf.GGUFWriter(str(path), "qwen3")
    for add, value in [(writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, 512),
                       (writer.add_embedding_length, c.hidden_size), (writer.add_feed_forward_length, c.intermediate_size),
                       (writer.add_head_count, c.num_attention_heads), (writer.add_head_count_kv, c.num_key_value_heads),
                       (writer.add_key_length, c.head_dim), (writer.add_value_length, c.head_dim),
                       (writer.add_rope_freq_base, float(c.rope_parameters["rope_theta"])),
                       (writer.add_rope_dimension_count, c.head_dim), (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (writer.add_vocab_size, c.vocab_size), (writer.add_tokenizer_model, "gpt2"),
                       (writer.add_tokenizer_pre, "qwen2"), (writer.add_token_list, tokens),
                       (writer.add_token_types, [3, 3, 3] + [1] * 257), (writer.add_token_merges, ["Ġ t"]),
                       (writer.add_bos_token_id, 0), (writer.add_eos_token_id, 0), (writer.add_add_bos_token, False)]:
        add(value)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    weights = {k.removeprefix("model."): v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for hf, name in QWEN3_LAYER_TENSORS.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", weights[f"layers.{i}.{hf}.weight"])
    writer.add_tensor("output_norm.weight", weights["norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
