"""Decode steps captured as CUDA graphs, one per padded batch size (and, on the reference attention path,
per context bucket).

A decode step of a small model is a few dozen microseconds of memory traffic
and milliseconds of Python and kernel launches; replaying a captured graph
removes the launches. Shapes are static per graph: the batch is padded up to
the next captured size and the gathered context up to the next bucket. Padding
rows write their K/V into a scratch slot that no sequence owns and attend to
it alone, so they cannot touch real cache entries. With `capture=False` the
same static-shape step runs eagerly (CPU tests, `--enforce-eager`).

With the Triton kernels (`kernels=True`) the static inputs are block tables
(int32 `[batch, max_blocks]`, padded with the scratch block) and context
lengths, and the kernels' grid does not depend on context length: one graph
per batch size serves every context up to the model's limit.
"""

from __future__ import annotations

import gc
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from hybridgate.workers.gpu.attention import KernelAttention, KernelStep, PagedAttention, PagedKVCache, PagedStep
from hybridgate.workers.gpu.model import DecoderModel

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)  # the reference path's; longer contexts run eagerly


@dataclass
class _Static:
    ids: torch.Tensor  # int64 [batch]
    positions: torch.Tensor  # int64 [batch]
    slots: torch.Tensor  # int64 [batch]
    context: torch.Tensor  # int64 [batch, width] slots, or (kernels) int32 [batch, max_blocks] block tables
    lengths: torch.Tensor  # int64 [batch] (kernels: int32)
    rows: torch.Tensor  # int64 [batch]: 0..batch-1
    q_starts: torch.Tensor | None = None  # int32 [batch + 1]: 0..batch (kernels)
    logits: torch.Tensor | None = None  # float32 [batch, vocab], written by the graph
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(self, model: DecoderModel, cache: PagedKVCache, scratch_slot: int, max_batch: int,
                 max_context: int, capture: bool = True, kernels: bool = False, num_splits=lambda batch: 1):
        self.model, self.cache, self.scratch = model, cache, scratch_slot
        self.capture = capture and model.device.type == "cuda"
        self.kernels, self.num_splits = kernels, num_splits
        self.batch_sizes = self.batch_sizes_for(max_batch)
        if kernels:  # one "bucket": every block table fits the widest one
            self.buckets = [-(-max_context // cache.block_size)]
            self.pad = scratch_slot // cache.block_size
        else:
            self.buckets = self.buckets_for(max_context)
            self.pad = scratch_slot
        self.replays = 0
        self._static: dict[tuple[int, int], _Static] = {}
        self._pool = None

    @property
    def captured(self) -> int:
        """Graphs captured so far."""
        return sum(s.graph is not None for s in self._static.values())

    @staticmethod
    def batch_sizes_for(max_batch: int) -> list[int]:
        """The padded batch sizes captured for at most `max_batch` decodes, ascending."""
        return [b for b in BATCH_SIZES if b <= max_batch] or [max_batch]

    @staticmethod
    def buckets_for(max_context: int) -> list[int]:
        """The reference path's context buckets (tokens), ascending. It gathers a padded copy of the bucket:
        past 8192 tokens that copy would outgrow the memory a graph may hold (a 131,072-token bucket is GiBs
        per layer), so those steps run eagerly."""
        top = min(max_context, CONTEXT_BUCKETS[-1])
        return [w for w in CONTEXT_BUCKETS if w < top] + [top]

    def key(self, batch: int, width: int) -> tuple[int, int] | None:
        """(padded batch, bucket) of `batch` decodes whose longest context is `width` tokens (None: none fits)."""
        if self.kernels:
            width = -(-width // self.cache.block_size)
        b = next((s for s in self.batch_sizes if s >= batch), None)
        w = next((s for s in self.buckets if s >= width), None)
        return None if b is None or w is None else (b, w)

    def capture_all(self) -> None:
        """Capture every (batch size, bucket), largest first so they share one memory pool."""
        if not self.capture:
            return
        self._pool = torch.cuda.graph_pool_handle()
        # A cyclic-garbage pass inside a capture can free pinned host memory of dead objects
        # (cudaFreeHost synchronizes), which invalidates the capture: collect first, none during.
        gc.collect()
        gc.disable()
        try:
            for b, w in sorted(itertools.product(self.batch_sizes, self.buckets), reverse=True):
                self._capture(b, w)
        finally:
            gc.enable()
        torch.cuda.synchronize()

    def _buffers(self, b: int, w: int) -> _Static:
        dev = self.model.device
        long = lambda *shape, fill=0: torch.full(shape, fill, dtype=torch.int64, device=dev)  # noqa: E731
        index = torch.int32 if self.kernels else torch.int64
        return _Static(ids=long(b), positions=long(b), slots=long(b, fill=self.scratch),
                       context=torch.full((b, w), self.pad, dtype=index, device=dev),
                       lengths=torch.ones(b, dtype=index, device=dev), rows=torch.arange(b, device=dev),
                       q_starts=torch.arange(b + 1, dtype=torch.int32, device=dev) if self.kernels else None)

    def _step(self, s: _Static) -> torch.Tensor:
        if self.kernels:
            step = KernelStep(s.slots, s.context, s.lengths, s.q_starts, 1, self.num_splits(s.ids.shape[0]))
            return self.model.forward_tokens(s.ids, s.positions, KernelAttention(self.cache, step), s.rows)
        width = s.context.shape[1]
        mask = (torch.arange(width, device=s.context.device)[None, :] < s.lengths[:, None])[:, None, None, :]
        step = PagedStep(slots=s.slots, decode_rows=s.rows, decode_context=s.context, decode_mask=mask, prefills=[],
                         decode_lengths=s.lengths)
        return self.model.forward_tokens(s.ids, s.positions, PagedAttention(self.cache, step), s.rows)

    def _capture(self, b: int, w: int) -> None:
        s = self._buffers(b, w)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph (allocator, lazy init)
                self._step(s)
        torch.cuda.current_stream().wait_stream(side)
        s.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(s.graph, pool=self._pool):
            s.logits = self._step(s)
        self._static[(b, w)] = s

    def run(self, ids, positions, slots, context, lengths) -> torch.Tensor:
        """Logits float32 `[n, vocab]` for n decodes; context int64 `[n, width]` (padded with any slot), or
        with the kernels block tables `[n, blocks]`. Inputs on the device (the runner's) are copied on the
        device; numpy arrays (tests) are copied there first."""
        n, width = context.shape
        b, w = self.key(n, width)
        s = self._static.get((b, w)) or self._static.setdefault((b, w), self._buffers(b, w))
        to = lambda a: a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a)).to(  # noqa: E731
            s.ids.device, non_blocking=True)
        s.ids[:n].copy_(to(ids)), s.positions[:n].copy_(to(positions)), s.slots[:n].copy_(to(slots))
        s.context[:n, :width].copy_(to(context))
        s.context[:n, width:].fill_(self.pad)
        s.lengths[:n].copy_(to(lengths))
        s.ids[n:].zero_(), s.positions[n:].zero_(), s.slots[n:].fill_(self.scratch)
        s.context[n:].fill_(self.pad), s.lengths[n:].fill_(1)
        if s.graph is None:
            return self._step(s)[:n]
        s.graph.replay()
        self.replays += 1
        return s.logits[:n]
