"""Tokenizer ids against the reference (tests/golden/tokenizer.json, from transformers)."""

from __future__ import annotations

import pytest

from conftest import golden_json

GOLDEN = golden_json("tokenizer.json")
CASES = list(zip(GOLDEN["strings"], GOLDEN["ids"], GOLDEN["decoded"]))


def test_corpus_is_large_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize(("text", "ids", "decoded"), CASES, ids=[f"s{i}" for i in range(len(CASES))])
def test_ids_equal_reference(tokenizer, text, ids, decoded):
    assert tokenizer.encode(text) == ids
    assert tokenizer.decode(ids) == decoded == text


def test_digits_split_one_by_one_after_spaces(tokenizer):
    # The `smollm` pre-tokenizer; transformers' GGUF loader ignores it and merges "  " differently.
    assert "year 2024 and  42 apples" in GOLDEN["transformers_gguf_differs"]
    pieces = [tokenizer.id_to_token(i) for i in tokenizer.encode("a 123")]
    assert pieces == ["a", "Ġ", "1", "2", "3"]


def test_special_token_strings(tokenizer):
    assert tokenizer.encode("<|im_start|>user") == [1, tokenizer.encode("user")[0]]
    as_text = tokenizer.encode("<|im_end|>", special_tokens=False)
    assert 2 not in as_text and len(as_text) > 1
    assert tokenizer.decode(as_text) == "<|im_end|>"


def test_metadata(tokenizer):
    assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id) == (49152, 1, 2)
    assert tokenizer.add_bos_token is False
    assert len(tokenizer.special_tokens) == 17


def test_a_tokenizer_built_on_first_use_encodes_as_the_reference(gguf_model):
    """`build=False` (hybridgate info) makes every check at once and the encoder at the first encode."""
    from hybridgate.models import Tokenizer

    lazy = Tokenizer(gguf_model.metadata, build=False)
    assert "_with_special" not in vars(lazy) and "_as_text" not in vars(lazy)
    for text, ids, decoded in CASES[:20]:  # transformers' ids
        assert lazy.encode(text) == ids and lazy.decode(ids) == decoded
    assert lazy.encode("<|im_end|>", special_tokens=False) != [2]  # the as-text encoder, built with it
