"""transformers as the reference for embedding requests: a tiny random Qwen3 written as a GGUF with
last-token pooling, and its final-norm hidden states pooled and L2-normalised."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hybridgate.wire import PoolingType
from tiny_gguf import write_hf_qwen3


def tiny_qwen3_embedder(folder: Path):
    """(GGUF path, transformers' `Qwen3ForCausalLM`): fp32, 2 layers, hidden 64, 4 heads over 2 KV heads of
    16, the 260-token byte-level vocabulary, tied head, random norm weights (transformers initialises them to
    1, which would hide a missing norm), written with `qwen3.pooling_type` = 3 (last)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=True, max_position_embeddings=512, attn_implementation="eager")
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    path = write_hf_qwen3(folder / "qwen3-embed.gguf", model, pooling_type=PoolingType.LAST)
    return path, model


def want_embedding(model, prompt: list[int], pooling: PoolingType, dimensions: int | None = None) -> np.ndarray:
    """transformers' final-norm hidden states (`Qwen3Model.last_hidden_state`) pooled as asked, their first
    `dimensions` components (all: None), L2-normalised (float64)."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].double().numpy()
    pooled = {PoolingType.LAST: hidden[-1], PoolingType.MEAN: hidden.mean(0), PoolingType.CLS: hidden[0]}[pooling]
    pooled = pooled[:dimensions]
    return pooled / np.linalg.norm(pooled)
