"""Byte-level BPE tokenizer built from GGUF metadata with the `tokenizers` library.

GGUF stores the vocabulary (already spelled in GPT-2's byte alphabet), the
merges, token types and a pre-tokenizer name (`tokenizer.ggml.pre`) that
llama.cpp maps to a regex list (llama.cpp, src/llama-vocab.cpp). Each name we
accept maps to the pre-tokenizer of the model's published tokenizer.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from hybridgate.models.gguf_file import GGUFModel, ModelLoadError

_CONTROL, _USER_DEFINED = 3, 4


def _smollm_pre() -> pre_tokenizers.PreTokenizer:
    # SmolLM2's tokenizer.json: every digit alone, then GPT-2's regex split.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


PRE_TOKENIZERS = {"smollm": _smollm_pre, "gpt2": _gpt2_pre}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from alphabet character to byte (the inverse of bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """Encode and decode text for a GGUF model with a byte-level BPE vocabulary.

    Raises (at construction):
        ModelLoadError: `tokenizer.ggml.model` is not `gpt2` (byte-level BPE), or
            `tokenizer.ggml.pre` is not one of `PRE_TOKENIZERS`, or the
            vocabulary or merges are missing.
    """

    def __init__(self, metadata: dict[str, Any]):
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', byte-level BPE)")
        pre = metadata.get("tokenizer.ggml.pre", "gpt2")
        if pre not in PRE_TOKENIZERS:
            raise ModelLoadError(
                f"tokenizer.ggml.pre {pre!r} is not supported (supported: {sorted(PRE_TOKENIZERS)})"
            )
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in metadata:
                raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        self.vocab_size = len(tokens)
        self.bos_token_id = int(metadata.get("tokenizer.ggml.bos_token_id", -1))
        self.eos_token_id = int(metadata.get("tokenizer.ggml.eos_token_id", -1))
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self.special_tokens = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == _CONTROL}
        self._tokens = tokens
        self._with_special = self._build(tokens, types, merges, PRE_TOKENIZERS[pre]())
        self._as_text = self._build(tokens, types, merges, PRE_TOKENIZERS[pre]())
        self._as_text.encode_special_tokens = True
        self.token_bytes = self._token_bytes(tokens, types)

    @staticmethod
    def _build(tokens, types, merges, pre) -> _HFTokenizer:
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = _HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
        )
        tok.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
        )
        return tok

    @staticmethod
    def _token_bytes(tokens: list[str], types: list[int]) -> list[bytes]:
        """The bytes each id decodes to (what the ByteLevel decoder yields for it)."""
        table = _byte_decoder()
        out = []
        for t, k in zip(tokens, types):
            if k in (_CONTROL, _USER_DEFINED) or not all(c in table for c in t):
                out.append(t.encode("utf-8"))
            else:
                out.append(bytes(table[c] for c in t))
        return out

    @classmethod
    def from_model(cls, model: GGUFModel) -> Tokenizer:
        return cls(model.metadata)

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; nothing is prepended (BOS comes from the template).

        With `special_tokens=False`, a special-token string such as
        `<|im_end|>` in `text` is encoded as plain text.
        """
        tok = self._with_special if special_tokens else self._as_text
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD (one per maximal invalid subpart)."""
        return self._with_special.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]
