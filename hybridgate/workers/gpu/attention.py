"""Attention over a paged KV cache: the Triton kernels' path (`KernelAttention`, CUDA's default) and the
gather-by-block-table reference path (`PagedAttention`, the CPU device's and the tests' reference).

One choice point, `attention_kind`: `--gpu-attention auto` runs the kernels on CUDA and the reference
elsewhere; `triton` or `reference` force one (the kernels on a CPU device only under Triton's interpreter,
`TRITON_INTERPRET=1`, as the tests run them). The same choice picks the layer's fused Triton ops or its
eager torch ops (`gpu.ops`) and whether decode graphs are captured (`gpu.graphs`).

The reference path:

Per layer, K and V are `[num_blocks, block_size, kv_heads, head_dim]` (held
flat as `[num_blocks * block_size, kv_heads, head_dim]`, one row per slot).
New keys and values go to their slots (`slot_mapping`); single-token entries
(decodes) gather their context by block table into a padded batch and run
one masked SDPA call; multi-token entries (prefill chunks) each run a causal
SDPA over their gathered context.

Sliding-window layers (`config.layer_windows`) keep every key in the cache (so
the prefix cache, preemption and the hand-off see one layout for all layers)
and limit what a query reads: a prefill chunk gathers only the slots its
window reaches, and a decode adds `position >= length - window` to its padding
mask, computed on the device from the step's lengths, so a captured CUDA graph
covers it with no Python branch per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hybridgate.models import ModelConfig
from hybridgate.workers.gpu.layers import causal_sdpa, layer_sinks, sdpa, window_start


class PagedKVCache:
    """K and V slots on `device` for every layer that owns K/V, each `[slots, kv_heads, head_dim]` of its own
    shape; a layer that shares another's K/V holds that layer's tensors (`ModelConfig.per_layer_kv`). Also each layer's
    attention sinks (float32 `[heads]`, or None per layer when the model has none), made once here: a captured
    CUDA graph may copy nothing from the host."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        make = lambda i: torch.empty(  # noqa: E731
            (num_blocks * block_size, config.layer_kv_heads[i], config.layer_head_dims[i]), device=device, dtype=dtype)
        self.k, self.v = config.per_layer_kv(make), config.per_layer_kv(make)
        self.sinks = [layer_sinks(config, layer, device) for layer in range(config.num_layers)]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every K and V tensor allocated, each once."""
        return [t for i in self.config.kv_layers for t in (self.k[i], self.v[i])]

    @staticmethod
    def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block across the layers that own K/V, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return block_size * config.kv_values_per_token * itemsize


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
    # Context length of each decode, int64 `[num_decodes]`: sliding-window layers mask from it.
    decode_lengths: torch.Tensor | None = None


ATTENTION_KINDS = ("auto", "triton", "reference")


def attention_kind(setting: str, device: torch.device) -> str:
    """"triton" or "reference" for `--gpu-attention` `setting` on `device` (see the module doc).

    Raises ValueError naming the setting: an unknown value, or `triton` on a device Triton cannot run
    on (a CPU device without `TRITON_INTERPRET=1`, or triton not installed)."""
    if setting not in ATTENTION_KINDS:
        raise ValueError(f"--gpu-attention must be one of {', '.join(ATTENTION_KINDS)}, got {setting!r}")
    if setting == "reference" or (setting == "auto" and device.type != "cuda"):
        return "reference"
    try:
        import triton
    except ImportError:
        if setting == "auto":
            return "reference"
        raise ValueError("--gpu-attention triton: the triton package is not installed") from None
    if device.type != "cuda" and not triton.knobs.runtime.interpret:  # TRITON_INTERPRET=1, read by Triton
        raise ValueError(f"--gpu-attention triton on a {device.type} device runs only under Triton's "
                         "interpreter: set TRITON_INTERPRET=1 (slow; for tests)")
    return "triton"


@dataclass
class KernelStep:
    """What the Triton kernels read for one step (tensors on the device): slots int64 `[num_tokens]`
    (-1: a padding row, not written); block_tables int32 `[num_seqs, max_blocks]`; seq_lens int32
    `[num_seqs]` (keys after this step); q_starts int32 `[num_seqs + 1]`; max_q_len and num_splits
    (`kernels.attention.paged_attention`)."""

    slots: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    q_starts: torch.Tensor
    max_q_len: int
    num_splits: int = 1


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    """The SM count of CUDA device `index` (asked once: num_splits_for runs every step)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits_for(num_seqs: int, max_q_len: int, kv_heads: int, device: torch.device) -> int:
    """Split-KV runs of a step: a decode-only step whose (sequence, KV head) programs would leave most
    multiprocessors idle splits each context into up to 16 runs (a power of two), aiming at two programs
    per multiprocessor; depends on the batch, never on context lengths (one captured graph per batch)."""
    if device.type != "cuda" or max_q_len != 1:
        return 1
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    want = (2 * sms) // max(1, num_seqs * kv_heads)
    splits = 1
    while splits * 2 <= min(16, want):
        splits *= 2
    return splits


class KernelAttention:
    """The Triton path: per layer, one launch writes the step's K/V to their slots and one reads the
    cache in place through the block table (`kernels.attention`), with the config's window, scale,
    softcap and attention sinks. Same call as `PagedAttention`."""

    def __init__(self, cache: PagedKVCache, step: KernelStep):
        from hybridgate.workers.gpu.kernels import attention as kernels

        self.cache, self.step, self._kernels = cache, step, kernels
        self._dot_fp32 = cache.k[0].device.type != "cuda"  # the interpreter's bf16 dot is wrong (FACTS.md)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc, step, c = self.cache.k[layer], self.cache.v[layer], self.step, self.cache.config
        if k is not None:  # None: a layer reading `layer`'s K/V
            self._kernels.write_kv(k, v, kc, vc, step.slots)
        return self._kernels.paged_attention(q, kc, vc, step.block_tables, step.seq_lens, step.q_starts,
                                             step.max_q_len, self.cache.block_size, c.attention_scale,
                                             c.attn_softcap, c.layer_windows[layer], step.num_splits,
                                             dot_fp32=self._dot_fp32, sinks=self.cache.sinks[layer])


class PagedAttention:
    """Stores a step's K/V in the paged cache and attends, per layer, with the cache config's window,
    scale, attention softcap and attention sinks."""

    def __init__(self, cache: PagedKVCache, step: PagedStep):
        self.cache, self.step = cache, step
        self._masks: dict[tuple[int, int], torch.Tensor | None] = {}  # (window, width) -> decode mask
        self._sinks: torch.Tensor | None = None  # the current layer's attention sinks (`layers.layer_sinks`)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc, step, c = self.cache.k[layer], self.cache.v[layer], self.step, self.cache.config
        window = c.layer_windows[layer]
        self._sinks = self.cache.sinks[layer]
        if k is not None:  # None: a layer reading `layer`'s K/V
            kc.index_copy_(0, step.slots, k)
            vc.index_copy_(0, step.slots, v)
        if step.decode_rows is not None and not step.prefills and step.decode_rows.shape[0] == q.shape[0]:
            return self._decode(q, kc, vc, window)  # all decodes: rows are 0..n-1 in order
        out = torch.empty_like(q)  # [num_tokens, heads, head_dim]
        if step.decode_rows is not None:
            out[step.decode_rows] = self._decode(q[step.decode_rows], kc, vc, window)
        for start, n, context in step.prefills:
            skip = window_start(context.shape[0] - n, window)  # slots no query of the chunk can see
            k, v = kc.index_select(0, context[skip:]), vc.index_select(0, context[skip:])
            out[start : start + n] = causal_sdpa(q[start : start + n], k, v, k.shape[0] - n, window,
                                                 c.attention_scale, c.attn_softcap, self._sinks)
        return out

    def _mask(self, window: int, width: int, padding: torch.Tensor | None) -> torch.Tensor | None:
        """bool `[batch, 1, 1, width]` decode mask: the padding mask, and for a window the positions
        `length - window ..` only (one per distinct window and width per step)."""
        if not window:
            return padding
        key = (window, width)
        if key not in self._masks:
            lengths = self.step.decode_lengths
            if lengths is None:
                raise ValueError(f"a sliding window of {window} needs the step's decode_lengths")
            pos = torch.arange(width, device=lengths.device)[None, :]
            seen = (pos < lengths[:, None]) & (pos >= lengths[:, None] - window)  # [batch, width]
            self._masks[key] = seen[:, None, None, :]
        return self._masks[key]

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, window: int) -> torch.Tensor:
        """One query per sequence: q `[batch, heads, head_dim]` → `[batch, heads, head_dim]`.

        `index_select` gathers the context 2.5x faster than advanced indexing on the CPU.
        """
        if self.step.decode_blocks is not None:
            return self._decode_blocks(q, kc, vc, window)
        ctx = self.step.decode_context  # [batch, width]
        batch, width = ctx.shape
        flat = ctx.reshape(-1)
        k = kc.index_select(0, flat).view(batch, width, *kc.shape[1:]).transpose(1, 2)  # [batch, kv_heads, width, dim]
        v = vc.index_select(0, flat).view(batch, width, *vc.shape[1:]).transpose(1, 2)
        return self._attend(q, k, v, self._mask(window, width, self.step.decode_mask))

    def _decode_blocks(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, window: int) -> torch.Tensor:
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
        return self._attend(q, k, v, self._mask(window, blocks * bs, self.step.decode_block_mask))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        c = self.cache.config
        return sdpa(q[:, :, None, :], k, v, mask, c.attention_scale, c.attn_softcap, sinks=self._sinks)[:, :, 0, :]
