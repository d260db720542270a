"""YaRN RoPE as the loader reads it from GGUF metadata, against transformers' `_compute_yarn_parameters`.

The divisors of each RoPE frequency and the cos/sin factor from `{arch}.rope.scaling.*` (llama.cpp's keys)
give transformers' inverse frequencies and attention scaling for the same parameters: with the correction
range rounded (transformers' default `truncate`, llama.cpp's `ggml_rope_yarn_corr_dims`; the qwen3 row) and
unrounded (gpt-oss's config), with the default betas and with others.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridgate.models import ARCHITECTURES
from hybridgate.models.gguf_file import _yarn_attention_factor, _yarn_factors


@pytest.mark.parametrize("arch, head_dim, theta, factor, original, betas", [
    ("qwen3", 128, 1e6, 4.0, 32768, None),
    ("qwen3", 64, 1e4, 8.0, 2048, (16.0, 2.0)),
    ("gpt-oss", 64, 150000.0, 32.0, 4096, None),
    ("gpt-oss", 16, 150000.0, 32.0, 4096, None),
])
def test_yarn_matches_transformers(arch, head_dim, theta, factor, original, betas):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    row = ARCHITECTURES[arch]
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": original,
            "truncate": row.yarn_truncate}
    meta = {f"{arch}.rope.freq_base": theta, f"{arch}.rope.scaling.factor": factor,
            f"{arch}.rope.scaling.original_context_length": original}
    if betas:
        rope |= {"beta_fast": betas[0], "beta_slow": betas[1]}
        meta |= {f"{arch}.rope.scaling.yarn_beta_fast": betas[0], f"{arch}.rope.scaling.yarn_beta_slow": betas[1]}
    config = Qwen3Config(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_parameters=rope,
                         max_position_embeddings=original * int(factor))
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    divisors = np.asarray(_yarn_factors(row, meta, head_dim))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim) / divisors
    np.testing.assert_allclose(inv, want_inv.numpy(), rtol=2e-6)
    assert (divisors[0], divisors[-1]) == (1.0, factor)  # the fastest pair extrapolates, the slowest interpolates
    assert _yarn_attention_factor(row, meta) == pytest.approx(want_factor, rel=1e-12)
