"""Per-layer shapes from GGUF metadata (`hybridgate.models.layer_layout`), against llama.cpp's rules."""

from __future__ import annotations

import pytest

from hybridgate.models import ARCHITECTURES, ModelLoadError
from hybridgate.models.layer_layout import layer_fields, per_layer


def test_a_key_is_one_number_for_every_layer_or_an_array_of_them():
    assert per_layer({"a": 7}, "a", 3, 0) == (7, 7, 7)
    assert per_layer({"a": [1, 2, 3]}, "a", 3, 0) == (1, 2, 3)
    assert per_layer({}, "a", 2, 5) == (5, 5)
    with pytest.raises(ModelLoadError, match="a has 2 entries, expected block_count 3"):
        per_layer({"a": [1, 2]}, "a", 3, 0)


def gemma4_meta(layers: int, shared: int, **extra) -> dict:
    return {"gemma4.attention.head_count": 8, "gemma4.attention.head_count_kv": 1,
            "gemma4.feed_forward_length": 2048, "gemma4.attention.shared_kv_layers": shared,
            "gemma4.attention.key_length_swa": 256} | extra


@pytest.mark.parametrize(("layers", "shared", "period"), [(35, 20, 5), (42, 18, 6), (6, 2, 2)])
def test_shared_layers_read_the_layer_llama_cpp_reuses(layers, shared, period):
    # Gemma 3n/4's layout: `period - 1` sliding layers then a full one, the last owning layer full. llama.cpp
    # (src/llama-model.cpp, the KV cache's `reuse` callback): layer il >= n_layer_kv_from_start reads
    # n_layer_kv_from_start - 2 when it slides, n_layer_kv_from_start - 1 when it does not.
    windows = tuple(0 if i % period == period - 1 else 512 for i in range(layers))
    first = layers - shared
    fields = layer_fields(ARCHITECTURES["gemma4"], gemma4_meta(layers, shared), {}, layers, 512, windows)
    want = tuple(i if i < first else first - (2 if windows[i] else 1) for i in range(layers))
    assert fields["layer_kv_source"] == want
    assert fields["layer_head_dims"] == tuple(256 if w else 512 for w in windows)
    assert all(qkv == ("attn_q",) for qkv in fields["layer_qkv"][first:])
    assert all(qkv == ("attn_q", "attn_k", "attn_k") for qkv in fields["layer_qkv"][:first])  # no attn_v: V = K


def test_a_shared_layer_with_no_earlier_layer_of_its_kind_is_refused():
    windows = (512, 512, 0)  # the only full layer is the shared one
    with pytest.raises(ModelLoadError, match="layer 2 has no earlier full layer to share K/V with"):
        layer_fields(ARCHITECTURES["gemma4"], gemma4_meta(3, 1), {}, 3, 512, windows)


def test_a_sliding_head_size_that_differs_between_k_v_and_rope_is_refused():
    meta = gemma4_meta(2, 0, **{"gemma4.attention.value_length_swa": 128})
    with pytest.raises(ModelLoadError, match="value_length_swa=128 differs from the sliding layers' key_length_swa"):
        layer_fields(ARCHITECTURES["gemma4"], meta, {}, 2, 512, (512, 0))
