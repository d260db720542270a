"""Decode steps captured as CUDA graphs, one per padded batch size, over the Triton attention kernels.

A decode step of a small model is a few dozen microseconds of memory traffic
and milliseconds of Python and kernel launches; replaying a captured graph
removes the launches. Shapes are static per graph: the batch is padded up to
the next captured size. The static inputs are the step's ids, positions and
slots, block tables (int32 `[batch, max_blocks]`, as wide as the worker's max
model length, padded with the scratch block) and context lengths; the kernels'
grid depends on the batch, never on context length, so one graph per batch size
serves every context. Padding rows write their K/V into a scratch slot that no
sequence owns and attend to it alone, so they cannot touch real cache entries.
With `capture=False` the same static-shape step runs eagerly (CPU tests).

The reference attention (gather + SDPA) is never captured: its gathered
context would shape a graph per context length (GiBs a layer at 131,072
tokens), so with `--gpu-attention reference` CUDA runs decode steps eagerly.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import torch

from hybridgate.workers.gpu.attention import KernelAttention, KernelStep, PagedKVCache
from hybridgate.workers.gpu.model import DecoderModel

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class _Static:
    ids: torch.Tensor  # int64 [batch]
    positions: torch.Tensor  # int64 [batch]
    slots: torch.Tensor  # int64 [batch]
    tables: torch.Tensor  # int32 [batch, max_blocks]: block tables
    lengths: torch.Tensor  # int32 [batch]: context lengths, this step's token included
    rows: torch.Tensor  # int64 [batch]: 0..batch-1
    q_starts: torch.Tensor  # int32 [batch + 1]: 0..batch
    logits: torch.Tensor | None = None  # float32 [batch, vocab], written by the graph
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(self, model: DecoderModel, cache: PagedKVCache, scratch_slot: int, max_batch: int,
                 max_context: int, capture: bool = True, num_splits=lambda batch: 1):
        self.model, self.cache, self.scratch = model, cache, scratch_slot
        self.capture = capture and model.device.type == "cuda"
        self.num_splits = num_splits
        self.batch_sizes = self.batch_sizes_for(max_batch)
        self.max_blocks = -(-max_context // cache.block_size)  # every block table fits the widest one
        self.pad = scratch_slot // cache.block_size
        self.replays = 0
        self._static: dict[int, _Static] = {}
        self._pool = None

    @property
    def captured(self) -> int:
        """Graphs captured so far."""
        return sum(s.graph is not None for s in self._static.values())

    @staticmethod
    def batch_sizes_for(max_batch: int) -> list[int]:
        """The padded batch sizes captured for at most `max_batch` decodes, ascending."""
        return [b for b in BATCH_SIZES if b <= max_batch] or [max_batch]

    def padded(self, batch: int) -> int | None:
        """The captured batch size `batch` decodes are padded to (None: more than the largest)."""
        return next((s for s in self.batch_sizes if s >= batch), None)

    def capture_all(self) -> None:
        """Capture every batch size, largest first so they share one memory pool."""
        if not self.capture:
            return
        self._pool = torch.cuda.graph_pool_handle()
        # A cyclic-garbage pass inside a capture can free pinned host memory of dead objects
        # (cudaFreeHost synchronizes), which invalidates the capture: collect first, none during.
        gc.collect()
        gc.disable()
        try:
            for b in sorted(self.batch_sizes, reverse=True):
                self._capture(b)
        finally:
            gc.enable()
        torch.cuda.synchronize()

    def _buffers(self, b: int) -> _Static:
        dev = self.model.device
        long = lambda *shape, fill=0: torch.full(shape, fill, dtype=torch.int64, device=dev)  # noqa: E731
        return _Static(ids=long(b), positions=long(b), slots=long(b, fill=self.scratch),
                       tables=torch.full((b, self.max_blocks), self.pad, dtype=torch.int32, device=dev),
                       lengths=torch.ones(b, dtype=torch.int32, device=dev), rows=torch.arange(b, device=dev),
                       q_starts=torch.arange(b + 1, dtype=torch.int32, device=dev))

    def _step(self, s: _Static) -> torch.Tensor:
        step = KernelStep(s.slots, s.tables, s.lengths, s.q_starts, 1, self.num_splits(s.ids.shape[0]))
        return self.model.forward_tokens(s.ids, s.positions, KernelAttention(self.cache, step), s.rows)

    def _capture(self, b: int) -> None:
        s = self._buffers(b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph (allocator, lazy init, Triton's compile)
                self._step(s)
        torch.cuda.current_stream().wait_stream(side)
        s.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(s.graph, pool=self._pool):
            s.logits = self._step(s)
        self._static[b] = s

    def run(self, ids, positions, slots, tables, lengths) -> torch.Tensor:
        """Logits float32 `[n, vocab]` for n decodes (n at most the largest batch size); tables int32
        `[n, blocks]` (blocks at most `max_blocks`), lengths `[n]` each context, this token included. Inputs
        on the device (the runner's) are copied on the device; numpy arrays (tests) are copied there first."""
        n, width = tables.shape
        b = self.padded(n)
        s = self._static.get(b) or self._static.setdefault(b, self._buffers(b))
        to = lambda a: a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a)).to(  # noqa: E731
            s.ids.device, non_blocking=True)
        s.ids[:n].copy_(to(ids)), s.positions[:n].copy_(to(positions)), s.slots[:n].copy_(to(slots))
        s.tables[:n, :width].copy_(to(tables))
        s.tables[:n, width:].fill_(self.pad)
        s.lengths[:n].copy_(to(lengths))
        s.ids[n:].zero_(), s.positions[n:].zero_(), s.slots[n:].fill_(self.scratch)
        s.tables[n:].fill_(self.pad), s.lengths[n:].fill_(1)
        if s.graph is None:
            return self._step(s)[:n]
        s.graph.replay()
        self.replays += 1
        return s.logits[:n]
