"""Write two vocabulary-only GGUF files whose vocabularies hold filler tokens of type unused.

One byte-level BPE vocabulary (`gpt2`) and one SentencePiece vocabulary (`llama`, the
shape of Phi-3's, whose `<|placeholder…|>` and `[PAD…]` fillers are of type unused),
each with control, user-defined, byte and normal tokens beside the fillers. The
files carry a Llama architecture's hyperparameters but no tensors: llama.cpp loads
them with `vocab_only`, and `hybridgate.models.Tokenizer` reads their metadata.
Written identically by `make_unused_golden.py` (with llama-cpp-python) and by
`tests/unit/test_unused_tokens.py`; the golden file records each file's sha256.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from tiny_gguf import byte_level_alphabet

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


def _gpt2() -> tuple[list[str], list[int], dict]:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_level_alphabet()
    types = [CONTROL] * 3 + [NORMAL] * 256
    tokens += ["Ġt", "he", "Ġthe", "[PAD0]", "[PAD1]", "<think>", "<|placeholder1|>"]
    types += [NORMAL, NORMAL, NORMAL, UNUSED, UNUSED, USER_DEFINED, UNUSED]
    extra = {"merges": ["Ġ t", "h e", "Ġt he"], "pre": "default", "bos": 1, "eos": 2}
    return tokens, types, extra


def _spm() -> tuple[list[str], list[int], dict]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    pieces = [SPACE, "h", "e", "l", "o", "w", "r", "d", "he", "ll", SPACE + "h", SPACE + "w", "llo", SPACE + "he",
              SPACE + "hello", SPACE + "world"]
    tokens += pieces + ["<|placeholder1|>", "<|placeholder2|>", "[PAD0]", "<|end|>", "<|user|>"]
    types += [NORMAL] * len(pieces) + [UNUSED, UNUSED, UNUSED, CONTROL, USER_DEFINED]
    return tokens, types, {"bos": 1, "eos": 2, "unk": 0}


VOCABS = {"gpt2": _gpt2, "llama": _spm}


def write_unused_vocab(path: Path, model: str) -> Path:
    """A vocabulary-only GGUF of tokenizer model `model` (a key of `VOCABS`) at `path`."""
    tokens, types, extra = VOCABS[model]()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(8)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if model == "gpt2":
        writer.add_tokenizer_pre(extra["pre"])
        writer.add_token_merges(extra["merges"])
        writer.add_add_bos_token(False)
    else:
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        writer.add_unk_token_id(extra["unk"])
        writer.add_add_bos_token(True)
    writer.add_bos_token_id(extra["bos"])
    writer.add_eos_token_id(extra["eos"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def id_cases(model: str) -> list[list[int]]:
    """The id sequences whose text is compared: every filler alone, fillers between, before and after text."""
    tokens, types, _ = VOCABS[model]()
    index = {t: i for i, t in enumerate(tokens)}
    unused = [i for i, k in enumerate(types) if k == UNUSED]
    if model == "gpt2":
        words = [index["Ġthe"], index["Ġt"], index["he"], index["h"], index["!"]]
    else:
        words = [index[SPACE + "hello"], index[SPACE + "world"], index["he"], index["llo"], index["<0x21>"]]
    user = [i for i, k in enumerate(types) if k == USER_DEFINED]
    cases = [[i] for i in unused] + [[w, u, w] for w, u in zip(words, unused * 3)]
    cases += [[u, *words] for u in unused] + [[*words, *unused]] + [[words[0], *user, unused[0], words[1]]]
    return cases
