"""A step's inputs kept across steps: one block-table row per sequence in flight, grown as the sequence
grows, and each step's host inputs packed into one flat int64 buffer (one host-to-device copy).

The shape is vLLM v1's model runner (`InputBatch` and `BlockTable`: a persistent row per request, the
new block ids appended as the scheduler hands them out, rows dropped when requests leave), here without
the scheduler's help: the runner knows only batches (STYLE.md), so `BlockTables.update` decides from each
sequence whether its row still holds. A row holds while the sequence keeps the same `block_table` list, no
shorter than the row, and its `num_computed` is where the previous step left it; the allocator only
appends to a list in place (`BlockAllocator.ensure`), and everything that gives blocks back (preemption,
abort, finish, a hand-off's release) empties the list or replaces it and resets `num_computed`. A row
that no longer holds is rebuilt from the sequence (counted in `rebuilds`); before each step, the rows of
sequences out of its batch that are not running (finished, waiting again after a preemption) or whose row
no longer holds (their blocks given back) are dropped.

`build_step_inputs` (`step_inputs.py`) rebuilds the same inputs from every sequence's whole slot list: it
is the reference the incremental ones are tested against.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sampling import sampler_key
from hybridgate.workers.sequence import Sequence, SequenceStatus

# The float64 sampling fields, each float64 [ready rows], in `sample_tensors`' order.
SAMPLING_FLOATS = ("temperature", "top_p", "repetition_penalty", "min_p", "presence_penalty", "frequency_penalty")


class BlockTables:
    """Block tables of the sequences in flight: int32 `[rows, max_blocks]` on the host, one row each.

    `update(entries)` appends each entry's new blocks to its row (or builds the row) and returns the rows
    and the cells written, which a device copy of the table applies; the table grows (rows, columns) when
    a batch needs more, so no batch is refused. Unused cells hold `pad_block`.
    """

    def __init__(self, max_blocks: int, rows: int = 8, pad_block: int = 0):
        if max_blocks < 1 or rows < 1:
            raise ValueError(f"BlockTables: max_blocks and rows must be >= 1, got {max_blocks} and {rows}")
        self.pad_block = pad_block
        self.table = np.full((rows, max_blocks), pad_block, dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)  # blocks mirrored in each row
        self.expected = np.zeros(rows, dtype=np.int64)  # num_computed the row's sequence has at its next step
        self.lists: list[list[int] | None] = [None] * rows  # the block_table list each row mirrors
        self.rows: dict[Sequence, int] = {}
        self._free = list(range(rows - 1, -1, -1))
        self.rebuilds = 0  # rows rebuilt because their sequence's blocks changed other than by growing
        self.appended = 0  # blocks appended to existing rows
        self.built = 0  # blocks written by building rows

    def update(self, entries: list[tuple[Sequence, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(rows int64 `[entries]`, cells int64 `[3, n]`: row, column, block of each cell written)."""
        in_batch = {seq for seq, _ in entries}
        # A sequence out of the batch keeps its row only while it runs (decodes to come) or is parked.
        for seq in [s for s in self.rows
                    if s not in in_batch and (s.status != SequenceStatus.RUNNING or not self._holds(s))]:
            self._drop(seq)
        rows = np.empty(len(entries), dtype=np.int64)
        cells: list[tuple[int, int, list[int]]] = []
        for i, (seq, n) in enumerate(entries):
            row = self.rows.get(seq)
            if row is not None and (seq.num_computed != self.expected[row] or not self._holds(seq)):
                self._drop(seq)
                self.rebuilds += 1
                row = None
            if row is None:
                row = self._take(seq)
            start, blocks = int(self.num_blocks[row]), seq.block_table
            if len(blocks) > start:
                self._fit_columns(len(blocks))
                self.table[row, start : len(blocks)] = blocks[start:]
                cells.append((row, start, blocks[start:]))
                if start:
                    self.appended += len(blocks) - start
                else:
                    self.built += len(blocks)
            self.num_blocks[row], self.expected[row] = len(blocks), seq.num_computed + n
            rows[i] = row
        return rows, _cells(cells)

    def _holds(self, seq: Sequence) -> bool:
        row = self.rows[seq]
        return (seq.block_table is self.lists[row] and len(seq.block_table) >= self.num_blocks[row]
                and seq.status <= SequenceStatus.RUNNING and (seq.num_computed > 0 or not self.num_blocks[row]))

    def _take(self, seq: Sequence) -> int:
        if not self._free:
            old = len(self.lists)
            self.table = np.vstack([self.table, np.full_like(self.table, self.pad_block)])
            self.num_blocks, self.expected = (np.concatenate([a, np.zeros_like(a)]) for a in
                                              (self.num_blocks, self.expected))
            self.lists += [None] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._free.pop()
        self.rows[seq], self.lists[row], self.num_blocks[row] = row, seq.block_table, 0
        return row

    def _drop(self, seq: Sequence) -> None:
        row = self.rows.pop(seq)
        self.table[row, : self.num_blocks[row]] = self.pad_block
        self.lists[row], self.num_blocks[row] = None, 0
        self._free.append(row)

    def _fit_columns(self, blocks: int) -> None:
        if blocks > self.table.shape[1]:
            wider = np.full((self.table.shape[0], max(blocks, 2 * self.table.shape[1])), self.pad_block, np.int32)
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider

    def check(self) -> None:
        """The invariants: every live row mirrors its sequence's blocks, and nothing else is set.

        Raises:
            AssertionError: naming the row that breaks one.
        """
        live = set(self.rows.values())
        for seq, row in self.rows.items():
            n = int(self.num_blocks[row])
            if list(self.table[row, :n]) != seq.block_table[:n] and self._holds(seq):
                raise AssertionError(f"row {row}: {self.table[row, :n].tolist()} != {seq.block_table[:n]}")
        for row in range(self.table.shape[0]):
            rest = self.table[row, self.num_blocks[row] :] if row in live else self.table[row]
            if (rest != self.pad_block).any():
                raise AssertionError(f"row {row}: cells past its blocks are not the pad block")


def _cells(cells: list[tuple[int, int, list[int]]]) -> np.ndarray:
    counts = [len(b) for _, _, b in cells]
    out = np.empty((3, sum(counts)), dtype=np.int64)
    out[0] = np.repeat([r for r, _, _ in cells], counts)
    out[1] = np.concatenate([np.arange(c, c + k) for (_, c, _), k in zip(cells, counts)]) if cells else []
    out[2] = np.fromiter(itertools.chain.from_iterable(b for _, _, b in cells), np.int64, out.shape[1])
    return out


def new_ids(seq: Sequence, start: int, n: int) -> list[int]:
    """ids of positions start..start+n-1, sliced without building `all_ids` (which copies the context)."""
    prompt = len(seq.prompt_ids)
    if start >= prompt:
        return seq.output_ids[start - prompt : start - prompt + n]
    if start + n <= prompt:
        return seq.prompt_ids[start : start + n]
    return seq.prompt_ids[start:] + seq.output_ids[: start + n - prompt]


@dataclass
class PackedStep:
    """One step's host inputs in one flat int64 array (`flat`, a staging buffer's view), by segment.

    Segments (`segments[name]` = (offset, count) in int64 words): ids, positions, token_rows (the table
    row of each token) `[num_tokens]`; entry_rows, seq_lens (context after the step), last (row of each
    entry's last token) `[entries]`; q_starts `[entries + 1]`; cells `[3 * n]` (`BlockTables.update`);
    ready (entries sampled this step), top_k, keys, penalty_lengths, generated_starts `[ready]`, the
    `SAMPLING_FLOATS` (float64 bits) `[ready]`; penalty_ids (every id of each penalized ready entry,
    concatenated; a row counts as generated its ids from generated_starts on).
    """

    flat: np.ndarray
    segments: dict[str, tuple[int, int]]
    num_tokens: int
    new_tokens: list[int]  # of each entry
    seq_lens: list[int]
    decodes: list[int]  # entries with one new token (also the segment "decodes")
    max_q: int
    ready: list[Sequence]
    any_sampled: bool
    k_max: int
    any_top_p: bool
    repetition: bool  # some ready row has a repetition penalty
    openai: bool  # some ready row has a presence or frequency penalty
    any_min_p: bool

    def view(self, name: str) -> np.ndarray:
        offset, count = self.segments[name]
        return self.flat[offset : offset + count]


def packed_words(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """int64 words of the largest `pack_step`: 3 per token; 5 per entry and 1; 3 per table cell, every entry's
    row built at once at max_model_len; 12 per ready entry; the ids of every penalized entry, each
    max_model_len long (entries: at most min(max_num_seqs, max_num_batched_tokens))."""
    entries = min(max_num_seqs, max_num_batched_tokens)
    blocks = -(-max_model_len // block_size)
    return 3 * max_num_batched_tokens + 5 * entries + 1 + 3 * entries * blocks + 12 * entries + entries * max_model_len


def pack_step(batch: ScheduledBatch, tables: BlockTables, fit, vocab_size: int) -> PackedStep:
    """Update `tables` for `batch` and pack its inputs into `fit(np.int64, words)` (a pinned buffer's `fit`)."""
    entries = batch.entries
    rows, cells = tables.update(entries)
    counts = np.fromiter((n for _, n in entries), np.int64, len(entries))
    starts = np.fromiter((s.num_computed for s, _ in entries), np.int64, len(entries))
    ready = [(i, s) for i, (s, n) in enumerate(entries)  # an embedding (`pooling`) samples nothing
             if s.num_computed + n == s.num_tokens and not s.pooling]
    seqs = [s for _, s in ready]
    penalized = [s.params.repetition_penalty != 1.0 or s.params.presence_penalty or s.params.frequency_penalty
                 for s in seqs]
    histories = [s.all_ids if p else [] for s, p in zip(seqs, penalized)]
    t, e, r = int(counts.sum()), len(entries), len(ready)
    decodes = [i for i, (_, n) in enumerate(entries) if n == 1]
    sizes = {"ids": t, "positions": t, "token_rows": t, "entry_rows": e, "seq_lens": e, "last": e,
             "q_starts": e + 1, "decodes": len(decodes), "cells": cells.size, "ready": r, "top_k": r, "keys": r,
             "penalty_lengths": r, "generated_starts": r, **{name: r for name in SAMPLING_FLOATS},
             "penalty_ids": sum(len(h) for h in histories)}
    offsets = np.cumsum([0, *sizes.values()])
    flat = fit(np.int64, int(offsets[-1]))
    segments = {name: (int(o), n) for (name, n), o in zip(sizes.items(), offsets)}
    step = PackedStep(flat, segments, t, counts.tolist(), (starts + counts).tolist(), decodes,
                      int(counts.max(initial=0)), seqs,
                      any_sampled=any(s.params.temperature > 0 for s in seqs),
                      k_max=max((s.params.top_k for s in seqs if s.params.temperature > 0
                                 and 0 < s.params.top_k < vocab_size), default=0),
                      any_top_p=any(s.params.top_p < 1.0 and s.params.temperature > 0 for s in seqs),
                      repetition=any(s.params.repetition_penalty != 1.0 for s in seqs),
                      openai=any(s.params.presence_penalty or s.params.frequency_penalty for s in seqs),
                      any_min_p=any(s.params.min_p > 0 and s.params.temperature > 0 for s in seqs))
    first = np.cumsum(counts) - counts  # row of each entry's first token
    step.view("ids")[:] = np.fromiter(itertools.chain.from_iterable(
        new_ids(s, s.num_computed, n) for s, n in entries), np.int64, t)
    step.view("positions")[:] = np.repeat(starts - first, counts) + np.arange(t)
    step.view("token_rows")[:] = np.repeat(rows, counts)
    step.view("entry_rows")[:], step.view("seq_lens")[:] = rows, starts + counts
    step.view("last")[:] = first + counts - 1
    step.view("q_starts")[:] = np.concatenate([[0], np.cumsum(counts)])
    step.view("decodes")[:] = decodes
    step.view("cells")[:] = cells.ravel()
    _pack_sampling(step, ready, histories)
    return step


def _pack_sampling(step: PackedStep, ready: list[tuple[int, Sequence]], histories: list[list[int]]) -> None:
    params = [s.params for _, s in ready]
    step.view("ready")[:] = [i for i, _ in ready]
    step.view("top_k")[:] = [p.top_k for p in params]
    step.view("keys")[:] = [sampler_key(s.seed, s.next_token_index) for _, s in ready]
    for name in SAMPLING_FLOATS:
        step.view(name).view(np.float64)[:] = [getattr(p, name) for p in params]
    lengths = [len(h) for h in histories]
    step.view("penalty_lengths")[:] = lengths
    # generated_ids is the last next_token_index ids (none when it is 0)
    step.view("generated_starts")[:] = [max(n - s.next_token_index, 0) if s.next_token_index else n
                                        for n, (_, s) in zip(lengths, ready)]
    step.view("penalty_ids")[:] = np.fromiter(itertools.chain.from_iterable(histories), np.int64,
                                              step.segments["penalty_ids"][1])
