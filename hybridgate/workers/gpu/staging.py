"""A step's inputs on the device: persistent buffers filled by one non-blocking host-to-device copy of the
packed step (`input_batch.pack_step`), and the sampled ids back by one non-blocking device-to-host copy.

The device keeps its own copy of the block tables (int32 `[rows, max_blocks]`), to which each step's copy
brings only the cells `BlockTables.update` wrote; everything the attention paths read (new tokens' slots,
the step's block tables, the reference path's context slots) is expanded from it on the device, so the
host's work per step grows with the tokens run and the blocks added, not with the context. Counting the
copies (`copies`) is how the tests hold a step to one copy each way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridgate.workers.gpu.attention import KernelStep, PagedStep
from hybridgate.workers.input_batch import SAMPLING_FLOATS, BlockTables, PackedStep


@dataclass
class CopyCounts:
    """Copies between host and device made by the runner (each a step's one, unless a step needed more)."""

    host_to_device: int = 0
    device_to_host: int = 0


class DeviceStep:
    """The device views of one packed step; shapes as in `PackedStep`'s segments."""

    def __init__(self, words: torch.Tensor, packed: PackedStep, table: torch.Tensor, block_size: int,
                 pad_slot: int):
        self.packed, self.block_size, self.pad_slot = packed, block_size, pad_slot
        self._words = words
        self.ids, self.positions = self.view("ids"), self.view("positions")
        self.last, self.seq_lens = self.view("last"), self.view("seq_lens")
        bs = block_size
        # [num_tokens]: each new token's slot, from its row of the table
        self.slots = table[self.view("token_rows"), self.positions // bs].long() * bs + self.positions % bs
        self.max_blocks = -(-max(packed.seq_lens, default=0) // bs)
        used = (self.seq_lens + bs - 1) // bs  # [entries]
        cols = torch.arange(self.max_blocks, device=table.device)
        rows = table[self.view("entry_rows"), : self.max_blocks]  # [entries, max_blocks]
        self.block_tables = torch.where(cols[None, :] < used[:, None], rows, pad_slot // bs)  # int32

    def view(self, name: str) -> torch.Tensor:
        offset, count = self.packed.segments[name]
        return self._words[offset : offset + count]

    def kernel_step(self, num_splits: int) -> KernelStep:
        """The Triton kernels' inputs (`KernelStep`)."""
        return KernelStep(self.slots, self.block_tables, self.seq_lens.int(), self.view("q_starts").int(),
                          self.packed.max_q, num_splits)

    def decode_context(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The decodes' (context slots int64 `[decodes, width]` padded with the pad slot, context lengths int64
        `[decodes]`, width: the longest context)."""
        p = self.packed
        width = max((p.seq_lens[i] for i in p.decodes), default=0)
        decodes = self.view("decodes")
        tables, lens = self.block_tables[decodes], self.seq_lens[decodes]
        span = torch.arange(self.block_size, device=tables.device)
        slots = (tables[:, :, None].long() * self.block_size + span).reshape(len(p.decodes), -1)[:, :width]
        pos = torch.arange(width, device=tables.device)
        return torch.where(pos[None, :] < lens[:, None], slots, self.pad_slot), lens, width

    def paged_step(self, block_gather: bool) -> PagedStep:
        """The gather + SDPA reference path's inputs (`PagedStep`), every context expanded on the device."""
        p, bs = self.packed, self.block_size
        mask = blocks = block_mask = lens = ctx = rows = None
        if p.decodes:
            ctx, lens, width = self.decode_context()
            if any(p.seq_lens[i] != width for i in p.decodes):
                mask = (torch.arange(width, device=ctx.device)[None, :] < lens[:, None])[:, None, None, :]
            rows = self.last[self.view("decodes")]
            if block_gather:
                nblk = -(-width // bs)
                blocks = self.block_tables[self.view("decodes"), :nblk].long()
                span = torch.arange(nblk * bs, device=ctx.device)
                block_mask = (span[None, :] < lens[:, None])[:, None, None, :]
        prefills, first = [], 0
        span = torch.arange(bs, device=self.ids.device)
        for i, n in enumerate(p.new_tokens):
            if n > 1:
                c = p.seq_lens[i]
                table = self.block_tables[i, : -(-c // bs)].long()
                prefills.append((first, n, (table[:, None] * bs + span).reshape(-1)[:c]))
            first += n
        return PagedStep(slots=self.slots, decode_rows=rows, decode_context=ctx, decode_mask=mask,
                         prefills=prefills, decode_blocks=blocks, decode_block_mask=block_mask, decode_lengths=lens)

    def sampling(self, vocab_size: int) -> dict:
        """`sample_tensors`' keyword arguments for the ready entries (penalties built on the device)."""
        p, dev = self.packed, self.ids.device
        floats = {name: self.view(name).view(torch.float64) for name in SAMPLING_FLOATS}
        seen = counts = None
        if p.repetition or p.openai:
            lengths, ids = self.view("penalty_lengths"), self.view("penalty_ids")
            total, ready = p.segments["penalty_ids"][1], len(p.ready)
            rows = torch.repeat_interleave(torch.arange(ready, device=dev), lengths, output_size=total)
            if p.repetition:
                seen = torch.zeros(ready, vocab_size, dtype=torch.bool, device=dev)
                seen[rows, ids] = torch.ones_like(ids, dtype=torch.bool)  # a Python True would be a copy
            if p.openai:
                starts = torch.cumsum(lengths, 0) - lengths
                generated = (torch.arange(total, device=dev) - starts[rows]) >= self.view("generated_starts")[rows]
                counts = torch.zeros(ready, vocab_size, dtype=torch.float64, device=dev)
                counts.index_put_((rows, ids), generated.double(), accumulate=True)
        return dict(temperature=floats["temperature"], top_k=self.view("top_k"), top_p=floats["top_p"],
                    repetition_penalty=floats["repetition_penalty"], keys=self.view("keys"), seen_mask=seen,
                    any_sampled=p.any_sampled, k_max=p.k_max, any_top_p=p.any_top_p, counts=counts,
                    presence=floats["presence_penalty"] if p.openai else None,
                    frequency=floats["frequency_penalty"] if p.openai else None,
                    min_p=floats["min_p"] if p.any_min_p else None)


class DeviceInputs:
    """Persistent device buffers of the step's inputs on `device` and the pinned host buffer of its ids."""

    def __init__(self, device: torch.device, words: int, tables: BlockTables, block_size: int, pad_slot: int):
        self.device, self.block_size, self.pad_slot = device, block_size, pad_slot
        self.words = torch.empty(words, dtype=torch.int64, device=device)  # int64 [words]: the packed step
        self.table = torch.from_numpy(tables.table).to(device)  # int32 [rows, max_blocks]
        self.sampled = self._host_ids(tables.table.shape[0])  # int64 [rows], pinned on CUDA
        self.copies = CopyCounts()

    def _host_ids(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def upload(self, packed: PackedStep, tables: BlockTables) -> DeviceStep:
        """Copy `packed` to the device (one non-blocking copy) and apply its table cells."""
        n = packed.flat.size
        if n > self.words.numel():  # a step past the sizing (a runner sized for a profile step): grow
            self.words = torch.empty(n, dtype=torch.int64, device=self.device)
        if tuple(self.table.shape) != tables.table.shape:  # the host table grew: so does this one
            grown = torch.full(tables.table.shape, tables.pad_block, dtype=torch.int32, device=self.device)
            grown[: self.table.shape[0], : self.table.shape[1]] = self.table
            self.table = grown
        words = self.words[:n]
        words.copy_(torch.from_numpy(packed.flat), non_blocking=True)
        self.copies.host_to_device += 1
        offset, count = packed.segments["cells"]
        if count:
            cells = words[offset : offset + count].view(3, -1)
            self.table[cells[0], cells[1]] = cells[2].int()
        return DeviceStep(words, packed, self.table, self.block_size, self.pad_slot)

    def upload_bitmask(self, bitmask) -> torch.Tensor:
        """int32 token bitmasks `[rows, words]` (numpy, filled while the forward pass ran) on the device."""
        self.copies.host_to_device += 1
        return torch.as_tensor(bitmask).to(self.device, non_blocking=True)

    def download(self, ids: torch.Tensor) -> list[int]:
        """The sampled ids (int64 `[n]` on the device) on the host: one non-blocking copy, then one sync."""
        if ids.numel() > self.sampled.numel():
            self.sampled = self._host_ids(2 * ids.numel())
        host = self.sampled[: ids.numel()]
        host.copy_(ids, non_blocking=True)
        self.copies.device_to_host += 1
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
        return host.tolist()
