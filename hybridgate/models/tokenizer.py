"""Tokenizers built from GGUF metadata with the `tokenizers` library, as llama.cpp reads them.

GGUF stores the vocabulary (`tokenizer.ggml.tokens`), token types, and either
merges (`tokenizer.ggml.merges`, byte-level BPE) or scores
(`tokenizer.ggml.scores`, SentencePiece). `tokenizer.ggml.model` names the
kind (llama.cpp, src/llama-vocab.cpp, `llama_vocab::impl::load`):

- `gpt2`: byte-level BPE, split first by the rules `tokenizer.ggml.pre` names
  (hybridgate/models/pretokenizers.py).
- `llama`: SentencePiece BPE. Merges are derived from the scores (a piece's
  score ranks the merge that makes it, as transformers' GGUF converter and
  `convert_slow_tokenizer` do), unknown characters fall back to `<0xNN>` byte
  tokens, a space becomes `▁`, and with `tokenizer.ggml.add_space_prefix`
  (default true) every run of text gets a leading `▁` (llama.cpp prefixes
  the text and every fragment after a special token). Gemma's files differ
  (`SPM_VARIANTS`): runs of spaces are stored as spaces and merges follow the
  file's token order, not the scores (transformers' `gemma_tokenizer`).
- `gemma4`: BPE with the file's merges, spelled as SentencePiece spells it
  (llama.cpp's `gemma4` model: BPE with the `gemma4` pre-tokenizer, whatever
  `tokenizer.ggml.pre` says): a space becomes `▁` (no space prefix: llama.cpp's
  BPE path ignores `add_space_prefix`), the text splits into runs of newlines
  and runs of the rest, merges run on UTF-8 characters, a character outside
  the vocabulary becomes its `<0xNN>` byte tokens, and BOS is always added.

Anything else is refused with `ModelLoadError`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer as _HFTokenizer
from tokenizers import decoders, models, normalizers

from hybridgate.models.gguf_file import GGUFModel, ModelLoadError
from hybridgate.models.pretokenizers import PRE_TOKENIZER_NAMES, pre_tokenizer

log = logging.getLogger("hybridgate.models")

# llama.cpp's token types (llama_token_type in gguf-py's constants).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's space symbol
# Tokens that end a turn in the chat templates of the families served (from llama.cpp's EOG list, which makes each
# one a control token whatever its type in the file: Gemma 4's `<|tool_response>` is user-defined there).
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|im_end|>", "<|end|>", "<turn|>",
                      "<|tool_response>")


@dataclass(frozen=True)
class SentencePieceVariant:
    """How one family's GGUF files spell a SentencePiece vocabulary."""

    merges_by_file_order: bool = False  # rank merges by token position, not by score
    respell_space_runs: bool = False  # a token of 2+ spaces is stored as spaces: spell it with `▁`


# By `general.architecture`; any other architecture reads as Llama's SentencePiece.
SPM_VARIANTS = {
    "gemma": SentencePieceVariant(merges_by_file_order=True, respell_space_runs=True),
    "gemma2": SentencePieceVariant(merges_by_file_order=True, respell_space_runs=True),
    "gemma3": SentencePieceVariant(merges_by_file_order=True, respell_space_runs=True),
}


@dataclass(frozen=True)
class _Parts:
    """What a tokenizer model contributes: the BPE model (built by `model()`, the costly part: its merges),
    text steps and the bytes of each id."""

    model: Callable[[], models.Model]
    normalizer: normalizers.Normalizer | None
    pre_tokenizer: Any
    decoder: decoders.Decoder
    token_bytes: list[bytes]
    vocab: set[str]
    add_bos: bool  # llama.cpp's default when the file has no `tokenizer.ggml.add_bos_token`
    strips_space: bool = False  # decode drops the text's leading space (SentencePiece with a space prefix)
    bos_always: bool = False  # BOS whatever the file's `add_bos_token` says


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


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated string keeps its first id
    return vocab


def _file_merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges`, each cut at its first space after the first character, as llama.cpp reads them (one
    without such a space merges nothing there, and is left out here)."""
    cuts = ((m, m.find(" ", 1)) for m in meta["tokenizer.ggml.merges"])
    return [(m[:cut], m[cut + 1:]) for m, cut in cuts if cut > 0]


def _bpe(meta: dict[str, Any], tokens: list[str], types: list[int], pre: str | None = None) -> _Parts:
    """BPE with the file's merges, split by the pre-tokenizer `tokenizer.ggml.pre` names, or by `pre` (the one
    the tokenizer model implies, whatever the file says: `gemma4`).

    A `gpt2` file without `tokenizer.ggml.pre` gets llama.cpp's choice, `default` (it warns of degraded output).
    """
    name = pre or meta.get("tokenizer.ggml.pre", "default")
    if name == "default" and "tokenizer.ggml.pre" not in meta:
        log.warning("GGUF has no tokenizer.ggml.pre: using llama.cpp's 'default' pre-tokenizer (regenerate the file "
                    "with a current convert_hf_to_gguf.py for its model's own)")
    if name not in PRE_TOKENIZER_NAMES:
        raise ModelLoadError(f"tokenizer.ggml.pre {name!r} is not supported (supported: {sorted(PRE_TOKENIZER_NAMES)})")
    if "tokenizer.ggml.merges" not in meta:
        raise ModelLoadError("GGUF metadata key 'tokenizer.ggml.merges' is missing")
    rules = pre_tokenizer(name)
    vocab = _vocab(tokens)

    def model() -> models.Model:
        return models.BPE(vocab, _file_merges(meta), fuse_unk=False, byte_fallback=not rules.byte_encode,
                          ignore_merges=rules.ignore_merges)

    if not rules.byte_encode:  # SentencePiece's spelling: `▁` for a space, `<0xNN>` byte tokens, no space prefix
        decode = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        return _Parts(model, normalizers.Replace(" ", SPACE), rules.build(), decode, _token_bytes_spm(tokens, types),
                      set(vocab), rules.add_bos, bos_always=rules.bos_always)
    table = _byte_decoder()
    token_bytes = [t.encode("utf-8") if k in (_CONTROL, _USER_DEFINED) or not all(c in table for c in t)
                   else bytes(table[c] for c in t) for t, k in zip(tokens, types)]
    return _Parts(model, None, rules.build(), decoders.ByteLevel(), token_bytes, set(vocab), rules.add_bos)


def _spm_merges(pieces: list[str], ranks: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a piece into two pieces, best rank first.

    The order is transformers' `generate_merges` (tokenization_utils_base.py): by the merged piece's
    rank, then the longer left part first.
    """
    vocab = {p for p, k in zip(pieces, types) if k in (_NORMAL, _USER_DEFINED)}
    found = []
    for piece, rank, kind in zip(pieces, ranks, types):
        if kind not in (_NORMAL, _USER_DEFINED):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((rank, len(left), len(right), left, right))
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(m[3], m[4]) for m in found]


def _token_bytes_spm(tokens: list[str], types: list[int]) -> list[bytes]:
    """Bytes of each SentencePiece id: `▁` -> space, `<0xNN>` -> that byte, control text as is."""
    out = []
    for t, k in zip(tokens, types):
        if k == _BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            out.append(bytes([int(t[3:5], 16)]))
        elif k in (_NORMAL, _UNUSED):
            out.append(t.replace(SPACE, " ").encode("utf-8"))
        else:
            out.append(t.encode("utf-8"))
    return out


def _sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int]) -> _Parts:
    """`llama`: SentencePiece BPE with byte fallback (see the module docstring)."""
    if "tokenizer.ggml.scores" not in meta:
        raise ModelLoadError("GGUF metadata key 'tokenizer.ggml.scores' is missing (a SentencePiece vocabulary)")
    variant = SPM_VARIANTS.get(meta.get("general.architecture"), SentencePieceVariant())
    pieces = tokens
    if variant.respell_space_runs:
        pieces = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = _vocab(pieces)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = pieces[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(pieces) else None

    def model() -> models.Model:
        if "tokenizer.ggml.merges" in meta:  # a BPE-trained SentencePiece vocabulary lists them
            merges = _file_merges(meta)
        else:
            ranks = ([-float(i) for i in range(len(pieces))] if variant.merges_by_file_order
                     else [float(s) for s in meta["tokenizer.ggml.scores"]])
            merges = _spm_merges(pieces, ranks, types)
        return models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)

    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", SPACE)]
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
        decode.append(decoders.Strip(" ", 1, 0))
    return _Parts(model, normalizers.Sequence(steps), None, decoders.Sequence(decode),
                  _token_bytes_spm(tokens, types), set(vocab), add_bos=True, strips_space=space_prefix)


# `tokenizer.ggml.model` -> builder; anything else (bert, t5, rwkv, ...) is refused.
TOKENIZER_MODELS = {"gpt2": _bpe, "llama": _sentencepiece, "gemma4": functools.partial(_bpe, pre="gemma4")}


def _optional_id(meta: dict[str, Any], key: str, vocab_size: int) -> int:
    """The id under `tokenizer.ggml.{key}`, or -1 when absent or outside the vocabulary."""
    value = meta.get(f"tokenizer.ggml.{key}")
    return int(value) if value is not None and 0 <= int(value) < vocab_size else -1


class Tokenizer:
    """Encode and decode text for a GGUF model, from its `tokenizer.*` metadata.

    Attributes: `vocab_size`; `bos_token_id`, `eos_token_id`, `eot_token_id`,
    `eom_token_id` (-1 when the file has none); `add_bos_token`,
    `add_eos_token` (the file's flags, else llama.cpp's defaults: BOS for
    SentencePiece and `llama-bpe`, none for other byte-level BPE; BOS always
    for `gemma4`; only `encode_prompt` adds it); `special_tokens` (control token
    string -> id, the tokens of `END_OF_TURN_TOKENS` among them whatever their
    type in the file, as llama.cpp makes them); `stop_token_ids` (EOS, EOT, EOM
    and every token of `END_OF_TURN_TOKENS` the vocabulary has); `token_bytes` (the bytes each id
    decodes to: nothing for a token of type unused, as llama.cpp renders it); `written_bytes` (each id's
    text as the vocabulary writes it, unused ones too: what a grammar engine matches); `unused_ids`;
    `chat_template`.

    `build=False` leaves the encoder (the BPE model and its merges: about 3 s of CPU for the
    262,144 pieces of Gemma 3's SentencePiece vocabulary) to the first encode or decode, for a
    reader of the metadata alone (`hybridgate info`); every check below is made either way.

    Raises (at construction):
        ModelLoadError: `tokenizer.ggml.model` is not in `TOKENIZER_MODELS`, or
            `tokenizer.ggml.pre` is not a supported pre-tokenizer (both named,
            with the supported list), or a key the model needs is missing.
    """

    def __init__(self, metadata: dict[str, Any], build: bool = True):
        kind = metadata.get("tokenizer.ggml.model")
        if kind not in TOKENIZER_MODELS:
            raise ModelLoadError(f"tokenizer.ggml.model {kind!r} is not supported (supported: "
                                 f"{sorted(TOKENIZER_MODELS)}: byte-level BPE and SentencePiece)")
        if "tokenizer.ggml.tokens" not in metadata:
            raise ModelLoadError("GGUF metadata key 'tokenizer.ggml.tokens' is missing")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types = [_CONTROL if t in END_OF_TURN_TOKENS else int(k)
                 for t, k in zip(tokens, metadata.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))]
        parts = TOKENIZER_MODELS[kind](metadata, tokens, types)
        self.model = kind
        self.vocab_size = len(tokens)
        self._read_special_ids(metadata, tokens, types)
        self.add_bos_token = parts.bos_always or bool(metadata.get("tokenizer.ggml.add_bos_token", parts.add_bos))
        self.add_eos_token = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self._tokens, self._types, self._parts = tokens, types, parts
        if build:
            self._as_text  # noqa: B018  builds both (the model is shared)
        # Filler tokens (type unused: Phi-3's `<|placeholder…|>`, `[PAD…]`) render as nothing, as llama.cpp's
        # `token_to_piece` renders them; their written text stays with the grammar engine (`written_bytes`).
        self.unused_ids: frozenset[int] = frozenset(i for i, k in enumerate(types) if k == _UNUSED)
        self.written_bytes = parts.token_bytes
        self.token_bytes = [b"" if i in self.unused_ids else raw for i, raw in enumerate(parts.token_bytes)] \
            if self.unused_ids else parts.token_bytes
        self._strips_space = parts.strips_space

    @functools.cached_property
    def token_texts(self) -> tuple[str | None, ...]:
        """Each id's text where its bytes are whole UTF-8 characters, else None (a byte token, part of a
        character): made once per tokenizer, so that the incremental detokenizers of every stream turn
        a whole token into text with one lookup instead of a decode of their buffer."""
        texts: list[str | None] = []
        for raw in self.token_bytes:
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                texts.append(None)
        return tuple(texts)

    def _read_special_ids(self, meta: dict[str, Any], tokens: list[str], types: list[int]) -> None:
        n = len(tokens)
        self.bos_token_id = _optional_id(meta, "bos_token_id", n)
        self.eos_token_id = _optional_id(meta, "eos_token_id", n)
        self.eot_token_id = _optional_id(meta, "eot_token_id", n)
        self.eom_token_id = _optional_id(meta, "eom_token_id", n)
        self.special_tokens = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == _CONTROL}
        ends = {self.special_tokens[t] for t in END_OF_TURN_TOKENS if t in self.special_tokens}
        ids = {self.eos_token_id, self.eot_token_id, self.eom_token_id} | ends
        self.stop_token_ids: frozenset[int] = frozenset(i for i in ids if i >= 0)

    @functools.cached_property
    def _model(self) -> models.Model:
        return self._parts.model()

    @functools.cached_property
    def _with_special(self) -> _HFTokenizer:
        return self._build(self._parts, self._model, self._tokens, self._types)

    @functools.cached_property
    def _as_text(self) -> _HFTokenizer:
        tok = self._build(self._parts, self._model, self._tokens, self._types)
        tok.encode_special_tokens = True
        self._with_special  # noqa: B018  the two are built together
        return tok

    @staticmethod
    def _build(parts: _Parts, model: models.Model, tokens: list[str], types: list[int]) -> _HFTokenizer:
        tok = _HFTokenizer(model)
        if parts.normalizer is not None:
            tok.normalizer = parts.normalizer
        if parts.pre_tokenizer is not None:
            tok.pre_tokenizer = parts.pre_tokenizer
        tok.decoder = parts.decoder
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
        )
        # User-defined tokens (e.g. `<think>`) are matched whole in text, as llama.cpp does.
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t in parts.vocab])
        return tok

    @classmethod
    def from_model(cls, model: GGUFModel) -> Tokenizer:
        return cls(model.metadata)

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; no BOS is prepended (it comes from the template, or `encode_prompt`).

        With `special_tokens=False`, a special-token string such as
        `<|im_end|>` in `text` is encoded as plain text. A SentencePiece
        vocabulary with `add_space_prefix` puts a space before the text and
        after every special token in it, as llama.cpp does.
        """
        tok = self._with_special if special_tokens else self._as_text
        return tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a raw-text prompt: BOS first when the vocabulary asks for it (`add_bos_token`), as
        llama.cpp's `llama_tokenize(add_special=true)` does; special-token strings are parsed."""
        ids = self.encode(text)
        return [self.bos_token_id, *ids] if self.add_bos_token and self.bos_token_id >= 0 else ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD (one per maximal invalid subpart).

        A SentencePiece vocabulary with `add_space_prefix` drops the one leading
        space its encoding added, as llama.cpp's detokenizer does. Filler (unused) ids add nothing
        (`token_bytes`)."""
        if not self.unused_ids:
            return self._with_special.decode(list(ids), skip_special_tokens=skip_special_tokens)
        kept = [i for i in ids if i not in self.unused_ids]
        text = self._with_special.decode(kept, skip_special_tokens=skip_special_tokens)
        # llama_detokenize drops the leading space of the first id's piece only: after a filler there is none.
        if self._strips_space and kept and ids[0] in self.unused_ids and self.token_bytes[kept[0]][:1] == b" ":
            text = " " + text
        return text

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]
