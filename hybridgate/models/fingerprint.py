"""A model's identity: what must match for two processes to share KV or cached responses."""

from __future__ import annotations

import hashlib

from hybridgate.models.gguf_file import GGUFModel

_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def model_fingerprint(model: GGUFModel) -> str:
    """Hex sha256 over the tokenizer metadata, the tensor table and the tensor bytes.

    Two files that tokenize alike and hold the same tensors (names, types,
    shapes, bytes) get the same fingerprint whatever other metadata differs.
    """
    h = hashlib.sha256()
    for key in _TOKENIZER_KEYS:
        value = model.metadata.get(key)
        h.update(key.encode())
        h.update(repr(value).encode("utf-8"))
    for name in sorted(model.tensors):
        t = model.tensors[name]
        h.update(f"{name}|{t.ggml_type.name}|{list(t.shape)}".encode())
        h.update(memoryview(t.data).cast("B") if t.data.flags.c_contiguous else t.data.tobytes())
    return h.hexdigest()
