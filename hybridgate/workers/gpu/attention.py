"""Attention over a paged KV cache: the gather-by-block-table reference path.

Per layer, K and V are `[num_blocks, block_size, kv_heads, head_dim]` (held
flat as `[num_blocks * block_size, kv_heads, head_dim]`, one row per slot).
New keys and values go to their slots (`slot_mapping`); single-token entries
(decodes) gather their context by block table into a padded batch and run
one masked SDPA call; multi-token entries (prefill chunks) each run a causal
SDPA over their gathered context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridgate.models import ModelConfig
from hybridgate.workers.gpu.model import causal_sdpa


class PagedKVCache:
    """K and V slots for every layer on `device`."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]

    @staticmethod
    def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


@dataclass
class PagedStep:
    """Where one step's tokens go and what each attends to (int64 tensors on the device).

    slots `[num_tokens]`; decode_rows `[num_decodes]` (rows of single-token
    entries); decode_context `[num_decodes, max_context]` slots, padded;
    decode_mask bool `[num_decodes, 1, 1, max_context]` (None when no padding);
    prefills: (first row, new tokens, context slots `[context]`) per chunk.
    """

    slots: torch.Tensor
    decode_rows: torch.Tensor | None
    decode_context: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[tuple[int, int, torch.Tensor]]
    # Block-gather variant (the CUDA path): decode block tables `[num_decodes, max_blocks]` and a
    # mask over `max_blocks * block_size` positions; whole blocks are copied instead of single slots.
    decode_blocks: torch.Tensor | None = None
    decode_block_mask: torch.Tensor | None = None


class PagedAttention:
    def __init__(self, cache: PagedKVCache, step: PagedStep):
        self.cache, self.step = cache, step

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc, step = self.cache.k[layer], self.cache.v[layer], self.step
        kc.index_copy_(0, step.slots, k)
        vc.index_copy_(0, step.slots, v)
        if step.decode_rows is not None and not step.prefills and step.decode_rows.shape[0] == q.shape[0]:
            return self._decode(q, kc, vc)  # all decodes: rows are 0..n-1 in order
        out = torch.empty_like(q)  # [num_tokens, heads, head_dim]
        if step.decode_rows is not None:
            out[step.decode_rows] = self._decode(q[step.decode_rows], kc, vc)
        for start, n, context in step.prefills:
            k, v = kc.index_select(0, context), vc.index_select(0, context)
            out[start : start + n] = causal_sdpa(q[start : start + n], k, v, context.shape[0] - n)
        return out

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """One query per sequence: q `[batch, heads, head_dim]` → `[batch, heads, head_dim]`.

        `index_select` gathers the context 2.5x faster than advanced indexing on the CPU.
        """
        if self.step.decode_blocks is not None:
            return self._decode_blocks(q, kc, vc)
        ctx = self.step.decode_context  # [batch, width]
        batch, width = ctx.shape
        flat = ctx.reshape(-1)
        k = kc.index_select(0, flat).view(batch, width, *kc.shape[1:]).transpose(1, 2)  # [batch, kv_heads, width, dim]
        v = vc.index_select(0, flat).view(batch, width, *vc.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=self.step.decode_mask, enable_gqa=True)
        return out[:, :, 0, :]

    def _decode_blocks(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """Decode attention gathering whole blocks: one contiguous `block_size x kv_heads x head_dim`
        copy per block instead of one per token; positions past each context are masked."""
        tables = self.step.decode_blocks  # [batch, max_blocks]
        batch, blocks = tables.shape
        bs = self.cache.block_size
        flat = tables.reshape(-1)
        kb = kc.view(-1, bs, *kc.shape[1:]).index_select(0, flat)  # [batch * blocks, bs, kv_heads, dim]
        vb = vc.view(-1, bs, *vc.shape[1:]).index_select(0, flat)
        k = kb.view(batch, blocks * bs, *kc.shape[1:]).transpose(1, 2)  # [batch, kv_heads, blocks * bs, dim]
        v = vb.view(batch, blocks * bs, *vc.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=self.step.decode_block_mask,
                                             enable_gqa=True)
        return out[:, :, 0, :]
