"""The `gpt-4o` pre-tokenizer (gpt-oss, Llama 4) against o200k_base's own regex run by the `regex` module.

llama.cpp has no `.inp`/`.out` test data for this vocabulary. The reference split is tiktoken's
o200k_base pattern (tiktoken_ext/openai_public.py, the `pre_tokenizer` of openai/gpt-oss-20b's
tokenizer.json, quoted by llama.cpp's src/llama-vocab.cpp as the "original regex"), applied with
`regex.findall`, the engine tiktoken's pattern is written for; the pieces compared are the pre-tokenizer's
pieces as spans of the input text. A tiny vocabulary written as a gpt-oss file with gguf-py's writer
must load, encode as worked out by hand below, and give any text back.
"""

from __future__ import annotations

import functools

import gguf
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

import testdata
from corpus import TOKENIZER_CORPUS
from hybridgate.models import ModelLoadError, Tokenizer, read_metadata
from hybridgate.models.pretokenizers import pre_tokenizer

# tiktoken_ext/openai_public.py, o200k_base's pat_str, written here as it is written there.
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Where o200k's split is its own: contractions in any case, case changes inside a word, marks, digit runs.
SHAPES = [
    "DON'T WON'T I'M WE'RE THEY'VE SHE'D YOU'LL IT'S", "it'S We'Re i'M you'Ll", "o'clock rock'n'roll 'tis",
    "camelCaseWord HTTPServer getHTTPResponse XMLHttpRequest iPhone McDonald", "ǅungla ǈudevit ᾈ",
    "中文字符和English混合", "漢字かなカナ한국어", "ـبسم اللهـ", "ʰʲ ˈfoʊ ᵃ",
    "e\u0301te\u0301 n\u0303 a\u0308\u0304 \u0301lone mark", "क्षत्रिय ञ्ज", "ผู้หญิง",
    *("7" * n + " x" + "1" * n for n in range(1, 8)), "1234567 12.5 1,000,000 ٣٤٥٦ ⅻ ²³",
    "a\r\nb\r\n\r\nc\n\r", "line\r\n", "  \r\n  ", "trailing   ", "trailing\t \t", " ", "  ", "x \n \n",
    "path/to/file.txt//x?!/\n", "#include <stdio.h>\n\tint x;  // note\n", "'''\"\"\"", "a'", "'s", "' s",
    "\u00a0\u2003\u3000x\u202f", "emoji😀x😀 😀", "",
]


@functools.cache
def _built() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizer("gpt-4o").build()


def _pieces(text: str) -> list[str]:
    """The pre-tokenizer's pieces as spans of `text` (its offsets count characters)."""
    return [text[a:b] for _, (a, b) in _built().pre_tokenize_str(text)]


def _bpe_inp_strings() -> list[str]:
    """The test strings of every byte-level BPE vocabulary of llama.cpp's test data."""
    strings = []
    for path in sorted(testdata.llama_vocab_dir().glob("*.gguf.inp")):
        name = path.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp")
        if read_metadata(path.with_suffix("")).get("tokenizer.ggml.model") == "gpt2":
            strings += [text for text, _ in testdata.vocab_cases(name)]
    return strings


def test_split_equals_o200k_regex(llama_vocab_dir):
    corpus = [*TOKENIZER_CORPUS, *SHAPES, *_bpe_inp_strings()]
    assert len(corpus) >= 500
    split = [(t, _pieces(t), regex.findall(O200K_PATTERN, t)) for t in corpus]
    wrong = [case for case in split if case[1] != case[2]]
    assert not wrong, f"{len(wrong)}/{len(corpus)} differ, first: {wrong[0]}"


# Characters unassigned in this Python's Unicode tables (`unicodedata`) are left out: there the regex module and
# Oniguruma (the `tokenizers` library's engine) read different Unicode versions. A sweep of every code point in
# five contexts found the two splits apart on 17,559 code points, each unassigned in Unicode 14 (Python 3.11's);
# the additions of Unicode 15 and 16 tried (Kawi, CJK Extensions H and I, Kirat Rai, Ol Onal) split alike, CJK
# Extension J (Unicode 17) does not.
@given(text=st.text(st.characters(blacklist_categories=("Cs", "Cn")), max_size=40))
@settings(max_examples=500)
def test_any_text_splits_as_o200k_regex(text):
    assert _pieces(text) == regex.findall(O200K_PATTERN, text)


def test_split_shapes_worked_by_hand():
    assert _pieces("DON'T stop") == ["DON'T", " stop"]
    assert _pieces("getHTTPResponse") == ["get", "HTTPResponse"]
    assert _pieces("1234567") == ["123", "456", "7"]
    assert _pieces("x  \r\n") == ["x", "  \r\n"]


def test_aliases_are_llama_cpps():
    # llama.cpp's src/llama-vocab.cpp: these names set LLAMA_VOCAB_PRE_TYPE_GPT4O (minimax-m2 a type with the same
    # regex), none with ignore_merges.
    for name in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"):
        assert pre_tokenizer(name) is pre_tokenizer("gpt-4o")
    assert not pre_tokenizer("gpt-4o").ignore_merges


ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())  # GPT-2's 256 byte characters
MERGES = ["N '", "' T", "D O"]  # ranks 0, 1, 2
CONTROL = ["<|start|>", "<|end|>", "<|return|>"]


@pytest.fixture(scope="module")
def gptoss_style(tmp_path_factory):
    """A vocabulary-only gpt-oss file: the byte alphabet, three merges, harmony's control tokens."""
    tokens = ALPHABET + ["N'", "'T", "DO"] + CONTROL
    types = [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(CONTROL)) + [int(gguf.TokenType.CONTROL)] * 3
    path = tmp_path_factory.mktemp("gptoss") / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(tokens.index("<|return|>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return Tokenizer(read_metadata(path)), tokens


def test_gptoss_style_vocab_encodes_by_o200k_pieces(gptoss_style):
    tok, tokens = gptoss_style
    # "DON'T" is one piece, so "N '" (rank 0) merges first, then "D O"; "' T" finds no "'" left. GPT-2's
    # split would cut "'" off alone ("'T" is no contraction there: lower case only), leaving "N" unmerged.
    assert [tokens[i] for i in tok.encode("DON'T")] == ["DO", "N'", "T"]
    assert [tokens[i] for i in tok.encode("don'T")] == ["d", "o", "n", "'T"]
    assert tok.encode("<|start|>x<|end|>") == [tokens.index("<|start|>"), tokens.index("x"), tokens.index("<|end|>")]
    assert tok.eos_token_id == tokens.index("<|return|>")


def test_gptoss_style_vocab_round_trips(gptoss_style):
    tok, _ = gptoss_style
    for text in [*TOKENIZER_CORPUS, *SHAPES]:
        ids = tok.encode(text, special_tokens=False)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes[i] for i in ids) == text.encode()


def test_unknown_pre_tokenizer_still_names_gpt_4o():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": [],
            "tokenizer.ggml.pre": "o300k"}
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.pre 'o300k' is not supported .*'gpt-4o'"):
        Tokenizer(meta)
