"""Filler tokens (GGUF token type unused) render as nothing, as llama.cpp renders them.

Reference: tests/golden/unused_tokens.json, llama.cpp's pieces and detokenized text (llama-cpp-python,
`tests/reference/make_unused_golden.py`) of id sequences with fillers before, between and after text, on
a byte-level BPE and a SentencePiece vocabulary (`tests/reference/unused_vocab.py`). Streaming
(`IncrementalDetokenizer`) gives the concatenated pieces; `Tokenizer.decode` (the /detokenize route)
gives llama_detokenize's text; a filler's id still reaches the grammar engine as its written text, marked
special so that grammar text never produces it.
"""

from __future__ import annotations

import hashlib

import pytest
from unused_vocab import UNUSED, VOCABS, write_unused_vocab

from conftest import golden_json
from hybridgate.models.detokenizer import IncrementalDetokenizer
from hybridgate.models.gguf_metadata import read_metadata
from hybridgate.models.tokenizer import Tokenizer

GOLDEN = golden_json("unused_tokens.json")


@pytest.fixture(scope="module", params=sorted(VOCABS))
def vocab(request, tmp_path_factory):
    path = write_unused_vocab(tmp_path_factory.mktemp("unused") / f"{request.param}.gguf", request.param)
    golden = GOLDEN["vocabs"][request.param]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == golden["sha256"]  # the file llama.cpp read
    metadata = read_metadata(path)
    return Tokenizer(metadata[0] if isinstance(metadata, tuple) else metadata), golden["cases"], request.param


def test_the_vocabularies_hold_fillers(vocab):
    tokenizer, cases, model = vocab
    _, types, _ = VOCABS[model]()
    assert tokenizer.unused_ids == {i for i, k in enumerate(types) if k == UNUSED} and len(tokenizer.unused_ids) >= 3
    assert any(set(c["ids"]) & tokenizer.unused_ids and c["text"] for c in cases)


def test_streamed_text_is_llama_cpp_pieces(vocab):
    tokenizer, cases, _ = vocab
    for case in cases:
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.step(i) for i in case["ids"]]
        assert "".join(deltas) + detok.flush() == "".join(case["pieces"]), case
        for i, piece in zip(case["ids"], case["pieces"]):
            if i in tokenizer.unused_ids:
                assert piece == "" and tokenizer.token_bytes[i] == b""


def test_decode_is_llama_cpp_detokenize(vocab):
    tokenizer, cases, _ = vocab
    for case in cases:
        assert tokenizer.decode(case["ids"]) == case["text"], case


def test_fillers_keep_their_written_text_for_the_grammar_engine(vocab):
    tokenizer, _, _ = vocab
    for i in tokenizer.unused_ids:
        assert tokenizer.written_bytes[i] == tokenizer.id_to_token(i).encode()
