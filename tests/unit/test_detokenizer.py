"""Incremental detokenizer against the tokenizers library's decode of all new ids."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridgate.models import IncrementalDetokenizer


@pytest.fixture(scope="module")
def id_pool(tokenizer):
    """Ids of single bytes (incl. UTF-8 lead and continuation bytes), CJK, emoji and ASCII."""
    byte_ids = [i for i in range(tokenizer.vocab_size) if len(tokenizer.token_bytes[i]) == 1]
    text = "你好世界日本語テキスト😀🎉👍🏽👨‍👩‍👧 hello world, the quick brown fox 123 éàü Привет"
    text_ids = sorted(set(tokenizer.encode(text)))
    assert len(byte_ids) > 200  # the vocab lacks bytes that never occur in UTF-8 (0xC0, 0xF5...)
    return byte_ids + text_ids


def run(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    deltas, offsets = [], []
    for i in ids:
        deltas.append(detok.step(i))
        offsets.append(detok.text_offset)
    deltas.append(detok.flush())
    return deltas, offsets


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_equal_reference_decode(tokenizer, id_pool, data):
    ids = data.draw(st.lists(st.sampled_from(id_pool), max_size=24))
    deltas, offsets = run(tokenizer, ids)
    reference = tokenizer.decode(ids)
    assert "".join(deltas) == reference
    assert offsets == sorted(offsets)
    emitted = ""
    for k, delta in enumerate(deltas[:-1]):
        emitted += delta
        # What is out after k+1 ids is the reference decode of those ids, less at
        # most one trailing U+FFFD that stands for bytes a later id may complete.
        partial = tokenizer.decode(ids[: k + 1])
        assert emitted == partial or emitted + "\ufffd" == partial
        assert reference.startswith(emitted)


def test_character_split_across_tokens_is_held_back(tokenizer):
    byte = {tokenizer.token_bytes[i]: i for i in range(tokenizer.vocab_size) if len(tokenizer.token_bytes[i]) == 1}
    euro = "€".encode()  # 3 bytes
    deltas, _ = run(tokenizer, [byte[euro[0:1]], byte[euro[1:2]], byte[euro[2:3]]])
    assert deltas == ["", "", "€", ""]


def test_flush_emits_replacement_for_an_unfinished_character(tokenizer):
    byte = {tokenizer.token_bytes[i]: i for i in range(tokenizer.vocab_size) if len(tokenizer.token_bytes[i]) == 1}
    ids = tokenizer.encode("ok") + [byte[b"\xe2"], byte[b"\x82"]]
    deltas, _ = run(tokenizer, ids)
    assert deltas[-1] == "\ufffd" and "".join(deltas) == tokenizer.decode(ids) == "ok\ufffd"


def test_prompt_ending_mid_character_emits_no_prompt_text(tokenizer):
    # The prompt ends with the first byte of "é"; the output starts with its second byte.
    byte = {tokenizer.token_bytes[i]: i for i in range(tokenizer.vocab_size) if len(tokenizer.token_bytes[i]) == 1}
    prompt = tokenizer.encode("caf") + [byte[b"\xc3"]]
    new = [byte[b"\xa9"]] + tokenizer.encode(" au lait")
    assert tokenizer.decode(prompt + new) == "café au lait"
    deltas, _ = run(tokenizer, new)
    assert "".join(deltas) == tokenizer.decode(new) == "\ufffd au lait"
    assert "caf" not in "".join(deltas)


def test_invalid_continuation_is_replaced_at_once(tokenizer):
    # ED A1 can never be completed (ED takes 80..9F, Table 3-7): two U+FFFD now, as the reference decode
    # gives, not held back until the end (Python's incremental codec would hold them).
    byte = {tokenizer.token_bytes[i]: i for i in range(tokenizer.vocab_size) if len(tokenizer.token_bytes[i]) == 1}
    deltas, _ = run(tokenizer, [byte[b"\xed"], byte[b"\xa1"]])
    assert deltas == ["", "\ufffd\ufffd", ""] and "".join(deltas) == tokenizer.decode([byte[b"\xed"], byte[b"\xa1"]])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_skipping_special_tokens_equals_reference_decode(tokenizer, id_pool, data):
    specials = sorted(tokenizer.special_tokens.values())
    ids = data.draw(st.lists(st.sampled_from(id_pool + specials), max_size=24))
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    text = "".join(detok.step(i) for i in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_ids_in_batches_give_the_reference_decode(tokenizer, id_pool, data):
    # The gateway detokenizes a reader's queued ids at once: however the ids are cut into batches,
    # the batches' texts joined are tokenizers' own decode, and each batch's text is the
    # reference decode of the ids so far, less at most one U+FFFD held for a later id.
    ids = data.draw(st.lists(st.sampled_from(id_pool), max_size=24))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=5)))
    detok, emitted = IncrementalDetokenizer(tokenizer), ""
    for lo, hi in zip([0, *cuts], [*cuts, len(ids)]):
        emitted += detok.steps(ids[lo:hi])
        partial = tokenizer.decode(ids[:hi])
        assert emitted == partial or emitted + "\ufffd" == partial
    assert emitted + detok.flush() == tokenizer.decode(ids)
