"""Tokenizers from GGUF metadata against llama.cpp's tokenizer test data and transformers (Gemma 3 270M, Gemma 4).

llama.cpp's `ggml-vocab-*.gguf` files carry only metadata; their `.inp`/`.out` pairs give, for each
test string, the ids of the model's Hugging Face tokenizer (without BOS, special-token strings as
text). Each file is loaded once, in its own test. llama.cpp's test-tokenizer-0 checks the ids only;
the round trip is checked here too: decoding those ids gives the string back for every file (with
a SentencePiece space prefix, the concatenated token bytes are the string after one space).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import testdata
from conftest import golden_json
from hybridgate.models import ModelLoadError, Tokenizer, read_metadata
from hybridgate.models.pretokenizers import pre_tokenizer

# Vocabulary file -> the strings of its stop tokens: EOS and the end-of-turn tokens of each model's
# published generation config / chat template (Llama 3: <|eot_id|>; Qwen: <|im_end|>; Phi-3: <|end|>; Gemma 4:
# <turn|> and, after its tool calls, <|tool_response>, both in llama.cpp's EOG list).
SUPPORTED = {
    "gpt-2": {"<|endoftext|>"},
    "llama-bpe": {"<|end_of_text|>", "<|eot_id|>"},
    "qwen2": {"<|endoftext|>", "<|im_end|>"},
    "qwen35": {"<|endoftext|>", "<|im_end|>"},
    "deepseek-llm": {"<｜end▁of▁sentence｜>"},
    "deepseek-coder": {"<｜end▁of▁sentence｜>"},
    "falcon": {"<|endoftext|>"},
    "starcoder": {"<|endoftext|>"},
    "refact": {"<|endoftext|>"},
    "command-r": {"<|END_OF_TURN_TOKEN|>"},
    "mpt": {"<|endoftext|>"},
    "llama-spm": {"</s>"},
    "phi-3": {"<|endoftext|>", "<|end|>"},
    "gemma-4": {"<eos>", "<turn|>", "<|tool_response>"},
}
# Refused at load: llama.cpp's WordPiece (bert) and Unigram (t5) models are not built here.
REFUSED = {"bert-bge": "tokenizer.ggml.model 'bert'", "nomic-bert-moe": "tokenizer.ggml.model 't5'"}
# Vocabulary files without test strings: they must load (no tokenizer.ggml.pre on the gpt2 ones).
WITHOUT_CASES = ("aquila", "baichuan", "gpt-neox")


def test_every_vocab_file_is_classified(llama_vocab_dir):
    names = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in llama_vocab_dir.glob("*.gguf")}
    assert names == set(SUPPORTED) | set(REFUSED) | set(WITHOUT_CASES)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_vocab_file_matches_llama_cpp_test_data(llama_vocab_dir, name):
    meta = read_metadata(llama_vocab_dir / f"ggml-vocab-{name}.gguf")
    tok = Tokenizer(meta)
    cases = testdata.vocab_cases(name)
    assert len(cases) >= 46
    wrong = [(text, ids, got) for text, ids in cases if (got := tok.encode(text, special_tokens=False)) != ids]
    assert not wrong, f"{len(wrong)}/{len(cases)} strings differ, first: {wrong[0]}"
    assert [text for text, ids in cases if tok.decode(ids) != text] == []
    # token_bytes (what the streaming detokenizer emits): SentencePiece's prefix space is one more byte.
    spm = meta["tokenizer.ggml.model"] != "gpt2"
    prefix = b" " if spm and meta.get("tokenizer.ggml.add_space_prefix", True) else b""
    streamed = {t: b"".join(tok.token_bytes[i] for i in ids) for t, ids in cases}
    assert [t for t, b in streamed.items() if b != (prefix + t.encode() if t else b"")] == []
    assert {tok.id_to_token(i) for i in tok.stop_token_ids} == SUPPORTED[name]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_vocab_file_is_refused_naming_its_model(llama_vocab_dir, name):
    with pytest.raises(ModelLoadError, match=REFUSED[name]) as info:
        Tokenizer(read_metadata(llama_vocab_dir / f"ggml-vocab-{name}.gguf"))
    assert "'gpt2'" in str(info.value) and "'llama'" in str(info.value)


@pytest.mark.parametrize("name", WITHOUT_CASES)
def test_vocab_files_without_cases_load_and_round_trip(llama_vocab_dir, name):
    tok = Tokenizer(read_metadata(llama_vocab_dir / f"ggml-vocab-{name}.gguf"))
    for text in ("Hello world", "  two  spaces\n\ttab 12345 ½ 你好 🦙"):
        assert tok.decode(tok.encode(text, special_tokens=False)) == text


def _tiny_bpe(**extra) -> dict:
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], **extra}


def test_unknown_pre_tokenizer_is_refused_with_the_supported_names():
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.pre 'bloom' is not supported") as info:
        Tokenizer(_tiny_bpe(**{"tokenizer.ggml.pre": "bloom"}))
    for name in ("default", "gpt-2", "llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder", "falcon", "starcoder",
                 "refact", "command-r", "mpt", "smollm", "gpt2", "gpt-4o", "llama4", "gemma4"):
        assert f"'{name}'" in str(info.value)


def test_unknown_tokenizer_model_is_refused_with_the_supported_names():
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.model 'rwkv' is not supported .*'gpt2'.*'llama'"):
        Tokenizer(_tiny_bpe(**{"tokenizer.ggml.model": "rwkv"}))


def test_missing_pre_tokenizer_reads_as_llama_cpp_default():
    # llama.cpp (llama-vocab.cpp): an empty pre-tokenizer type is LLAMA_VOCAB_PRE_TYPE_DEFAULT, whose first
    # rule isolates punctuation runs, so "a ," is three pieces where GPT-2's rules keep " ," whole.
    tokens = ["a", "\u0120", ",", "\u0120,"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["\u0120 ,"]}
    assert Tokenizer(meta).encode("a ,") == [0, 1, 2]
    assert Tokenizer({**meta, "tokenizer.ggml.pre": "gpt-2"}).encode("a ,") == [0, 3]


@pytest.fixture(scope="module")
def llama_spm(llama_vocab_dir):
    return Tokenizer(read_metadata(llama_vocab_dir / "ggml-vocab-llama-spm.gguf"))


def test_spm_token_bytes_and_special_ids(llama_spm):
    tok = llama_spm
    # Llama's byte tokens are ids 3..258.
    assert tok.token_bytes[3 + 0x41] == b"A" and tok.id_to_token(3 + 0x41) == "<0x41>"
    assert tok.token_bytes[tok.encode("the", special_tokens=False)[0]] == b" the"
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token, tok.add_eos_token) == (1, 2, True, False)
    assert tok.encode_prompt("the") == [1, *tok.encode("the")]


def test_spm_text_after_a_special_token_gets_the_space_prefix(llama_spm):
    # llama.cpp's SPM tokenize: every text fragment after a special token is prefixed with a space.
    tok = llama_spm
    assert tok.encode("</s>Hello") == [2, *tok.encode("Hello")]
    assert tok.encode("</s>", special_tokens=False) != [2]


GEMMA3 = golden_json("gemma3_tokenizer.json")


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    return Tokenizer(read_metadata(gemma3_path))


def _assert_equals_golden(tok: Tokenizer, golden: dict, at_least: int) -> None:
    """`tok` encodes each string of a transformers golden file to its ids and decodes those to its text."""
    assert len(golden["strings"]) >= at_least
    wrong = [(s, ids) for s, ids in zip(golden["strings"], golden["ids"]) if tok.encode(s) != ids]
    assert not wrong, f"{len(wrong)} differ, first: {wrong[0]}"
    decoded = zip(golden["strings"], golden["ids"], golden["decoded"])
    assert [s for s, ids, d in decoded if tok.decode(ids) != d] == []


def test_gemma3_encodes_and_decodes_as_transformers(gemma3):
    _assert_equals_golden(gemma3, GEMMA3, at_least=90)


def test_gemma3_metadata_and_stop_tokens(gemma3):
    assert (gemma3.model, gemma3.vocab_size, gemma3.bos_token_id, gemma3.add_bos_token) == ("llama", 262_144, 2, True)
    assert {gemma3.id_to_token(i) for i in gemma3.stop_token_ids} == {"<eos>", "<end_of_turn>"}
    assert gemma3.encode_prompt("Hi")[0] == 2


GEMMA4 = golden_json("gemma4_tokenizer.json")


@pytest.fixture(scope="module")
def gemma4_meta(llama_vocab_dir):
    return read_metadata(llama_vocab_dir / "ggml-vocab-gemma-4.gguf")


@pytest.fixture(scope="module")
def gemma4(gemma4_meta):
    return Tokenizer(gemma4_meta)


def test_gemma4_encodes_and_decodes_as_transformers(gemma4):
    _assert_equals_golden(gemma4, GEMMA4, at_least=120)


def test_gemma4_takes_a_run_of_newlines_that_is_a_token_whole(gemma4, gemma4_meta):
    # llama.cpp's BPE session for the gemma4 pre-tokenizer (PR 21343): a piece of newlines only that is a token.
    runs = {len(t): i for i, t in enumerate(gemma4_meta["tokenizer.ggml.tokens"]) if t and set(t) == {"\n"}}
    assert sorted(runs) == list(range(1, 32))
    assert {n: gemma4.encode("\n" * n) for n in runs} == {n: [i] for n, i in runs.items()}


def test_gemma4_ignores_the_files_pre_and_space_prefix_and_always_adds_bos(gemma4_meta):
    # llama.cpp: the gemma4 model names its pre-tokenizer itself, its BPE path adds no space prefix, and
    # add_bos_token false is overridden to true (PR 21500).
    tok = Tokenizer({**gemma4_meta, "tokenizer.ggml.pre": "bloom", "tokenizer.ggml.add_space_prefix": True,
                     "tokenizer.ggml.add_bos_token": False})
    cases = testdata.vocab_cases("gemma-4")[:20]
    assert [tok.encode(text, special_tokens=False) for text, _ in cases] == [ids for _, ids in cases]
    assert tok.add_bos_token and tok.encode_prompt("Hi") == [2, *tok.encode("Hi")]


def test_gemma4_pre_tokenizer_names_are_llama_cpps():
    # llama.cpp's src/llama-vocab.cpp: both names set LLAMA_VOCAB_PRE_TYPE_GEMMA4 (raw UTF-8, spaces escaped).
    assert pre_tokenizer("granite-embed-multi-311m") is pre_tokenizer("gemma4")
    assert not pre_tokenizer("gemma4").byte_encode and pre_tokenizer("gemma4").bos_always


def test_gemma4_turn_ends_are_control_tokens(gemma4):
    # llama.cpp's EOG list makes `<|tool_response>` (user-defined in the file, id 50) a control token.
    assert (gemma4.special_tokens["<turn|>"], gemma4.special_tokens["<|tool_response>"]) == (106, 50)
    assert gemma4.encode("<|tool_response>") == [50] and 50 not in gemma4.encode("<|tool_response>",
                                                                                 special_tokens=False)
    assert gemma4.decode([50, 106], skip_special_tokens=True) == ""


def test_read_metadata_equals_gguf_readers_contents(llama_vocab_dir, tmp_path):
    import gguf

    path = llama_vocab_dir / "ggml-vocab-llama-spm.gguf"  # strings, float scores, int types, bools, ids
    reader = gguf.GGUFReader(path)
    reference = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert read_metadata(path) == reference
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:100_000])
    with pytest.raises(ModelLoadError, match="malformed GGUF metadata at key 'tokenizer.ggml.tokens'"):
        read_metadata(cut)
    cut.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_metadata(cut)


@pytest.fixture(scope="module")
def gpt2(llama_vocab_dir):
    return Tokenizer(read_metadata(llama_vocab_dir / "ggml-vocab-gpt-2.gguf"))


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@given(text=_TEXT)
@example(text="\u2581")  # SentencePiece's space mark, which a run drew once
@example(text="a \u2581b")
@settings(max_examples=300)
def test_any_text_round_trips(llama_spm, gpt2, gemma4, text):
    # The models are lossless (byte fallback / byte-level alphabet), as llama.cpp's test-tokenizer-1 checks,
    # but for SentencePiece's own space mark: it writes a space as U+2581, so a U+2581 in the text reads back as
    # a space (as SentencePiece's decoder gives it).
    for tok in (llama_spm, gpt2, gemma4):
        ids = tok.encode(text, special_tokens=False)
        want = text if tok is gpt2 else text.replace("\u2581", " ")
        assert tok.decode(ids) == want
        assert b"".join(tok.token_bytes[i] for i in ids).decode() == (" " + want if tok is llama_spm and text else want)
