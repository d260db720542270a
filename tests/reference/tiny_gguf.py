"""Write small random-weight Llama GGUF files with `gguf.GGUFWriter`.

Used by `make_golden.py` (the committed tiny files are its output) and by tests
that need a malformed file (unknown pre-tokenizer, unknown tensor type).
"""

from __future__ import annotations

from pathlib import Path

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
