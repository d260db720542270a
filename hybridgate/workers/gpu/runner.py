"""The torch model runner over a paged KV cache: a scheduled batch in, sampled ids out.

Step inputs (token ids, positions, slot mapping, context slots, last rows)
are written into one `PinnedPool` buffer per step and reach the device with
non-blocking copies; on CUDA the buffer goes back to the pool when an event
recorded after the copies has completed (two buffers in flight at most, so
staging the next step overlaps the current one). On the CPU the same pool is
used and the check is immediate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from hybridgate.mempool import DEFAULT_BLOCK_SIZE, PinnedPool, PoolStats, aligned_slab
from hybridgate.models import GGUFModel
from hybridgate.workers.gpu import sampling
from hybridgate.workers.gpu.attention import PagedAttention, PagedKVCache, PagedStep
from hybridgate.workers.gpu.graphs import DecodeGraphs
from hybridgate.workers.gpu.model import LlamaModel
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence

log = logging.getLogger("hybridgate.worker")

STAGING_BUFFER_BYTES = 4 << 20


def parse_memory(value: str | float | int | None, device: torch.device) -> float:
    """`--kv-cache-memory`: bytes ("2GiB", "512MiB", "1e9") or a fraction in (0, 1] of free
    device memory after weights (GPU) or of available memory (CPU). Default 0.9 on a GPU, 0.2 on a CPU.

    Raises:
        ValueError: naming `--kv-cache-memory` and what it accepts.
    """
    if value is None:
        return 0.9 if device.type == "cuda" else 0.2
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        text = value.strip()
        units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1e3, "MB": 1e6, "GB": 1e9}
        scale = next((u for u in units if text.endswith(u)), None)
        try:
            number = float(text[: -len(scale)] if scale else text) * (units[scale] if scale else 1)
        except ValueError:
            raise ValueError(f"--kv-cache-memory: expected bytes (e.g. 2GiB) or a fraction in (0, 1], got {value!r}") from None
    if number <= 0 or (1 < number < 1 << 20):
        raise ValueError(f"--kv-cache-memory: expected bytes (at least 1 MiB) or a fraction in (0, 1], got {value!r}")
    return number


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def _pinned_slab(nbytes: int) -> np.ndarray:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


class TorchRunner:
    """Runs `LlamaModel` over a `PagedKVCache` and samples on the device."""

    kind = "gpu"

    def __init__(self, model: GGUFModel, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 kv_cache_memory: str | float | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_num_blocks: int | None = None, enforce_eager: bool = False, max_num_seqs: int = 64):
        self.model = LlamaModel(model, device, dtype)
        dev = self.model.device
        self.max_model_len = model.config.max_model_len
        self.block_size = block_size
        self.block_bytes = PagedKVCache.block_bytes(model.config, block_size, self.model.dtype)
        budget = parse_memory(kv_cache_memory, dev)
        nbytes = budget * _available_bytes(dev) if budget <= 1 else budget
        self.num_blocks = max(1, int(nbytes // self.block_bytes))
        if max_num_blocks is not None:
            self.num_blocks = min(self.num_blocks, max_num_blocks)
        # One extra block beyond the allocator's: padding rows of captured decode graphs write there.
        self.cache = PagedKVCache(model.config, self.num_blocks + 1, block_size, dev, self.model.dtype)
        self.scratch_slot = self.num_blocks * block_size
        for t in self.cache.k + self.cache.v:
            t[self.scratch_slot :].zero_()  # padding reads it: uninitialized memory could hold NaN
        self.graphs = None
        if dev.type == "cuda" and not enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.cache, self.scratch_slot, max_num_seqs,
                                       self.max_model_len)
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB on %s (weights %.1f MiB)", self.num_blocks, block_size,
                 self.num_blocks * self.block_bytes / 2**20, dev, self.model.weight_bytes / 2**20)
        self.pool = PinnedPool(STAGING_BUFFER_BYTES, 2, _pinned_slab if dev.type == "cuda" else aligned_slab)
        self._vocab_hash = torch.from_numpy(sampling.vocab_hash(model.config.vocab_size)).to(dev)

    def pool_stats(self) -> PoolStats:
        self.pool.drain()
        return self.pool.stats

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """float32 logits `[len(batch), vocab]` at each entry's last new token; K/V go to the cache."""
        buf = self.pool.acquire()
        try:
            host = self._host_inputs(batch, buf)
            if self.graphs is not None and len(host.decodes) == len(batch) and self.graphs.key(len(batch), host.width):
                lengths = np.asarray(host.contexts, dtype=np.int64)
                return self.graphs.run(host.ids, host.positions, host.slots, host.decode_context, lengths)
            ids, positions, step, last_rows = self._to_device(host)
            return self.model.forward_tokens(ids, positions, PagedAttention(self.cache, step), last_rows)
        finally:
            self.pool.release(buf, self._done_check())

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        logits = self.forward(batch)
        ready = [(row, seq) for row, (seq, n) in enumerate(batch.entries) if seq.num_computed + n == seq.num_tokens]
        if not ready:
            return {}
        rows = torch.tensor([r for r, _ in ready], device=logits.device)
        seqs = [s for _, s in ready]
        sampled = sampling.sample(
            logits[rows], [s.params for s in seqs], [s.seed for s in seqs], [len(s.output_ids) for s in seqs],
            [s.all_ids if s.params.repetition_penalty != 1.0 else () for s in seqs], self._vocab_hash,
        )
        return dict(zip(seqs, sampled.tolist()))

    def _done_check(self):
        if self.model.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event.query

    def _host_inputs(self, batch: ScheduledBatch, buf) -> _HostInputs:
        """The step's int64 inputs, written into one pool buffer (a plain array if it is too small)."""
        bs, entries = self.block_size, batch.entries
        tables = [np.asarray(s.block_table, dtype=np.int64) for s, _ in entries]
        decodes = [i for i, (_, n) in enumerate(entries) if n == 1]
        prefills = [i for i, (_, n) in enumerate(entries) if n > 1]
        contexts = [s.num_computed + n for s, n in entries]
        width = max((contexts[i] for i in decodes), default=0)
        t = batch.num_tokens
        sizes = [t, t, t, len(decodes) * width, sum(contexts[i] for i in prefills), len(entries)]
        flat = buf.array(np.int64, sum(sizes)) if sum(sizes) * 8 <= buf.memory.nbytes else np.empty(sum(sizes), np.int64)
        ids, pos, slots, dctx, pctx, last = np.split(flat, np.cumsum(sizes)[:-1])
        row = 0
        for (seq, n), table in zip(entries, tables):
            p = np.arange(seq.num_computed, seq.num_computed + n)
            ids[row : row + n] = seq.all_ids[seq.num_computed : seq.num_computed + n]
            pos[row : row + n] = p
            slots[row : row + n] = table[p // bs] * bs + p % bs
            row += n
        last[:] = np.cumsum([n for _, n in entries]) - 1
        dctx = dctx.reshape(len(decodes), width)
        for j, i in enumerate(decodes):
            dctx[j, : contexts[i]] = _context_slots(tables[i], bs, contexts[i])
            dctx[j, contexts[i] :] = self.scratch_slot  # padding, masked out; finite values there
        offset, prefill_ctx = 0, []
        for i in prefills:
            pctx[offset : offset + contexts[i]] = _context_slots(tables[i], bs, contexts[i])
            prefill_ctx.append((int(last[i]) - entries[i][1] + 1, entries[i][1], offset, contexts[i]))
            offset += contexts[i]
        return _HostInputs(ids, pos, slots, dctx, pctx, last, decodes, prefill_ctx, contexts, width)

    def _to_device(self, h: _HostInputs):
        dev = self.model.device
        to = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        mask = None
        lengths = [h.contexts[i] for i in h.decodes]
        if h.decodes and any(n != h.width for n in lengths):
            mask = (torch.arange(h.width, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None])[:, None, None, :]
        pctx = to(h.prefill_context)
        step = PagedStep(
            slots=to(h.slots),
            decode_rows=to(h.last[h.decodes]) if h.decodes else None,
            decode_context=to(h.decode_context) if h.decodes else None,
            decode_mask=mask,
            prefills=[(start, n, pctx[o : o + c]) for start, n, o, c in h.prefills],
        )
        return to(h.ids), to(h.positions), step, to(h.last)

    def warm_up(self) -> None:
        """One prefill and one decode step through the paged path, on scratch blocks."""
        from hybridgate.wire import AddRequest, SamplingParams

        seq = Sequence(AddRequest("warm-up", [1, 2, 3, 4], SamplingParams(temperature=0), 0, 2, -1))
        seq.block_table = [0]
        self.execute(ScheduledBatch([(seq, 4)]))
        seq.num_computed = 4
        seq.append(5)
        self.execute(ScheduledBatch([(seq, 1)]))
        if self.graphs is not None:
            self.graphs.capture_all()


@dataclass
class _HostInputs:
    ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slots: np.ndarray  # int64 [num_tokens]
    decode_context: np.ndarray  # int64 [num_decodes, width]
    prefill_context: np.ndarray  # int64 [sum of prefill contexts]
    last: np.ndarray  # int64 [num_entries]: row of each entry's last token
    decodes: list[int]  # entries with one new token
    prefills: list[tuple[int, int, int, int]]  # (first row, new tokens, context offset, context length)
    contexts: list[int]  # context length of each entry after this step
    width: int  # the longest decode context


def _context_slots(table: np.ndarray, block_size: int, length: int) -> np.ndarray:
    """Slots of positions 0..length-1 for a block table (int64 `[length]`)."""
    return (table[:, None] * block_size + np.arange(block_size)).ravel()[:length]
