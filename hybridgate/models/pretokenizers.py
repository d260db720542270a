"""Pre-tokenizers of BPE vocabularies: `tokenizer.ggml.pre` name -> split rules.

llama.cpp maps each `tokenizer.ggml.pre` name to a list of regexes
(`llm_tokenizer_bpe` in llama.cpp's src/llama-vocab.cpp), copied from the
`pre_tokenizer` of each model's published tokenizer.json. This table holds
those published pre-tokenizers as data: a sequence of steps, each one a
component of the `tokenizers` library, followed by the byte-level mapping
(`ByteLevel(use_regex=False)`, GPT-2's bytes-to-unicode alphabet) unless the
entry merges raw UTF-8 (llama.cpp's `byte_encode = false`: Gemma 4's
SentencePiece-style BPE). Names that llama.cpp maps to the same rules share an
entry (`PRE_TOKENIZER_NAMES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# GPT-2's split (openai/gpt-2 encoder.py; what `ByteLevel(use_regex=True)` applies).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's tokenizer.json (meta-llama/Meta-Llama-3-8B).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's tokenizer.json (Qwen/Qwen2-7B): Llama 3's with single digits.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: letters take their combining marks along.
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k_base (tiktoken; the tokenizer.json of openai/gpt-oss-20b), as llama.cpp quotes it for `gpt-4o`: letter runs
# split before an upper-case letter that follows lower-case ones, contractions (any case) kept with their word,
# combining marks with their letters, digits in runs of up to three, and `/` or line breaks after punctuation.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS
               + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS
               + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Gemma 4 (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4): runs of newlines and runs of anything else, no word split.
NEWLINE_RUNS = r"[^\n]+|\n+"
# DeepSeek LLM's tokenizer.json (deepseek-ai/deepseek-llm-7b-base), as llama.cpp copies it; written with
# escapes because several of its code points (U+1FD3, U+2126, U+212A, ...) change under NFC normalization.
DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)
DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
CJK_RUNS = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"


@dataclass(frozen=True)
class Split:
    """Split on every match of `pattern` (an Oniguruma regex), keeping matches as their own pieces."""

    pattern: str

    def build(self) -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Split(Regex(self.pattern), behavior="isolated")


@dataclass(frozen=True)
class Digits:
    """Split digits from the rest: each alone (`individual`) or runs of them."""

    individual: bool

    def build(self) -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Digits(individual_digits=self.individual)


@dataclass(frozen=True)
class PreTokenizer:
    """The split steps of one family, applied in order, then the byte-level alphabet (when `byte_encode`)."""

    steps: tuple[Split | Digits, ...]
    ignore_merges: bool = False  # a whole piece that is a token is taken as is (Llama 3's BPE `ignore_merges`)
    add_bos: bool = False  # llama.cpp's default for `tokenizer.ggml.add_bos_token` when the file has none
    # False: merges run on raw UTF-8, a space is written `▁` and a character outside the vocabulary falls back
    # to `<0xNN>` byte tokens, as in SentencePiece (llama.cpp's `byte_encode = false` with `escape_whitespaces`)
    byte_encode: bool = True
    bos_always: bool = False  # BOS even where the file's `add_bos_token` is false (llama.cpp's Gemma 4 override)

    def build(self) -> pre_tokenizers.PreTokenizer:
        """A `tokenizers` pre-tokenizer: the steps, then `ByteLevel` without a regex of its own (if `byte_encode`)."""
        steps = [s.build() for s in self.steps]
        if self.byte_encode:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        return pre_tokenizers.Sequence(steps)


GPT2 = PreTokenizer((Split(GPT2_SPLIT),))
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # llama.cpp's fallback (LLAMA_VOCAB_PRE_TYPE_DEFAULT), also for a file without `tokenizer.ggml.pre`.
    "default": PreTokenizer((Split(r"[\p{P}\$\+<=>\^~\|]+"), Split(GPT2_SPLIT), Split(r"\p{N}+"),
                             Split("[0-9][0-9][0-9]"))),
    "gpt-2": GPT2,
    "llama-bpe": PreTokenizer((Split(LLAMA3_SPLIT),), ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizer((Split(QWEN2_SPLIT),)),
    "qwen35": PreTokenizer((Split(QWEN35_SPLIT),)),
    "deepseek-llm": PreTokenizer((Split(r"[\r\n]"), Split(DEEPSEEK_LLM_LETTERS), Split(DEEPSEEK_LLM_PUNCT),
                                  Split(r"\s+$"), Split(CJK_RUNS), Digits(individual=False))),
    "deepseek-coder": PreTokenizer((Split(r"[\r\n]"), Split(r"\s?\p{L}+"), Split(r"\s?\p{P}+"), Split(CJK_RUNS),
                                    Digits(individual=True))),
    # tiiuae/falcon-7b, as llama.cpp writes it: punctuation runs, GPT-2's split, then runs of three digits.
    "falcon": PreTokenizer((Split(r"[\p{P}\$\+<=>\^~\|`]+"), Split(GPT2_SPLIT), Split("[0-9][0-9][0-9]"))),
    # bigcode/starcoder, SmolLM, Refact, Command-R: every digit alone, then GPT-2's split.
    "starcoder": PreTokenizer((Digits(individual=True), Split(GPT2_SPLIT))),
    # gpt-oss, Llama 4: o200k_base's split; llama.cpp sets no `ignore_merges` for it.
    "gpt-4o": PreTokenizer((Split(GPT4O_SPLIT),)),
    # The split of `tokenizer.ggml.model = gemma4` (whatever the file's `tokenizer.ggml.pre`): llama.cpp takes a run
    # of newlines that is a token whole; the merges of Gemma 4's vocabulary reach each of those tokens anyway
    # (tests/unit/test_tokenizer_conformance.py), so BPE runs on every piece. BOS is forced on (llama.cpp PR 21500).
    "gemma4": PreTokenizer((Split(NEWLINE_RUNS),), add_bos=True, byte_encode=False, bos_always=True),
}

# Every accepted name -> its entry in PRE_TOKENIZERS (llama.cpp's aliases of the same rules).
PRE_TOKENIZER_NAMES: dict[str, str] = {
    "default": "default",
    "gpt-2": "gpt-2", "gpt2": "gpt-2", "mpt": "gpt-2", "phi-2": "gpt-2", "olmo": "gpt-2",
    "llama-bpe": "llama-bpe", "llama3": "llama-bpe", "llama-v3": "llama-bpe",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2",
    "qwen35": "qwen35",
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
    "starcoder": "starcoder", "smollm": "starcoder", "refact": "starcoder", "command-r": "starcoder",
    # minimax-m2 is a type of its own in llama.cpp, with the same regex and flags.
    "gpt-4o": "gpt-4o", "llama4": "gpt-4o", "kanana2": "gpt-4o", "talkie": "gpt-4o", "minimax-m2": "gpt-4o",
    "gemma4": "gemma4", "granite-embed-multi-311m": "gemma4",
}


def pre_tokenizer(name: str) -> PreTokenizer:
    """The split rules of `name` (a `tokenizer.ggml.pre` value).

    Raises:
        KeyError: `name` is not in `PRE_TOKENIZER_NAMES`.
    """
    return PRE_TOKENIZERS[PRE_TOKENIZER_NAMES[name]]
